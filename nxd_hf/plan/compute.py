"""Step time: FLOPs per rank over the device's rate, each communication term over its link,
and the pipeline bubble. The terms add: an upper bound where the data-parallel all-reduce or
ZeRO-1's reduce-scatter overlaps backward (measured no faster on 2 CPU cores, docs/benchmarks.md);
the ranking, not the absolute time, is what the bench checks on a CPU."""

from nxd_hf.plan.cluster import Cluster
from nxd_hf.plan.comm import Term, ring_send_bytes
from nxd_hf.plan.layout import Layout
from nxd_hf.plan.memory import Workload, stage_layers
from nxd_hf.plan.shapes import ModelShape


def layer_flops_per_token(shape: ModelShape, seq_len: int, layer: int, *, moe: bool) -> float:
    """Forward FLOPs of decoder layer ``layer`` per token (2 per multiply-add; causal attention's
    scores and weighted sum): its weight matrices as counted on the model (``layer_macs``), else
    from the dimensions of a Llama-style layer."""
    h, d = shape.hidden, shape.head_dim
    scores = 2 * seq_len * shape.num_heads * d
    if shape.layer_macs:
        return 2 * shape.layer_macs[layer] + scores
    attention = 2 * h * d * (2 * shape.num_heads + 2 * shape.num_kv_heads)
    mlp = 2 * 3 * h * (shape.top_k * shape.expert_intermediate if moe else shape.intermediate)
    router = 2 * h * shape.num_experts if moe else 0
    return attention + scores + mlp + router


def compute_seconds(shape: ModelShape, work: Workload, layout: Layout, cluster: Cluster) -> float:
    """Seconds of arithmetic on the busiest pipeline rank for one optimizer step (no bubble)."""
    # each CP rank computes its cp-th of the tokens; their queries still see the whole sequence
    tokens = work.micro_batch_size * layout.local_seq_len(work.seq_len) * layout.num_microbatches
    backward = 1.0 if work.lora else 2.0  # frozen weights: no weight gradients
    factor = 1 + backward + (1 if layout.recompute else 0)
    moe = shape.moe_layers == shape.num_layers and shape.num_experts > 0
    worst = 0.0
    for rank, layers in enumerate(stage_layers(shape.num_layers, layout.pp, layout.virtual_stages)):
        flops = sum(layer_flops_per_token(shape, work.seq_len, i, moe=moe) for i in layers) * factor
        if rank == layout.pp - 1:
            flops += 2 * shape.hidden * shape.vocab * 3
        worst = max(worst, flops * tokens / layout.tp)
    return worst / cluster.flops


def _link(axis: str, layout: Layout, cluster: Cluster) -> tuple[float, float]:
    """(bandwidth, latency) of a group: inside a node when its ranks span no more than one
    (tp innermost, then dp, then pp; an ep group is a block of consecutive dp indices)."""
    size, stride = {"tp": (layout.tp, 1), "dp": (layout.dp, layout.tp), "ep": (layout.ep, layout.tp),
                    "cp": (layout.cp, layout.tp), "pp": (layout.pp, layout.tp * layout.dp)}[axis]
    if size * stride <= cluster.ranks_per_node:
        return cluster.intra_bandwidth, cluster.intra_latency
    return cluster.inter_bandwidth, cluster.inter_latency


def step_time(shape: ModelShape, work: Workload, layout: Layout, cluster: Cluster, terms: list[Term]) -> dict:
    """Itemized seconds of one optimizer step."""
    compute = compute_seconds(shape, work, layout, cluster)
    items = {"compute": compute}
    for term in terms:
        size = {"tp": layout.tp, "dp": layout.dp, "pp": layout.pp, "ep": layout.ep, "cp": layout.cp}[term.axis]
        bandwidth, latency = _link(term.axis, layout, cluster)
        seconds = term.count * latency + ring_send_bytes(term.op, size, term.payload_bytes) / bandwidth
        key = f"{term.axis}:{term.phase}:{term.op}"
        items[key] = items.get(key, 0.0) + seconds
    microbatch_slots = layout.num_microbatches * layout.virtual_stages
    items["bubble"] = compute * (layout.pp - 1) / microbatch_slots if layout.pp > 1 else 0.0
    items["step"] = sum(items.values())
    return items
