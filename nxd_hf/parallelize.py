"""``nxd_hf.parallelize``: the one setup sequence every parallel model goes through.

``parallelize``, ``nxd_hf.from_pretrained``, the config API (``initialize_parallel_model``) and
a directly constructed ``NxDPPModel`` all run these steps, in this order:

 0. initialize ``parallel_state`` from the torchrun environment (unless the user did);
 1. resolve the patch: registered for ``config.model_type``, or derived from HF's
    ``base_model_tp_plan`` (``nxd_hf.architectures``); check the request against it;
 2. pad heads: the attention-head layout of this rank (``nxd_hf.parallel_layers.heads``: K/V
    replication, zero heads where tp does not divide them);
 3. swap layers for parallel ones (TP, SP), copying this rank's slices of real weights, and
    install the output contract (vocab-parallel loss, gathered logits) — ``nxd_hf.tp`` — and
    the first-step input check (``nxd_hf.guards.input_check``);
    3b. with ``expert_parallel_size`` > 1, split the fused experts of mixture-of-experts layers
    over the expert-parallel group, tokens dispatched by all-to-all (``nxd_hf.moe.ep_dispatch``);
    steps 1-3 run without collectives inside ``fail_together``: a rank failing alone there
    fails every rank with the same ValueError instead of leaving them in the next collective;
 4. partition into pipeline stages, keeping this rank's (``NxDPPModel``, when pp > 1);
 5. weights: load only the local ones (``load_weights``; ``from_pretrained`` reads its slices),
    or materialize meta weights with ``param_init_fn``; under ZeRO-2/3 the meta parameters wait,
    and are read or initialized into FSDP2's DP shards once sharded
    (``nxd_hf.fsdp.load.fill_dp_shards``; LoRA's adapters made on the meta base at step 7,
    ``nxd_hf.lora.meta_base``, and drawn again after ``param_init_fn``'s init);
 6. tie weights shared by stages on different pipeline ranks;
 7. adapters: LoRA through peft (``lora_config``; ``nxd_hf.lora.setup.setup_lora``: inject, and
    NxD's ``load_lora_from_ckpt``);
 8. activation checkpointing;
 9. the gradient-reduction policy (``nxd_hf.parallel_layers.grad_reduction``);
10. move to the device.
Steps 0-3b are functions of ``nxd_hf.setup_steps``; the sizes are one ``ParallelSizes``
(``nxd_hf.parallel_sizes``), resolved from "auto" first. Steps 5-10 run on this rank's modules
in ``nxd_hf.model_setup.finish_parallel_model``: on the whole model at pp=1, inside
``NxDPPModel`` on its local stages otherwise; it records what the steps decided in one
``NxDModelState``, ``model.nxd`` (``nxd_hf.model_state``), made with every field set.
"""

import difflib
import functools
import inspect

from nxd_hf import backend, parallel_state
from nxd_hf.checkpoint.consolidate import save_pretrained
from nxd_hf.context import check_context_parallel, install_context_parallel
from nxd_hf.context.model import router_token_mask
from nxd_hf.fsdp import DataParallelSharding, check_data_parallel_sharding, shard_data_parallel
from nxd_hf.fsdp.load import fill_dp_shards, init_after_sharding
from nxd_hf.model_setup import LocalSetup, SetupRecord, finish_parallel_model
from nxd_hf.model_setup.local import target_device
from nxd_hf.model_setup.activation_checkpoint import decoder_layer_types
from nxd_hf.model_setup.materialize import refuse_deferred_init
from nxd_hf.model_state import state_of
from nxd_hf.guards.input_check import install_input_check, resolve_mode
from nxd_hf.guards.fail_together import fail_together
from nxd_hf.guards.same_everywhere import check_same_on_every_rank, model_summary
from nxd_hf.lora import register_with_peft
from nxd_hf.lora.meta_base import AdapterRedraw, meta_base_refusal, redraw_adapters
from nxd_hf.moe.replica_aux import install_global_aux_loss
from nxd_hf.parallel_sizes import ParallelSizes
from nxd_hf.setup_steps import (
    attention_layout, init_parallel_state, requested_sizes, resolve_patch, split_experts, swap_layers,
)


def parallelize(
    model, *, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, sequence_parallel: bool = False,
    pad_model: bool | str = "auto", kv_size_multiplier: int | str = "auto", gather_logits: bool = False,
    bucket_size_mb: float = 25, param_init_fn=None, load_weights=None, activation_checkpoint_config=None,
    fp32_grad_accumulation: bool = False, device=None, check_inputs: bool | str = True, timeout=None,
    lora_config=None, autocast_adapter_dtype: bool = True, fused_loss: bool = False, expert_parallel_size: int = 1,
    data_parallel_sharding: DataParallelSharding | None = None, data_parallel_shard_size: int | None = None,
    data_parallel_offload: bool = False, context_parallel_size: int = 1, context_parallel_attention: str = "auto",
    load_dp_shards=None, **pipeline_kwargs,
):
    """Shard a Hugging Face model (real or meta weights) in place and return it.

    tensor_parallel_size: TP degree; heads are padded and K/V replicated as needed. "auto" (also for
        pipeline_parallel_size): the best layout of ``nxd_hf.plan`` for this model and world (``_auto_sizes``).
    pipeline_parallel_size: PP degree (ranks beyond tp x pp are data-parallel replicas).
    sequence_parallel: split activations along the sequence between TP regions (decoders).
    pad_model: "auto"/True pad heads when tp does not divide them; False forbids it.
    kv_size_multiplier: K/V copies across TP ("auto": the fewest that fit).
    gather_logits: also return full logits in training mode when labels are given.
    fused_loss: in training with labels, compute the causal-LM loss from the hidden states in
        chunks with the LM head fused in (``nxd_hf.parallel_layers.fused_loss``): the full
        logits are never held (docs/gpu_speed.md).
    bucket_size_mb: bucket size of the gradient all-reduces.
    param_init_fn: ``fn(module)`` initializing meta-device weights once materialized (NxD's).
    load_weights: ``fn(modules)`` filling this rank's meta weights of ``modules`` instead
        (``nxd_hf.from_pretrained`` passes its safetensors reader).
    activation_checkpoint_config: "full" (every transformer layer), a module class or a list
        of classes to recompute in backward; None for none.
    fp32_grad_accumulation: accumulate bf16/fp16 gradients in an fp32 ``param.main_grad``.
    device: where the model ends up (default: the backend's compute device, ``cuda:LOCAL_RANK``
        under nccl, the CPU under gloo; a model already on an accelerator stays there). Meta
        weights are materialized and loaded straight on it.
    lora_config: a ``peft.LoraConfig`` (or NxD's ``nxd_hf.modules.lora.LoraConfig``): LoRA
        adapters on this rank's layers, exactly sharded (``nxd_hf.lora``); only they train.
    autocast_adapter_dtype: as ``peft.get_peft_model``'s: adapters on a bf16/fp16 model are fp32
        (True, peft's default) or take the base layer's dtype (False).
    check_inputs: check id/label ranges and that the TP/PP ranks got the same batch on the first
        step (True), every step ("always") or never (False); see ``guards.input_check``.
    timeout: seconds (or a timedelta) a collective waits for the other ranks before raising a
        TimeoutError naming its group (None: torch's default, 30 minutes; 10 for nccl).
    expert_parallel_size: ranks the experts of each mixture-of-experts layer are split over,
        carved from the data-parallel ranks (must divide them); tokens reach their experts by
        all-to-all (``nxd_hf.moe.ep_dispatch``, docs/moe.md).
    data_parallel_sharding: "zero3" (parameters, gradients and optimizer state) or "zero2" (gradients and
        optimizer state) sharded over the data-parallel ranks by torch's FSDP2 (``nxd_hf.fsdp``,
        docs/fsdp.md); None: every DP rank holds the whole TP shard (DDP, or ZeRO-1's optimizer).
    load_dp_shards: with data_parallel_sharding, ``fn(modules)`` filling the parameters of ``modules``
        (the model, or this rank's pipeline stages) once FSDP2 has sharded them on the meta device
        and each rank's local shards are allocated (``nxd_hf.fsdp.load``); ``load_weights`` then
        fills the buffers only. No rank ever holds a TP shard whole. ``nxd_hf.from_pretrained``
        passes its reader. Without it, ``param_init_fn`` on a model wholly on the meta device under
        data_parallel_sharding initializes the DP shards the same way, one TP-local parameter at a
        time (``nxd_hf.fsdp.init``; ``model.nxd.init_report``). With lora_config: not with
        modules_to_save, trainable_token_indices, target_parameters or load_lora_from_ckpt
        (``nxd_hf.lora.meta_base.meta_base_refusal``; else the TP shard is materialized first).
    data_parallel_shard_size: with data_parallel_sharding, shard over groups of this many DP ranks and
        replicate across the groups (HSDP); None: shard over every DP rank.
    data_parallel_offload: with data_parallel_sharding, keep the shards (parameters, gradients and so the
        optimizer state) in host memory between uses (FSDP2's ``CPUOffloadPolicy``; the optimizer then steps
        on the CPU).
    context_parallel_size: ranks each sequence is split over, through attention itself, carved
        from the data-parallel ranks; every CP rank of a replica passes the same full batch
        (``nxd_hf.context``, docs/context_parallel.md).
    context_parallel_attention: "ring", "all_to_all" (heads divisible by tp x cp) or "auto" (ring).
    pipeline_kwargs: with pipeline_parallel_size > 1, ``NxDPPModel`` arguments (num_microbatches,
        schedule, virtual_pipeline_size, pipeline_cuts, use_zero1_optimizer, ...); the result is
        then an ``NxDPPModel`` trained with ``run_train``.

    Gradients are reduced as ``nxd_hf.parallel_layers.grad_reduction`` describes: averaged over
    data-parallel ranks at the end of each backward unless inside ``model.no_sync()`` or an
    optimizer that reduces itself (``NeuronZero1Optimizer``) registered.
    """
    _check_model(model)
    _check_pipeline_option_names(pipeline_kwargs)
    auto = "auto" in (tensor_parallel_size, pipeline_parallel_size)
    if auto:
        sizes = _auto_sizes(model, tensor_parallel_size, pipeline_parallel_size, expert_parallel_size, timeout,
                            lora_config=lora_config, sequence_parallel=sequence_parallel,
                            recompute=activation_checkpoint_config is not None,
                            data_parallel_sharding=data_parallel_sharding, cp=context_parallel_size)
        tensor_parallel_size, pipeline_parallel_size = sizes.tp, sizes.pp
    register_with_peft()  # peft.get_peft_model on the result then knows the parallel layers
    if bucket_size_mb <= 0:
        raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
    arguments = dict(
        tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
        sequence_parallel=sequence_parallel, pad_model=pad_model, kv_size_multiplier=kv_size_multiplier,
        gather_logits=gather_logits, check_inputs=check_inputs, lora_config=type(lora_config).__name__,
        fused_loss=fused_loss, activation_checkpoint_config=repr(activation_checkpoint_config),
        pipeline_options=sorted(pipeline_kwargs), expert_parallel_size=expert_parallel_size,
        data_parallel_sharding=data_parallel_sharding, data_parallel_shard_size=data_parallel_shard_size,
        data_parallel_offload=data_parallel_offload,
        context_parallel_size=context_parallel_size, context_parallel_attention=context_parallel_attention,
        load_dp_shards=load_dp_shards is not None)
    check_same_on_every_rank("nxd_hf.parallelize", {**arguments, **model_summary(model)}, noun="arguments",
                             timeout=timeout, fix="Every rank must call it with the same arguments and the same model")
    if not auto:  # checked after the agreement: sizes wrong on some ranks only fail every rank alike
        check_context_parallel(context_parallel_size, context_parallel_attention,
                               pipeline_parallel_size=pipeline_parallel_size, expert_parallel_size=expert_parallel_size)
        sizes = requested_sizes(tensor_parallel_size=tensor_parallel_size,
                                pipeline_parallel_size=pipeline_parallel_size,
                                expert_parallel_size=expert_parallel_size, timeout=timeout,
                                context_parallel_size=context_parallel_size)
    init_parallel_state(sizes, timeout)
    with fail_together("nxd_hf.parallelize"):  # no collective inside: a rank failing alone fails every rank
        check_data_parallel_sharding(data_parallel_sharding, expert_parallel_size=expert_parallel_size,
                                     pipeline_kwargs=pipeline_kwargs, shard_size=data_parallel_shard_size,
                                     offload=data_parallel_offload)
        # LoRA: adapters made on the meta base at step 7 (nxd_hf.lora.meta_base), every stage's at pp > 1
        adapters_on_meta = lora_config is None or meta_base_refusal(lora_config) is None
        if load_dp_shards is not None and (data_parallel_sharding is None or not adapters_on_meta):
            raise ValueError("load_dp_shards loads the weights into FSDP2's data-parallel shards: it needs "
                             "data_parallel_sharding, and with lora_config no modules_to_save, "
                             "trainable_token_indices, target_parameters or load_lora_from_ckpt "
                             "(load the weights with load_weights instead)")
        if pipeline_kwargs and sizes.pp == 1:
            raise ValueError(f"{sorted(pipeline_kwargs)} are pipeline options: they need pipeline_parallel_size > 1")
        if fused_loss and sizes.pp > 1:
            raise ValueError("fused_loss=True is not supported with pipeline_parallel_size > 1 (the last stage computes "
                             "the loss from its logits): use fused_loss=False")
        patch = resolve_patch(model, sequence_parallel=sequence_parallel, pipeline_parallel_size=sizes.pp)
        layout = attention_layout(model, patch, pad_model=pad_model, kv_size_multiplier=kv_size_multiplier)
        swap_layers(model, patch, layout, sequence_parallel=sequence_parallel, gather_logits=gather_logits,
                    fused_loss=fused_loss, check_ranges=resolve_mode(check_inputs) != "off")
        split_experts(model, patch)
        install_context_parallel(model, kind=context_parallel_attention, sequence_parallel=sequence_parallel)
        check = install_input_check(model, check_inputs)
    if sizes.pp == 1:  # the pipeline computes the global aux loss itself (pipeline.router_aux)
        install_global_aux_loss(model, token_mask=router_token_mask if sizes.cp > 1 else None)
    # ZeRO-2/3: weights loaded or initialized into FSDP2's DP shards, the TP shard never whole (nxd_hf.fsdp.load)
    fill_after = load_dp_shards is not None or init_after_sharding(model, data_parallel_sharding, param_init_fn,
                                                                    load_weights=load_weights,
                                                                    adapters_on_meta=adapters_on_meta)
    # LoRA with param_init_fn: the adapters drawn again after the init (step 7 records how: AdapterRedraw)
    redraw = AdapterRedraw() if fill_after and load_dp_shards is None and lora_config is not None else None
    setup = LocalSetup(load_weights=load_weights, param_init_fn=param_init_fn, buffer_init=getattr(model, "_init_weights", None),
                       add_adapters=_adapters(model, lora_config, autocast_adapter_dtype, device, redraw),
                       activation_checkpoint_config=activation_checkpoint_config,
                       fp32_grad_accumulation=fp32_grad_accumulation, bucket_size_mb=bucket_size_mb, device=device,
                       parameters_after_sharding=fill_after,
                       record=SetupRecord(patch=patch, head_layout=layout, input_check=check, on_hf_model=True))
    if sizes.pp > 1:
        from nxd_hf.pipeline.model import NxDPPModel  # step 4; it runs steps 5-10 on its stages

        pp_model = NxDPPModel(model, setup=setup, **pipeline_kwargs)
        if data_parallel_sharding is not None:  # each local stage its own FSDP root over the DP group
            shard_data_parallel(pp_model, data_parallel_sharding, policy=pp_model.nxd.grad_reduction,
                                layer_types=pp_model.layer_types, shard_size=data_parallel_shard_size,
                                roots=pp_model.local_modules(), offload=data_parallel_offload)
        if fill_after:
            fill_dp_shards(pp_model, pp_model.local_modules(), target_device(device, pp_model.local_modules()),
                           load_dp_shards=load_dp_shards, param_init_fn=param_init_fn,
                           sync_ties=pp_model.tied.sync_initial_values,
                           init_modules=redraw.base_modules if redraw else None)
        if redraw is not None and pp_model.nxd.adapters is not None:
            redraw_adapters(pp_model.local_modules(), whole_model=redraw.whole_model)
        pp_model.save_pretrained = _save_pretrained(pp_model, lora_config)
        model.save_pretrained = _save_pretrained(pp_model, lora_config)  # the user's object: its stages' weights
        return pp_model
    layer_types = decoder_layer_types(model) if activation_checkpoint_config == "full" else ()
    hooks_on = model if data_parallel_sharding is None else None  # ZeRO-2/3: FSDP2 does the DP mean
    state = finish_parallel_model(model, [model], setup, carriers=[model], layer_types=layer_types, hooks_on=hooks_on)
    model.no_sync = state.grad_reduction.no_sync
    if data_parallel_sharding is not None:  # FSDP2 over the DP group (nxd_hf.fsdp)
        shard_data_parallel(model, data_parallel_sharding, policy=state.grad_reduction,
                            shard_size=data_parallel_shard_size, offload=data_parallel_offload)
    if fill_after:
        fill_dp_shards(model, [model], target_device(device, [model]), load_dp_shards=load_dp_shards,
                       param_init_fn=param_init_fn, init_modules=redraw.base_modules if redraw else None)
    if redraw is not None and state.adapters is not None:
        redraw_adapters([model])
    model.save_pretrained = _save_pretrained(model, lora_config)
    return model


def _save_pretrained(model, lora_config):
    """The parallel model's ``save_pretrained`` (every rank calls it): the plain HF format,
    gathered; with ``lora_config`` the adapter, as ``PeftModel.save_pretrained`` writes it (the
    trained part, which ``peft.PeftModel.from_pretrained(plain_model, directory)`` loads)."""
    if lora_config is None:
        return functools.partial(save_pretrained, model)
    from nxd_hf.lora import save_adapter

    def save_lora_adapter(save_directory: str, **kwargs) -> None:
        if kwargs:
            backend.warn_once(f"save_pretrained: options {sorted(kwargs)} are ignored for a parallelized model",
                              stacklevel=2)
        save_adapter(model, save_directory)

    return save_lora_adapter


def _adapters(model, lora_config, autocast_adapter_dtype: bool, device, redraw: AdapterRedraw | None):
    """Step 7's function for ``LocalSetup.add_adapters`` (None without ``lora_config``)."""
    if lora_config is None:
        return None
    from nxd_hf.lora.setup import setup_lora

    return functools.partial(setup_lora, lora_config=lora_config, model=model,
                             autocast_adapter_dtype=autocast_adapter_dtype, device=device,
                             redraw=redraw)


def _check_pipeline_option_names(pipeline_kwargs: dict) -> None:
    """A keyword ``parallelize`` does not take and ``NxDPPModel`` does not either is a typo: name
    it, and the closest argument, instead of calling it a pipeline option."""
    from nxd_hf.pipeline.model import NxDPPModel

    pipeline = set(inspect.signature(NxDPPModel.__init__).parameters) - {"self", "module", "setup"}
    unknown = sorted(set(pipeline_kwargs) - pipeline)
    if unknown:
        known = sorted(pipeline | set(inspect.signature(parallelize).parameters) - {"model", "pipeline_kwargs"})
        hints = [f"{name!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(name, known, 1))
                 else repr(name) for name in unknown]
        raise ValueError(f"nxd_hf.parallelize got unknown argument(s) {', '.join(hints)}: it takes {known}")


def _check_model(model) -> None:
    refuse_deferred_init(model)
    if not hasattr(model, "config") or not hasattr(model, "named_modules"):
        raise ValueError(
            f"{type(model).__name__} is not a Hugging Face model (it has no .config): nxd_hf.parallelize takes a "
            "transformers PreTrainedModel. Build your own modules from nxd_hf.parallel_layers "
            "(ColumnParallelLinear, RowParallelLinear, ParallelEmbedding) or wrap them in NxDPPModel")
    if state_of(model) is not None:
        raise ValueError("this model is already parallelized: call nxd_hf.parallelize once, on the original model")
    if getattr(model, "is_quantized", False) or getattr(model.config, "quantization_config", None):
        raise ValueError("nxd_hf.parallelize does not support quantized models: load the model unquantized")


def _auto_sizes(model, tp, pp, ep, timeout, *, lora_config, sequence_parallel: bool, recompute: bool,
                data_parallel_sharding=None, cp: int = 1) -> ParallelSizes:
    """``"auto"`` sizes: ``nxd_hf.plan``'s best layout for this model on the launched world, for
    one sequence of ``max_position_embeddings`` tokens (at most 4096) per rank and step, with the
    smallest memory any rank has (every rank then takes the same sizes); the sizes given as
    integers, sequence parallelism, recomputation and ``data_parallel_sharding`` stay as asked.
    ``NxDTrainingArguments``' "auto" prices the training arguments' batch instead."""
    from nxd_hf.plan.auto import device_memory_bytes, resolve_auto_sizes

    backend.init_process_group_from_env(parallel_state.as_timeout(timeout))
    memory = min(backend.all_gather_object(device_memory_bytes()))
    return resolve_auto_sizes(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, expert_parallel_size=ep,
                              context_parallel_size=cp, sequence_parallel=sequence_parallel, recompute=recompute,
                              lora_config=lora_config, world_size=backend.world_size(), device_memory=memory,
                              data_parallel_sharding=data_parallel_sharding)
