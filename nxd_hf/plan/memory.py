"""Peak memory per rank, itemized, from the model's shape and the ranks' parameter counts.

Activations are the tensors autograd saves for backward, per token and decoder layer, read off
the config for a pre-norm decoder (RMSNorm, rotary attention through SDPA, gated or plain MLP,
fused top-k experts); a frozen linear layer (LoRA) saves no input for its weight gradient:

- each norm: its input x (h) and 1/rms (1), and x/rms (h) when the norm weight trains;
- attention: the input of Q/K/V (h, when they train or carry adapters), the rotated Q
  (heads x d), K and V (kv heads x d), SDPA's output (heads x d, also o_proj's input) and
  log-sum-exp (heads);
- a gated MLP: its input (h, when trained), gate (I), act(gate) (I), up (I), and the product
  (I, down's input, when trained);
- experts: router logits (E) and top-k, and per chosen expert the token (h), gate|up (2I),
  act (I), product (I), output (h) and weight (1);
- LoRA: the r-wide output of each adapter's A.
Sharded parts divide by tp (sequence parallelism divides the rest too); context parallelism
divides every token-proportional term by cp (each rank holds a cp-th of the sequence, padded to
2 x cp, in every layer, attention included; its logits are its own tokens'). The peak is at the
start of backward (all activations, the loss's logits, log-probabilities and their gradient,
no gradients yet) or at its end (all gradients), on top of the parameters, optimizer state and
the buffers kept between steps (the pipeline's receive buffers, ZeRO-1's staging buckets). Under
FSDP2's ZeRO-3/ZeRO-2 (``Layout.data_parallel_sharding``) parameters, gradients and optimizer
state are 1/dp, and the parameters it all-gathers during the step count as a buffer
(``fsdp_memory``)."""

import dataclasses

from nxd_hf.plan.activations import ActivationTrace
from nxd_hf.plan.layout import Layout
from nxd_hf.plan.shapes import POST, PRE, ModelShape, RankParams
from nxd_hf.parallel_layers.sharding import padded_size

BUCKET_BYTES = 25 * 2**20  # parallelize's bucket_size_mb


@dataclasses.dataclass(kw_only=True)
class Workload:
    """What one optimizer step computes."""

    micro_batch_size: int
    """Sequences per microbatch and data-parallel replica."""
    seq_len: int
    """Tokens per sequence."""
    global_batch_size: int
    """Sequences per optimizer step over all replicas."""
    param_bytes: int = 4
    """Bytes per parameter (4: fp32, 2: bf16)."""
    lora_r: int = 0
    """LoRA rank (0: full training)."""
    lora_targets: tuple[str, ...] = ()
    """Projections carrying adapters (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)."""

    @property
    def lora(self) -> bool:
        return self.lora_r > 0

    def trains(self, projection: str) -> bool:
        return not self.lora or projection in self.lora_targets


def layer_activation_elements(shape: ModelShape, work: Workload, layout: Layout, *, moe: bool) -> float:
    """Elements autograd saves per token of one decoder layer on one rank."""
    h, tp, sp = shape.hidden, layout.tp, layout.sequence_parallel
    full = not work.lora
    heads = padded_size(shape.num_heads, tp) if shape.num_heads == shape.num_kv_heads else shape.num_heads
    kv = shape.num_kv_heads * max(1, tp // _gcd(shape.num_kv_heads, tp)) if shape.num_heads != shape.num_kv_heads \
        else heads
    norms = 2 * (h + 1 + (h if full else 0)) / (tp if sp else 1)
    attention_in = h if any(work.trains(p) for p in ("q_proj", "k_proj", "v_proj")) else 0
    attention = (2 * heads * shape.head_dim + 2 * kv * shape.head_dim + heads) / tp
    lora = work.lora_r * len(work.lora_targets)
    if moe:
        i, k = shape.expert_intermediate / tp, shape.top_k
        mlp = (h if full else 0) + shape.num_experts + 3 * k + k * (h + 3 * i + (i if full else 0) + h + 1)
    else:
        i = shape.intermediate / tp
        mlp = (h if work.trains("gate_proj") or work.trains("up_proj") else 0) + 3 * i + (i if work.trains("down_proj") else 0)
    return norms + attention_in + attention + lora + mlp


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def zero1_staging_bytes(grad_bytes: int, dp: int, grad_element_bytes: int, bucket_bytes: int = BUCKET_BYTES) -> int:
    """ZeRO-1's staging buffers (``optim.zero1.optimizer``'s ``_staging``: dp x a bucket's columns, at most
    ``bucket_bytes``): one, and a second once two buckets' reduce-scatters overlap backward
    (``optim.zero1.overlap.IN_FLIGHT``). Both are kept across steps (the shared one by the
    optimizer, the other in the overlap's free list), so they are held from the second step's
    forward on, not only while gradients are reduced."""
    padded = padded_size(grad_bytes // grad_element_bytes, dp) * grad_element_bytes
    buckets = -(-padded // bucket_bytes)
    return min(2, buckets) * min(bucket_bytes, padded)


def stage_layers(num_layers: int, pp: int, virtual: int = 1) -> list[tuple[int, ...]]:
    """Layers of each pipeline rank (``nxd_hf.pipeline.partition.auto_cuts``: remainder on later
    stages); with virtual stages a rank's layers are not contiguous (rank 0: stages 0, pp, ...)."""
    stages = pp * virtual
    base, extra = divmod(num_layers, stages)
    sizes = [base + (1 if s >= stages - extra else 0) for s in range(stages)]
    starts = [sum(sizes[:s]) for s in range(stages)]
    per_rank = [[] for _ in range(pp)]
    for s in range(stages):
        per_rank[s % pp].extend(range(starts[s], starts[s] + sizes[s]))
    return [tuple(r) for r in per_rank]


def in_flight(layout: Layout, pp_rank: int) -> int:
    """Microbatches whose activations a pipeline rank holds at once."""
    if layout.pp == 1:
        return 1
    if layout.schedule == "gpipe":
        return layout.num_microbatches
    return min(layout.num_microbatches, layout.pp - pp_rank + (layout.pp if layout.virtual_stages > 1 else 0))


def rank_memory(shape: ModelShape, params: RankParams, work: Workload, layout: Layout, pp_rank: int, *,
                trace: ActivationTrace | None = None) -> dict:
    """Itemized peak bytes of one pipeline rank (TP rank 0). ``trace``: the activations traced from
    the model (``plan.activations``); without it they are counted from the config."""
    layers = stage_layers(shape.num_layers, layout.pp, layout.virtual_stages)[pp_rank]
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    n_params = params.stage(layers, first=first, last=last)
    n_lora = params.stage(layers, first=first, last=last, lora=True)
    trainable = n_lora if work.lora else n_params
    grad_bytes = trainable * (4 if work.lora else work.param_bytes)
    dp_shard = layout.dp if layout.zero_1 else 1
    if layout.zero_1 and not work.lora:  # ZeRO-1 shards the local experts over expert_data (dp / ep ranks)
        n_experts = sum(params.experts_by_layer.get(i, 0) for i in layers)
        trainable_sharded = trainable + n_experts * (layout.ep - 1)
    else:
        trainable_sharded = trainable
    state = 2 * 4 * trainable_sharded / dp_shard  # AdamW's two moments (fp32)
    if work.param_bytes < 4 and not work.lora and not layout.zero_1:
        state += 4 * trainable  # fp32 master weights of low-precision parameters
    buffers = 0.0
    fsdp = fsdp_memory(params, work, layout, layers) if layout.data_parallel_sharding else None
    if fsdp is not None:  # FSDP2: parameters, gradients and state 1/dp at rest; gathered ones during the step
        state /= layout.dp
        buffers = fsdp["gathered"]
    if layout.zero_1:
        state += 2 * 4 * trainable_sharded / dp_shard  # the fp32 master slice and its gradient
        buffers = zero1_staging_bytes(grad_bytes, layout.dp, 4 if work.lora else work.param_bytes)
    # plain data parallelism: the gradients live in the all-reduce's flat buckets
    # (``parallel_layers.grad_buckets``), so reducing them takes no buffer of its own
    tokens = work.micro_batch_size * layout.local_seq_len(work.seq_len)
    share = layout.local_seq_len(work.seq_len) / work.seq_len  # of the trace, made on the whole sequence
    act_bytes = work.param_bytes  # activations take the parameters' dtype
    # the pipeline's receive buffers, one per microbatch and kept between steps: the hidden states
    # a later stage receives, the gradients an earlier one receives
    boundary = tokens * shape.hidden * act_bytes / (layout.tp if layout.sequence_parallel else 1)
    pipeline_buffers = layout.num_microbatches * boundary * ((not first) + (not last)) if layout.pp > 1 else 0
    moe_layers = set(range(shape.num_layers)) if shape.moe_layers == shape.num_layers else set()
    if trace is not None:
        per_layer = [share * trace.place_bytes(i, tp=layout.tp, sequence_parallel=layout.sequence_parallel,
                                               fractions=params.fractions) for i in layers]
        # the embeddings' own (dropout masks, learned positions' sums), on the first stage
        pre = share * trace.place_bytes(PRE, tp=layout.tp, sequence_parallel=False,
                                        fractions=params.fractions) if first else 0
    else:
        per_layer = [layer_activation_elements(shape, work, layout, moe=i in moe_layers) * tokens * act_bytes
                     for i in layers]
        pre = 0
    one_layer = max(per_layer, default=0)
    # backward of the stage's last layer: its weight gradients and the gradients of its largest
    # activations (two alive at once) join everything still held
    if trace is not None:
        largest = share * max((trace.largest_bytes(i, tp=layout.tp, sequence_parallel=layout.sequence_parallel,
                                                   fractions=params.fractions) for i in layers), default=0)
    else:
        largest = tokens * act_bytes * max(shape.intermediate / layout.tp, shape.hidden)
    table = params.lora_by_place if work.lora else params.by_place
    layer_grads = max((table.get(i, 0) for i in layers), default=0) * (4 if work.lora else work.param_bytes)
    if layout.recompute:  # each layer keeps its input; backward recomputes one layer at a time
        per_microbatch = len(layers) * tokens * shape.hidden / (layout.tp if layout.sequence_parallel else 1) * act_bytes
    else:
        per_microbatch = sum(per_layer)
    per_microbatch += pre
    loss_saved = loss_forward = loss_backward = head_grad = tied_grad = 0.0
    if last:
        vocab = padded_size(shape.vocab, layout.tp) / layout.tp
        logits = tokens * 4 * vocab  # fp32
        loss_saved = logits + tokens * act_bytes * (3 * shape.hidden + 1)  # log-probs or softmax; final norm
        if layout.pp > 1:  # the schedule keeps the stage's output (the logits) until that microbatch's backward
            loss_saved += tokens * act_bytes * vocab
        # end of forward: HF's loss holds the logits and log-probs; the vocab-parallel one (tp > 1) the
        # logits and one fp32 copy it shifts, exponentiates and keeps as the softmax, all in place
        loss_forward = logits * 2
        loss_backward = logits * (2 if layout.tp == 1 else 1)  # the gradients of log-probs and logits
        head_grad = 0 if work.lora else vocab * shape.hidden * work.param_bytes
        if params.tied_embedding and layout.pp == 1 and not work.lora:  # the lookup's gradient, then summed in
            tied_grad = params.tied_embedding * work.param_bytes
    flight, m = in_flight(layout, pp_rank), layout.num_microbatches
    after_first = (flight if m > flight else flight - 1) if m > 1 else 0  # held with the gradients
    activations = per_microbatch * flight + (one_layer if layout.recompute else 0)
    held = per_microbatch * flight + loss_saved * (flight - 1 if last else 0)
    end_of_forward = held + loss_forward
    start_of_backward = held + loss_saved + loss_backward + head_grad
    first_layer_backward = held + head_grad + layer_grads + 2 * largest + (one_layer if layout.recompute else 0)
    if fsdp is not None:
        first_layer_backward += fsdp["scatter_copy"]
    held_grads = grad_bytes if fsdp is None else grad_bytes / layout.dp + fsdp["root_grads"]
    end_of_backward = held_grads + one_layer + tied_grad + (per_microbatch + loss_saved * last) * after_first
    reduction = held_grads if fsdp is None else held_grads + fsdp["root_grads"]  # FSDP2 copies them in to reduce-scatter
    shard = layout.dp if fsdp is not None else 1
    items = dict(parameters=n_params * work.param_bytes / shard, lora=n_lora * 4 / shard,
                 gradients=grad_bytes / shard, optimizer_state=state,
                 activations=activations, loss=max(loss_forward, loss_saved + loss_backward),
                 communication_buffers=buffers + pipeline_buffers)
    items["peak"] = int(items["parameters"] + items["lora"] + state + pipeline_buffers + buffers
                        + max(end_of_forward, start_of_backward, first_layer_backward, end_of_backward, reduction))
    return {k: int(v) for k, v in items.items()}


def fsdp_memory(params: RankParams, work: Workload, layout: Layout, layers: range) -> dict:
    """What FSDP2 (``data_parallel_sharding``, pp = 1) holds beyond the 1/dp shards, in bytes:

    - ``gathered``, the all-gathered (TP-local) parameters during the step: under "zero3" the root
      group's (embeddings, final norm, LM head: FSDP2 keeps the root unsharded from forward to
      backward) and two decoder layers' (in backward the layer computing and the one before it,
      which FSDP2 prefetches); under "zero2" every parameter (each layer's gathered parameters
      are kept from its forward to its backward);
    - ``scatter_copy``: a layer's gradients once more, the flat input FSDP2 copies them into to
      reduce-scatter them (freed with them, layer by layer);
    - ``root_grads``: the root group's unsharded gradients, held until its reduce-scatter at the
      end of backward (the decoder layers' are reduce-scattered and freed layer by layer)."""
    table = params.lora_by_place if work.lora else params.by_place
    root = params.by_place.get(PRE, 0) + params.by_place.get(POST, 0)
    largest_layer = max((params.by_place.get(i, 0) for i in layers), default=0)
    every = params.stage(layers, first=True, last=True)
    gathered = every if layout.data_parallel_sharding == "zero2" else root + min(2, len(layers)) * largest_layer
    grad_element = 4 if work.lora else work.param_bytes
    return dict(gathered=gathered * work.param_bytes, root_grads=(table.get(PRE, 0) + table.get(POST, 0)) * grad_element,
                scatter_copy=max((table.get(i, 0) for i in layers), default=0) * grad_element)


def peak_memory(shape: ModelShape, params: RankParams, work: Workload, layout: Layout, *,
                trace: ActivationTrace | None = None) -> dict:
    """The itemized memory of the busiest pipeline rank."""
    ranks = [rank_memory(shape, params, work, layout, r, trace=trace) for r in range(layout.pp)]
    worst = max(range(layout.pp), key=lambda r: ranks[r]["peak"])
    return {**ranks[worst], "pp_rank": worst}
