"""Every vendored case with torch's ops and with the Triton kernels (interpreted on a CPU)."""

import pytest
import torch

from nxd_hf.parallel_layers import softmax_kernels

from . import liger_api

_TRITON = pytest.mark.skipif(not softmax_kernels.TRITON_INSTALLED,
                             reason="Triton is not installed (`pip install -e '.[kernel-tests]'`)")
_LARGE_V = 4096  # Liger's large shape: (8, 128, 1024, 4096)


@pytest.fixture(autouse=True, params=["torch", pytest.param("triton", marks=_TRITON)])
def nxd_kernel(request, monkeypatch):
    params = request.node.callspec.params
    if params.get("V") == _LARGE_V and not torch.cuda.is_available():
        low = params.get("dtype", params.get("cast_dtype")) in (torch.bfloat16, torch.float16)
        if low:
            pytest.skip("bf16/fp16 at the large shape: 35 s a case on a CPU without bf16 matmuls (run on a GPU: "
                        "test_gpu.py::test_liger_conformance_on_gpu)")
        if request.param == "triton":
            pytest.skip("Triton's interpreter at the large shape: 9-17 s a case (compiled on a GPU: "
                        "test_gpu.py::test_liger_conformance_on_gpu)")
    if request.param == "triton" and params.get("reduction") == "sum" and not torch.cuda.is_available():
        pytest.skip("the interpreter's 2-3 s a case spent once, on the mean: the sum runs the same kernels (the "
                    "reduction comes after them)")
    monkeypatch.setattr(liger_api, "KERNEL", request.param)
    return request.param
