"""``nxd_hf.from_pretrained``: build on the meta device, parallelize, read only local slices."""

import accelerate
import torch
import transformers

from nxd_hf import backend
from nxd_hf.checkpoint.hf_safetensors import check_checkpoint_dir, load_hf_safetensors
from nxd_hf.guards.fail_together import fail_together
from nxd_hf.parallelize import parallelize


def from_pretrained(path: str, *, auto_class=transformers.AutoModelForCausalLM, tensor_parallel_size: int = 1,
                    pipeline_parallel_size: int = 1, dtype: torch.dtype | None = None, expert_parallel_size: int = 1,
                    **parallelize_kwargs):
    """Load a local HF checkpoint (``model.safetensors`` or sharded with an index) straight into
    a parallelized model. No rank ever holds the full weights: the model is built on the meta
    device (buffers such as RoPE ``inv_freq`` are computed normally), sharded, and each rank
    reads its own rows of every tensor. ``dtype`` defaults to the checkpoint config's dtype.
    With ``pipeline_parallel_size`` > 1 it returns an ``NxDPPModel`` and each rank reads only
    the weights of its own stages. Slices go from the file straight to ``device`` (default: the
    backend's compute device, as ``parallelize``). Returns the model in eval mode, as transformers does;
    ``model.nxd.load_report`` holds the bytes this rank read.
    expert_parallel_size: split each mixture-of-experts layer's experts over this many
    data-parallel ranks (``parallelize``); each rank reads only its experts' per-expert tensors.
    """
    check_checkpoint_dir(path)
    with fail_together("nxd_hf.from_pretrained (reading config.json)"):
        config = transformers.AutoConfig.from_pretrained(path)
        dtype = dtype or getattr(config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        with accelerate.init_empty_weights(include_buffers=False):
            hf_model = auto_class.from_config(config, dtype=dtype)
    reports = []

    def load_weights(modules):  # setup step 5, on this rank's modules (its stages with PP)
        device = parallelize_kwargs.get("device") or backend.default_device()  # as parallelize's default
        # no fail_together of its own: setup step 5 runs inside one (nxd_hf.model_setup.local)
        reports.append(load_hf_safetensors(modules, path, hf_model=hf_model, device=device))

    model = parallelize(hf_model, tensor_parallel_size=tensor_parallel_size,
                        pipeline_parallel_size=pipeline_parallel_size, load_weights=load_weights,
                        expert_parallel_size=expert_parallel_size, **parallelize_kwargs)
    model.nxd.record_load_report(reports[0])
    model.eval()
    return model
