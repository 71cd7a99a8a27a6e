"""The communication terms of one optimizer step of a whole model under a layout, per rank of
the busiest pipeline stage: each decoder layer's tensor-parallel traffic (``comm.block_terms``'s
theory), the vocab-parallel embedding, LM head and loss, the weight-gradient syncs the layout
needs (replicated K/V, sequence-parallel norms, per-head norms, LoRA factors), data-parallel
gradient reduction (all-reduce, ZeRO-1's reduce-scatter and all-gather, or FSDP2's all-gathers and
reduce-scatter), a tied embedding's gradient sum over the pipeline, the pipeline's sends and
context-parallel attention's K/V (ring) or Q/K/V (all-to-all) traffic. Under context parallelism
every token-proportional term counts the rank's own tokens (a cp-th of the sequence)."""

import dataclasses

from nxd_hf.plan.activations import ActivationTrace
from nxd_hf.plan.comm import FP32_BYTES, Term, bucket_count, kv_size_multiplier
from nxd_hf.plan.layout import Layout
from nxd_hf.plan.memory import BUCKET_BYTES, Workload, stage_layers
from nxd_hf.plan.shapes import POST, PRE, ModelShape, RankParams
from nxd_hf.parallel_layers.sharding import padded_size


def _add(terms: list, **kw) -> None:
    if kw["count"] > 0:
        terms.append(Term(**kw))


def _tp_activation_terms(shape: ModelShape, work: Workload, layout: Layout, layers: range, first_layers: bool,
                         last_layers: bool, first: bool, last: bool, recomputed: int) -> list[Term]:
    """Per step (all microbatches) on one stage: layers, embedding, LM head and loss (``recomputed``:
    the reductions the stage's recomputed forwards run again)."""
    m, tp = layout.num_microbatches, layout.tp
    act = work.micro_batch_size * work.seq_len * shape.hidden * FP32_BYTES
    tokens_bytes = work.micro_batch_size * work.seq_len * FP32_BYTES
    n = len(layers)
    # the first layer's attention input needs no gradient when the embedding is frozen (LoRA)
    skip = 1 if (work.lora and first_layers) else 0
    terms = []
    if layout.sequence_parallel:
        _add(terms, phase="fwd", op="all_gather", kind="activation", count=m * (2 * n + last_layers),
             payload_bytes=m * (2 * n + last_layers) * act // tp, formula="m x (2L + last) x b*(s/tp)*h*4")
        _add(terms, phase="fwd", op="reduce_scatter", kind="activation", count=m * 2 * n,
             payload_bytes=m * 2 * n * act, formula="m x 2L x b*s*h*4")
        back = 2 * n + (first_layers and not work.lora)
        _add(terms, phase="bwd", op="all_gather", kind="activation", count=m * back,
             payload_bytes=m * back * act // tp, formula="m x (2L + first) x b*(s/tp)*h*4")
        _add(terms, phase="bwd", op="reduce_scatter", kind="activation", count=m * (2 * n - skip),
             payload_bytes=m * (2 * n - skip) * act, formula="m x 2L x b*s*h*4")
    else:
        _add(terms, phase="fwd", op="all_reduce", kind="activation", count=m * 2 * n,
             payload_bytes=m * 2 * n * act, formula="m x 2L x b*s*h*4")
        _add(terms, phase="bwd", op="all_reduce", kind="activation", count=m * (2 * n - skip),
             payload_bytes=m * (2 * n - skip) * act, formula="m x 2L x b*s*h*4")
    if layout.recompute:
        # torch's non-reentrant checkpoint recomputes a layer's forward only up to its last saved
        # tensor: both regions' entries again, and the reductions that come before that tensor
        # (the attention output's when it is the MLP's down projection input; the MLP output's
        # too when a dropout after it saves a mask)
        if layout.sequence_parallel:
            _add(terms, phase="recompute", op="all_gather", kind="activation", count=m * 2 * n,
                 payload_bytes=m * 2 * n * act // tp, formula="m x 2L x b*(s/tp)*h*4 (recomputed forward)")
            _add(terms, phase="recompute", op="reduce_scatter", kind="activation", count=m * recomputed,
                 payload_bytes=m * recomputed * act, formula="m x reductions before each layer's last save x b*s*h*4")
        else:
            _add(terms, phase="recompute", op="all_reduce", kind="activation", count=m * recomputed,
                 payload_bytes=m * recomputed * act, formula="m x reductions before each layer's last save x b*s*h*4")
    if first:
        _add(terms, phase="embedding", op="all_reduce", kind="activation", count=m, payload_bytes=m * act,
             formula="m x b*s*h*4 (vocab-parallel lookup)")
    if last:
        _add(terms, phase="lm_head", op="all_reduce", kind="activation", count=m, payload_bytes=m * act,
             formula="m x b*s*h*4 (backward into the LM head's region)")
        _add(terms, phase="loss", op="all_reduce", kind="activation", count=2 * m, payload_bytes=m * 3 * tokens_bytes,
             formula="m x (max + [sum exp, target]) x b*s*4 (label smoothing adds the sum of the logits)")
    return terms


def _tp_design_terms(shape: ModelShape, work: Workload, layout: Layout, layers: range, lora_sync: int,
                     replicated: int, partial_always: int) -> list[Term]:
    """Weight-gradient syncs over TP: replicated K/V copies (each microbatch's backward), and
    one bucketed all-reduce per step of partial gradients (SP: the replicated parameters; per-head
    norms at any tp; LoRA's replicated factors)."""
    m, n, terms = layout.num_microbatches, len(layers), []
    kv = shape.num_kv_heads * shape.head_dim
    if shape.num_heads != shape.num_kv_heads and kv_size_multiplier(shape.num_kv_heads, layout.tp) > 1:
        if not work.lora:
            _add(terms, phase="kv_grad_sync", op="all_reduce", kind="design", count=m * 2 * n,
                 payload_bytes=m * n * 2 * kv * shape.hidden * FP32_BYTES, formula="m x L x 2 x kv*h*4")
        elif {"k_proj", "v_proj"} & set(work.lora_targets):
            k = len({"k_proj", "v_proj"} & set(work.lora_targets))
            _add(terms, phase="kv_grad_sync", op="all_reduce", kind="design", count=m * k * n,
                 payload_bytes=m * n * k * kv * work.lora_r * FP32_BYTES, formula="m x L x kv*r*4 per K/V adapter")
    partial = 0
    if not work.lora:  # per-head norms are among the replicated parameters
        partial += (replicated if layout.sequence_parallel else partial_always) * FP32_BYTES
    partial += lora_sync
    if partial:
        _add(terms, phase="partial_grad_sync", op="all_reduce", kind="design", count=bucket_count(partial, BUCKET_BYTES),
             payload_bytes=partial, formula="(SP: the layers' replicated params (norms, row biases); per-head norms; LoRA factors) x 4, bucketed")
    return terms


def _lora_tp_sync_bytes(shape: ModelShape, work: Workload, n_layers: int) -> int:
    """LoRA factors replicated over TP whose gradients are partial: a column layer's A [r, in],
    a row layer's B [out, r]."""
    if not work.lora:
        return 0
    # A of q/k/v/gate/up is [r, h]; B of o_proj/down is [h, r]
    projections = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    return sum(shape.hidden * work.lora_r for t in work.lora_targets if t in projections) * n_layers * FP32_BYTES


def fsdp_terms(params: RankParams, work: Workload, layout: Layout, layers: range) -> list[Term]:
    """FSDP2's collectives (``data_parallel_sharding``, pp = 1), issued by torch itself (not
    ``backend.count_comm``'s): each decoder layer's parameters all-gathered before its forward
    and, under "zero3", again before its backward; the root group's (embeddings, final norm, LM
    head) once, kept to backward; every trainable gradient reduce-scattered once per step.
    Payload: this rank's shard (1/dp of the TP-local bytes) per all-gather, the TP-local
    gradients per reduce-scatter."""
    every = params.stage(layers, first=True, last=True) * work.param_bytes
    root = (params.by_place.get(PRE, 0) + params.by_place.get(POST, 0)) * work.param_bytes
    gathers = 2 if layout.data_parallel_sharding == "zero3" else 1
    trainable = params.stage(layers, first=True, last=True, lora=work.lora) * (4 if work.lora else work.param_bytes)
    groups = len(layers) + 1
    return [Term(phase="fsdp", op="all_gather", kind="gradient", count=gathers * len(layers) + 1,
                 payload_bytes=(gathers * (every - root) + root) // layout.dp,
                 formula="params / dp, per layer x (2: zero3, 1: zero2), root once", axis="dp"),
            Term(phase="fsdp", op="reduce_scatter", kind="gradient", count=groups, payload_bytes=trainable,
                 formula="trainable grads, one per FSDP group", axis="dp")]


def context_parallel_terms(shape: ModelShape, work: Workload, layout: Layout, num_layers: int) -> list[Term]:
    """Attention's traffic over the CP group per step (``bench``/tests measure it: 1.00x), with K/V
    (``kv``) and Q (``q``) bytes of the rank's b x s/cp tokens and its TP rank's heads: ring,
    forward (cp-1) K/V hops, backward (cp-1) K/V and cp dK/dV hops; all-to-all, forward Q, K/V and
    the output once each, backward their gradients (K/V heads cp does not divide travel repeated to
    the query heads). A recomputed layer runs its forward's again."""
    if layout.cp == 1:
        return []
    tp, cp, m = layout.tp, layout.cp, layout.num_microbatches
    mha = shape.num_heads == shape.num_kv_heads
    q_heads = (padded_size(shape.num_heads, tp) if mha else shape.num_heads) // tp
    kv_heads = q_heads if mha else shape.num_kv_heads * kv_size_multiplier(shape.num_kv_heads, tp) // tp
    tokens = work.micro_batch_size * work.seq_len  # work: the rank's tokens (step_terms)
    q = tokens * q_heads * shape.head_dim * work.param_bytes
    kv = 2 * tokens * kv_heads * shape.head_dim * work.param_bytes
    passes = m * num_layers * (2 if layout.recompute else 1)  # forwards
    terms = []
    if layout.context_parallel_attention == "ring":
        _add(terms, phase="cp_fwd", op="send", kind="activation", count=passes * (cp - 1),
             payload_bytes=passes * (cp - 1) * kv, formula="m x L x (cp-1) x kv (K/V hops; again if recomputed)",
             axis="cp")
        _add(terms, phase="cp_bwd", op="send", kind="activation", count=m * num_layers * (2 * cp - 1),
             payload_bytes=m * num_layers * (2 * cp - 1) * kv, formula="m x L x ((cp-1) x kv + cp x dkv)", axis="cp")
    else:
        kv = kv if kv_heads % cp == 0 else 2 * q
        _add(terms, phase="cp_fwd", op="all_to_all", kind="activation", count=passes * 4,
             payload_bytes=passes * (2 * q + kv), formula="m x L x (2q + kv) (again if recomputed)", axis="cp")
        _add(terms, phase="cp_bwd", op="all_to_all", kind="activation", count=m * num_layers * 4,
             payload_bytes=m * num_layers * (2 * q + kv), formula="m x L x (2q + kv)", axis="cp")
    return terms


def step_terms(shape: ModelShape, params: RankParams, work: Workload, layout: Layout, pp_rank: int = 0, *,
               trace: ActivationTrace | None = None) -> list[Term]:
    """Every communication term of one optimizer step on pipeline rank ``pp_rank`` (``trace``: the
    model's traced activations, which tell what a recomputed layer reduces again; one reduction
    per layer without it)."""
    stages = stage_layers(shape.num_layers, layout.pp, layout.virtual_stages)
    layers = stages[pp_rank]
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    work = dataclasses.replace(work, seq_len=layout.local_seq_len(work.seq_len))  # this rank's tokens
    terms = context_parallel_terms(shape, work, layout, len(layers))
    if layout.tp > 1:
        recomputed = sum(trace.reductions.get(i, 1) if trace is not None else 1 for i in layers)
        terms += _tp_activation_terms(shape, work, layout, layers, 0 in layers, shape.num_layers - 1 in layers,
                                      first, last, recomputed)
        terms += _tp_design_terms(shape, work, layout, layers, _lora_tp_sync_bytes(shape, work, len(layers)),
                                  sum(params.replicated_by_layer.get(i, 0) for i in layers),
                                  sum(params.partial_by_layer.get(i, 0) for i in layers))
    trainable = params.stage(layers, first=first, last=last, lora=work.lora) * (4 if work.lora else work.param_bytes)
    if layout.dp > 1 and layout.zero_1:
        padded = padded_size(trainable // FP32_BYTES, layout.dp) * FP32_BYTES
        buckets = bucket_count(padded, BUCKET_BYTES)
        terms.append(Term(phase="zero1", op="reduce_scatter", kind="gradient", count=buckets, payload_bytes=padded,
                          formula="trainable grads, padded to dp", axis="dp"))
        terms.append(Term(phase="zero1", op="all_gather", kind="gradient", count=buckets,
                          payload_bytes=padded // layout.dp, formula="trainable params / dp", axis="dp"))
    elif layout.dp > 1 and layout.data_parallel_sharding:
        terms += fsdp_terms(params, work, layout, layers)
    elif layout.dp > 1:
        terms.append(Term(phase="dp_grad", op="all_reduce", kind="gradient", count=bucket_count(trainable, BUCKET_BYTES),
                          payload_bytes=trainable, formula="trainable grads, bucketed", axis="dp"))
    if layout.ep > 1 and shape.moe_layers:
        # expert parallelism (the contract of the EP work): each MoE layer sends every token's top-k
        # hidden states to the experts' owners and back, in forward and again in backward
        moe = round(len(layers) * shape.moe_layers / shape.num_layers)  # this stage's share of MoE layers
        routed = work.micro_batch_size * work.seq_len * shape.top_k * shape.hidden * work.param_bytes
        count = layout.num_microbatches * moe * 4
        _add(terms, phase="ep_dispatch", op="all_to_all", kind="activation", count=count,
             payload_bytes=count * routed, formula="m x MoE layers x 4 x b*s*top_k*h (dispatch, combine; fwd, bwd)",
             axis="ep")
    if layout.pp > 1 and params.tied_embedding and (first or last):
        # ``pipeline.ties``: the embedding the LM head shares is held by the first and last stages,
        # which sum its gradient once per step (a frozen one's zeros too)
        terms.append(Term(phase="tied_grad", op="all_reduce", kind="gradient", count=1,
                          payload_bytes=params.tied_embedding * work.param_bytes,
                          formula="(vocab/tp)*h x param bytes (tied embedding)", axis="pp"))
    if layout.pp > 1:
        act = work.micro_batch_size * work.seq_len * shape.hidden * FP32_BYTES
        sends = layout.num_microbatches * ((not last) + (not first))
        if layout.virtual_stages > 1:
            sends = layout.num_microbatches * 2 * layout.virtual_stages - layout.num_microbatches * (first + last)
        _add(terms, phase="p2p", op="send", kind="p2p", count=sends, payload_bytes=sends * act,
             formula="m x (fwd unless last + bwd unless first) x b*s*h*4", axis="pp")
    return terms
