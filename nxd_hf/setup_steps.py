"""Steps 0-3b of ``nxd_hf.parallelize``'s setup sequence (its module docstring lists them all):
the process groups, the patch, the head layout, the layer swap and the expert split. Steps 1-3b
run without collectives (inside ``fail_together``)."""

import warnings

from torch import nn

from nxd_hf import backend, parallel_state
from nxd_hf.architectures import get_patch
from nxd_hf.moe.ep_dispatch import apply_expert_parallel
from nxd_hf.parallel_layers import ParallelEmbedding
from nxd_hf.parallel_layers.heads import HeadLayout, head_layout
from nxd_hf.parallel_sizes import ParallelSizes
from nxd_hf.tp.apply import apply_tensor_parallel, base_prefix, match_plan
from nxd_hf.tp.custom_modules import random_router
from nxd_hf.tp.layouts import config_head_dim
from nxd_hf.tp.outputs import install_output_contract
from nxd_hf.tp.plan import Experts, ModelPatch


def init_parallel_state(sizes: ParallelSizes, timeout, *, replace: bool = False,
                        asked: str = "parallelize was asked for", hint: str = "") -> None:
    """Step 0: the process groups of ``sizes``, made here and only here. Groups already made for
    the same sizes are kept (``parallelize`` after the config API, a second model of one run);
    for other sizes a ValueError, unless ``replace`` (the config API, which NxD documents as
    initializing model parallelism: a new config replaces the groups). ``asked`` and ``hint`` word
    that error for the caller."""
    if parallel_state.model_parallel_is_initialized() and not replace:
        if timeout is not None:
            warnings.warn("timeout is ignored: parallel_state is already initialized; pass timeout to "
                          "parallel_state.initialize_model_parallel (or neuronx_distributed_config)", stacklevel=3)
        have = parallel_state.get_parallel_sizes()
        if (have.tp, have.pp) != (sizes.tp, sizes.pp):
            raise ValueError(f"parallel_state is initialized with tp={have.tp}, pp={have.pp} but {asked} "
                             f"tp={sizes.tp}, pp={sizes.pp}" + (f": {hint}" if hint else ""))
        if have.ep != sizes.ep:
            raise ValueError(
                f"parallel_state is initialized with expert_parallel_size={have.ep} "
                f"but {asked} expert_parallel_size={sizes.ep}: pass the same to both")
        if have.cp != sizes.cp:
            raise ValueError(
                f"parallel_state is initialized with context_parallel_size={have.cp} "
                f"but {asked} context_parallel_size={sizes.cp}: pass the same to both")
        assert have == sizes, (have, sizes)
        return
    parallel_state.initialize_model_parallel(sizes.tp, sizes.pp, timeout=timeout, expert_parallel_size=sizes.ep,
                                             context_parallel_size=sizes.cp)
    assert parallel_state.get_parallel_sizes() == sizes, (parallel_state.get_parallel_sizes(), sizes)


def requested_sizes(*, tensor_parallel_size, pipeline_parallel_size, expert_parallel_size, timeout,
                    context_parallel_size: int = 1) -> ParallelSizes:
    """The sizes asked for on the launched world (the process group is made first, from the
    torchrun environment, for its size)."""
    ParallelSizes.check_sizes(tp=tensor_parallel_size, pp=pipeline_parallel_size, ep=expert_parallel_size,
                              cp=context_parallel_size)
    backend.init_process_group_from_env(parallel_state.as_timeout(timeout))
    return ParallelSizes.for_world(backend.world_size(), tp=tensor_parallel_size, pp=pipeline_parallel_size,
                                   ep=expert_parallel_size, cp=context_parallel_size)


def resolve_patch(model, *, sequence_parallel: bool, pipeline_parallel_size: int = 1) -> ModelPatch:
    """Step 1."""
    patch = get_patch(model.config)
    if pipeline_parallel_size > 1 and patch.pipeline_refusal:
        raise ValueError(
            f"pipeline_parallel_size={pipeline_parallel_size} is not supported for model_type {patch.model_type!r}: "
            f"{patch.pipeline_refusal}. Use pipeline_parallel_size=1 (tensor and data parallelism work)"
        )
    if pipeline_parallel_size > 1:
        _refuse_random_routers(model, pipeline_parallel_size)
    if sequence_parallel and not patch.sequence_parallel:
        raise ValueError(
            f"sequence_parallel=True is not supported for model_type {patch.model_type!r}: "
            "its plan gathers activations, leaves attention replicated, runs several decoder-layer stacks (HRM), "
            "or it is an encoder. "
            "Use sequence_parallel=False"
        )
    if sequence_parallel:
        _refuse_sequence_mixers(model, patch)
    return patch


def _refuse_sequence_mixers(model, patch: ModelPatch) -> None:
    """Under sequence parallelism a replicated layer sees this rank's chunk of the sequence: exact
    for position-wise layers, wrong for one that mixes positions. A causal convolution (Mamba's
    mixer, LFM2's short conv, gated DeltaNet) is the one such layer a plan can leave replicated."""
    prefix = base_prefix(model, patch)
    layers = f"{prefix}.{patch.decoder_layers}." if prefix else f"{patch.decoder_layers}."
    for name, module in model.named_modules():
        if name.startswith(layers) and isinstance(module, nn.Conv1d) and module.kernel_size[0] > 1:
            raise ValueError(
                f"sequence_parallel=True is not supported for model_type {patch.model_type!r}: {name!r} is a "
                f"convolution over the sequence (kernel {module.kernel_size[0]}) that would see only this rank's "
                "chunk of it. Use sequence_parallel=False")


def _refuse_random_routers(model, pipeline_parallel_size: int) -> None:
    """A router that draws random numbers in training cannot route as one process does across
    stages: each stage draws from its own stream, microbatch by microbatch."""
    for name, block in model.named_modules():
        reason = random_router(block) if isinstance(getattr(block, "experts", None), nn.Module) else None
        if reason is not None:
            raise ValueError(
                f"pipeline_parallel_size={pipeline_parallel_size}: {name!r}: {reason}; each pipeline stage would draw "
                "its own numbers, microbatch by microbatch, and route tokens differently from the model on one "
                "device. Set the jitter to 0.0 in the config where it is one, or use pipeline_parallel_size=1 "
                "(data and expert parallelism work)")


def attention_layout(model, patch: ModelPatch, *, pad_model, kv_size_multiplier) -> HeadLayout | None:
    """Step 2: this rank's head layout (None for a model without attention heads in its config)."""
    config = model.config
    num_heads = getattr(config, patch.num_heads_attr, None)
    if num_heads is None:
        return None
    num_kv_heads = getattr(config, patch.num_kv_heads_attr, None) if patch.num_kv_heads_attr else None
    num_kv_heads = num_kv_heads or num_heads
    head_dim = config_head_dim(config, num_heads)
    tp_size = parallel_state.get_tensor_model_parallel_size()
    if tp_size > num_heads:
        raise ValueError(
            f"tensor_parallel_size={tp_size} exceeds the {num_heads} attention heads: some ranks would hold only "
            f"padding heads. Use tensor_parallel_size <= {num_heads}"
        )
    if pad_model not in ("auto", True, False):
        raise ValueError(f"pad_model must be 'auto', True or False, got {pad_model!r}")
    return head_layout(num_heads, num_kv_heads, head_dim, parallel_state.get_tensor_model_parallel_rank(), tp_size,
                       pad_model=pad_model, kv_size_multiplier=kv_size_multiplier)


def swap_layers(model, patch: ModelPatch, layout: HeadLayout | None, *, sequence_parallel: bool,
                gather_logits: bool, fused_loss: bool = False, check_ranges: bool = True) -> None:
    """Step 3. ``check_ranges``: the vocab-parallel embedding and loss check ids and labels on
    the device every step (``nxd_hf.guards.device_checks``; off with ``check_inputs=False``)."""
    apply_tensor_parallel(model, patch, layout, sequence_parallel=sequence_parallel)
    for module in model.modules():
        if isinstance(module, ParallelEmbedding):
            module.check_ids = check_ranges
    if patch.lm_head and _has(model, patch.lm_head):
        install_output_contract(model, vocab_size=model.config.vocab_size, gather_logits=gather_logits,
                                sequence_parallel=sequence_parallel, head=model.get_submodule(patch.lm_head),
                                fused_loss=fused_loss, check_labels=check_ranges)
    elif fused_loss:
        raise ValueError(f"fused_loss=True needs a causal-LM head ({type(model).__name__} has none): "
                         "parallelize with fused_loss=False")


def split_experts(model, patch: ModelPatch) -> None:
    """Step 3b: the fused experts split over the expert-parallel group (``nxd_hf.moe.ep_dispatch``)."""
    if parallel_state.get_expert_parallel_size() == 1:
        return
    experts = [(name, module) for name, module, style in match_plan(patch, model) if isinstance(style, Experts)]
    apply_expert_parallel(experts)


def _has(model, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True
