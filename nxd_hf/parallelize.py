"""``nxd_hf.parallelize``: the front door. Applies, in this fixed order:

1. initialize ``parallel_state`` from the torchrun environment (unless the user did);
2. look up the architecture's patch (registered, or derived from ``base_model_tp_plan``) and
   check the request against it (tp fits the heads, SP supported);
3. swap modules for parallel layers with head/vocab padding and K/V replication
   (``nxd_hf.tp.apply``), copying this rank's slices when the weights are real;
4. install the output contract (vocab-parallel loss, gathered logits);
5. install the post-backward gradient sync (SP partial grads over TP, DP average);
6. with pipeline_parallel_size > 1, trace and partition into an ``NxDPPModel`` holding only
   this rank's stages (see ``nxd_hf.pipeline``).
"""

import types

from nxd_hf import parallel_state
from nxd_hf.checkpoint.consolidate import save_pretrained
from nxd_hf.data_parallel import install_grad_sync
from nxd_hf.tp.apply import apply_tensor_parallel
from nxd_hf.tp.heads import head_layout
from nxd_hf.tp.outputs import install_output_contract
from nxd_hf.tp.plan import ModelPatch, get_patch


def _check_model(model) -> None:
    if getattr(model, "_nxd_parallelized", False):
        raise ValueError("this model is already parallelized: call nxd_hf.parallelize once, on the original model")
    if getattr(model, "is_quantized", False) or getattr(model.config, "quantization_config", None):
        raise ValueError("nxd_hf.parallelize does not support quantized models: load the model unquantized")
    if not hasattr(model, "config"):
        raise ValueError("nxd_hf.parallelize takes a Hugging Face PreTrainedModel (it needs model.config)")


def _init_parallel_state(tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
    if tensor_parallel_size < 1 or pipeline_parallel_size < 1:
        raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_size(), parallel_state.get_pipeline_model_parallel_size())
        if have != (tensor_parallel_size, pipeline_parallel_size):
            raise ValueError(
                f"parallel_state is initialized with tp={have[0]}, pp={have[1]} but parallelize was asked for "
                f"tp={tensor_parallel_size}, pp={pipeline_parallel_size}"
            )
        return
    parallel_state.initialize_model_parallel(tensor_parallel_size, pipeline_parallel_size)


def _layout(model, patch: ModelPatch, pad_model, kv_size_multiplier):
    config = model.config
    num_heads = getattr(config, patch.num_heads_attr, None)
    if num_heads is None:
        return None
    num_kv_heads = getattr(config, patch.num_kv_heads_attr, None) if patch.num_kv_heads_attr else None
    num_kv_heads = num_kv_heads or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    tp_size = parallel_state.get_tensor_model_parallel_size()
    if tp_size > num_heads:
        raise ValueError(
            f"tensor_parallel_size={tp_size} exceeds the {num_heads} attention heads: some ranks would hold only "
            f"padding heads. Use tensor_parallel_size <= {num_heads}"
        )
    if pad_model not in ("auto", True, False):
        raise ValueError(f"pad_model must be 'auto', True or False, got {pad_model!r}")
    return head_layout(
        num_heads, num_kv_heads, head_dim, parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_size(), pad_model=pad_model, kv_size_multiplier=kv_size_multiplier,
    )


def parallelize(
    model, *, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, sequence_parallel: bool = False,
    pad_model: bool | str = "auto", kv_size_multiplier: int | str = "auto", gather_logits: bool = False,
    bucket_size_mb: float = 25, **pipeline_kwargs,
):
    """Shard a Hugging Face model (real or meta weights) in place and return it.

    tensor_parallel_size: TP degree; heads are padded and K/V replicated as needed.
    pipeline_parallel_size: PP degree (ranks beyond tp x pp are data-parallel replicas).
    sequence_parallel: split activations along the sequence between TP regions (decoders).
    pad_model: "auto"/True pad heads when tp does not divide them; False forbids it.
    kv_size_multiplier: K/V copies across TP ("auto": the fewest that fit).
    gather_logits: also return full logits in training mode when labels are given.
    bucket_size_mb: bucket size of the post-backward gradient all-reduces.
    pipeline_kwargs: with pipeline_parallel_size > 1, ``NxDPPModel`` arguments (num_microbatches,
        schedule, virtual_pipeline_size, pipeline_cuts, activation_checkpoint_config, ...); the
        result is then an ``NxDPPModel`` trained with ``run_train``.
    """
    _check_model(model)
    if bucket_size_mb <= 0:
        raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
    _init_parallel_state(tensor_parallel_size, pipeline_parallel_size)
    if pipeline_kwargs and pipeline_parallel_size == 1:
        raise ValueError(f"{sorted(pipeline_kwargs)} are pipeline options: they need pipeline_parallel_size > 1")
    patch = get_patch(model.config)
    if sequence_parallel and not patch.sequence_parallel:
        raise ValueError(
            f"sequence_parallel=True is not supported for model_type {patch.model_type!r}: "
            "its plan gathers activations or it is an encoder. Use sequence_parallel=False"
        )
    layout = _layout(model, patch, pad_model, kv_size_multiplier)
    apply_tensor_parallel(model, patch, layout, sequence_parallel=sequence_parallel)
    if patch.lm_head and _has(model, patch.lm_head):
        install_output_contract(model, vocab_size=model.config.vocab_size, gather_logits=gather_logits,
                                sequence_parallel=sequence_parallel)
    install_grad_sync(model, bucket_size_mb=bucket_size_mb)
    model._nxd_parallelized = True
    model._nxd_patch = patch
    if pipeline_parallel_size > 1:
        from nxd_hf.pipeline.model import NxDPPModel

        model = NxDPPModel(model, **pipeline_kwargs)
    model.save_pretrained = types.MethodType(save_pretrained, model)  # the plain HF format, gathered
    return model


def _has(model, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True

