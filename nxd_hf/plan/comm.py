"""Communication of one training step, itemized: the collectives nxd_hf issues, with the payload
each rank hands to them (the whole tensor for all-reduce and reduce-scatter, the local shard for
all-gather, as ``nxd_hf.backend.count_comm`` counts), and the pipeline's point-to-point sends.

``block_terms`` is one transformer block's tensor-parallel traffic (Megatron's theory, term by
term; ``bench/comm_volume`` measures it); ``step_terms`` a whole model's step under a layout."""

import dataclasses
import math
from typing import Literal

FP32_BYTES = 4


@dataclasses.dataclass(kw_only=True)
class Term:
    phase: str  # "fwd", "bwd", "kv_grad_sync", "sp_grad_sync", "dp_grad", "zero1", "p2p", ...
    op: str  # backend op name, or "send" for pipeline point-to-point
    kind: Literal["activation", "design", "gradient", "p2p"]  # design = a weight-gradient sync the layout needs
    count: int  # number of collectives
    payload_bytes: int  # summed over them
    formula: str  # how payload_bytes follows from the config
    axis: str = "tp"  # the group: tp, dp, pp, ep


def kv_size_multiplier(num_kv_heads: int, tp_size: int) -> int:
    """The fewest copies of each K/V head that let ``tp_size`` ranks split them evenly."""
    return tp_size // math.gcd(num_kv_heads, tp_size)


def block_terms(*, batch: int, seq: int, hidden: int, num_kv_heads: int, head_dim: int, qkv_bias: bool, tp: int,
                sequence_parallel: bool, dtype_bytes: int = FP32_BYTES) -> list[Term]:
    """The collectives one forward + backward + grad sync of a pre-norm block needs, itemized."""
    if tp == 1:
        return []  # the backend skips collectives over a single rank
    act = batch * seq * hidden * dtype_bytes
    terms = []
    for phase in ("fwd", "bwd"):
        if sequence_parallel:
            terms.append(Term(phase=phase, op="all_gather", kind="activation", count=2,
                              payload_bytes=2 * act // tp, formula="2 x b*(s/tp)*h*4"))
            terms.append(Term(phase=phase, op="reduce_scatter", kind="activation", count=2,
                              payload_bytes=2 * act, formula="2 x b*s*h*4"))
        else:
            terms.append(Term(phase=phase, op="all_reduce", kind="activation", count=2,
                              payload_bytes=2 * act, formula="2 x b*s*h*4"))
    if kv_size_multiplier(num_kv_heads, tp) > 1:
        kv = num_kv_heads * head_dim
        count, size, formula = 2, 2 * kv * hidden, "2 x kv*h*4"
        if qkv_bias:
            count, size, formula = 4, size + 2 * kv, "(2 x kv*h + 2 x kv)*4"
        terms.append(Term(phase="kv_grad_sync", op="all_reduce", kind="design", count=count,
                          payload_bytes=size * dtype_bytes, formula=f"{formula}, kv=num_kv_heads*head_dim"))
    if sequence_parallel:
        terms.append(Term(phase="sp_grad_sync", op="all_reduce", kind="design", count=1,
                          payload_bytes=2 * hidden * dtype_bytes, formula="1 x (2 norm weights)*h*4, bucketed"))
    return terms


def ring_send_bytes(op: str, group_size: int, payload_bytes: float) -> float:
    """Bytes one rank sends for this collective under a ring algorithm."""
    p = group_size
    factor = {"all_reduce": 2 * (p - 1) / p, "reduce_scatter": (p - 1) / p, "all_gather": p - 1, "broadcast": 1,
              "send": 1, "all_to_all": (p - 1) / p}
    return factor[op] * payload_bytes


def bucket_count(total_bytes: float, bucket_bytes: float) -> int:
    return max(1, math.ceil(total_bytes / bucket_bytes)) if total_bytes else 0
