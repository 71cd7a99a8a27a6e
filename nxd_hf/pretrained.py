"""``nxd_hf.from_pretrained``: build on the meta device, parallelize, read only local slices."""

import accelerate
import torch
import transformers

from nxd_hf import backend
from nxd_hf.checkpoint.hf_dp_shards import load_hf_into_dp_shards
from nxd_hf.checkpoint.hf_safetensors import LoadReport, check_checkpoint_dir, load_hf_safetensors
from nxd_hf.guards.fail_together import fail_together
from nxd_hf.lora.meta_base import hf_base_name, meta_base_refusal
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
    ``model.nxd.load_report`` holds the bytes this rank read. With ``data_parallel_sharding`` the
    parameters are read straight into FSDP2's data-parallel shards: no rank holds more than its
    shard plus one parameter's DP rows (docs/fsdp.md); with ``lora_config`` too, the adapters made
    on the meta base as plain peft makes them (each pipeline stage's as on the whole model; not with
    ``modules_to_save``, ``trainable_token_indices``, ``target_parameters`` or NxD's
    ``load_lora_from_ckpt``: then the TP shard is read first).
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
        # accelerate's meta context registers a new Parameter for every assignment, which unties what
        # transformers tied in __init__ (GPT-2's, Qwen2's head and embedding): tie them again, as
        # transformers' own from_pretrained does, so the head's gradient reaches the embedding
        hf_model.tie_weights()
    reports = []
    # ZeRO-2/3: the parameters are read into FSDP2's DP shards, never whole (nxd_hf.fsdp.load); LoRA's
    # adapters are made at setup on the meta base (nxd_hf.lora.meta_base), and the base's names are peft's
    lora_config = parallelize_kwargs.get("lora_config")
    into_dp_shards = (parallelize_kwargs.get("data_parallel_sharding") is not None
                      and meta_base_refusal(lora_config) is None)
    hf_name = hf_base_name if lora_config is not None else None

    def load_weights(modules):  # setup step 5, on this rank's modules (its stages with PP)
        device = parallelize_kwargs.get("device") or backend.default_device()  # as parallelize's default
        # no fail_together of its own: setup step 5 runs inside one (nxd_hf.model_setup.local)
        reports.append(load_hf_safetensors(modules, path, hf_model=hf_model, device=device,
                                           parameters=not into_dp_shards))

    def load_dp_shards(modules):  # the model, or this rank's pipeline stages
        reports.append(load_hf_into_dp_shards(modules, path, hf_model=hf_model, hf_name=hf_name))

    model = parallelize(hf_model, tensor_parallel_size=tensor_parallel_size,
                        pipeline_parallel_size=pipeline_parallel_size, load_weights=load_weights,
                        expert_parallel_size=expert_parallel_size,
                        load_dp_shards=load_dp_shards if into_dp_shards else None, **parallelize_kwargs)
    model.nxd.record_load_report(LoadReport(
        bytes_read=sum(r.bytes_read for r in reports), keys_read=sum(r.keys_read for r in reports),
        bytes_padding=sum(r.bytes_padding for r in reports), largest_bytes=max(r.largest_bytes for r in reports)))
    model.eval()
    return model
