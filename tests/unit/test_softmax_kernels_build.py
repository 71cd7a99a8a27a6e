"""The fused loss's Triton kernels compile for a Hopper GPU (H100/H200, sm_90) without one: Triton's
own compiler, down to the cubin (ptxas comes with Triton), for every logits dtype, both
variants of the row statistics and soft-capped logits, with the launch parameters ``softmax_kernels`` uses at a 128k
vocabulary. The interpreter tests check what the kernels compute; this checks what the GPU's
compiler accepts (its type rules for loop-carried values, casts, constexpr branches), and that the
gradient is rounded to nearest when narrowed."""

import subprocess
import sys

import pytest

from nxd_hf.parallel_layers import softmax_kernels

BUILD = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nxd_hf.parallel_layers import softmax_kernels

row_stats, grad_in_place = softmax_kernels._kernels()
launch = softmax_kernels._launch_shape(128256)
block, options = launch.pop("BLOCK"), {"num_warps": launch["num_warps"]}
target = GPUTarget("cuda", 90, 32)
built = {}
for with_sum, softcap in ((False, False), (True, False), (True, True)):
    signature = {"logits": "*bf16", "stride": "i32", "num_real": "i32", "softcap": "fp32", "row_max": "*fp32",
                 "row_sum_exp": "*fp32", "row_sum": "*fp32", "WITH_SUM": "constexpr", "SOFTCAP": "constexpr",
                 "BLOCK": "constexpr"}
    constexprs = {"WITH_SUM": with_sum, "SOFTCAP": softcap, "BLOCK": block}
    kernel = triton.compile(ASTSource(fn=row_stats, signature=signature, constexprs=constexprs), target=target,
                            options=options)
    built[f"row_stats sum={with_sum} softcap={softcap}"] = {"cubin": len(kernel.asm["cubin"])}
for dtype, softcap in (("bf16", False), ("fp16", False), ("fp32", False), ("bf16", True)):
    signature = {"logits": "*" + dtype, "stride": "i32", "num_cols": "i32", "num_real": "i32", "label": "*i64",
                 "row_max": "*fp32", "row_sum_exp": "*fp32", "row_scale": "*fp32", "target_weight": "fp32",
                 "uniform_weight": "fp32", "softcap": "fp32", "SOFTCAP": "constexpr", "BLOCK": "constexpr"}
    kernel = triton.compile(ASTSource(fn=grad_in_place, signature=signature,
                                      constexprs={"SOFTCAP": softcap, "BLOCK": block}), target=target, options=options)
    built[f"grad {dtype}" + (" softcap" if softcap else "")] = {"cubin": len(kernel.asm["cubin"]),
                                                                "ptx": kernel.asm["ptx"]}
json.dump({"triton": triton.__version__, "block": block, **options, "built": built}, sys.stdout)
"""


@pytest.mark.skipif(not softmax_kernels.TRITON_INSTALLED, reason="Triton is not installed")
def test_kernels_compile_for_sm90():
    import json
    import os

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}  # compiled, not interpreted
    run = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert (result["block"], result["num_warps"]) == (32768, 32)
    assert set(result["built"]) == {"row_stats sum=False softcap=False", "row_stats sum=True softcap=False",
                                    "row_stats sum=True softcap=True", "grad bf16", "grad fp16", "grad fp32",
                                    "grad bf16 softcap"}
    assert all(kernel["cubin"] > 0 for kernel in result["built"].values())
    # fp32 -> bf16 / fp16 with round-to-nearest-even (truncation would bias every gradient toward zero)
    assert "cvt.rn.bf16.f32" in result["built"]["grad bf16"]["ptx"]
    assert "cvt.rn.bf16.f32" in result["built"]["grad bf16 softcap"]["ptx"]
    assert "cvt.rn.f16.f32" in result["built"]["grad fp16"]["ptx"]
