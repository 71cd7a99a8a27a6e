"""bench.comm_volume.measure (bench/comm_volume/run.py): the bytes counted in the backend for one TP block forward + backward
equal the itemized theory, and the block it measures matches the unsharded reference."""

import pytest

from bench.comm_volume.measure import CASES, run, theory
from bench.comm_volume.tp_block import BlockConfig

# head_dim 8, 2 K/V heads: kv_size_multiplier 1 at tp=2, 2 at tp=4 (K/V replicated)
CONFIG = BlockConfig(batch=2, seq=8, hidden=64, num_heads=8, num_kv_heads=2, intermediate=128, qkv_bias=True)
ACT = 2 * 8 * 64 * 4  # b*s*h*4 = 4096 bytes
KV_SYNC = (2 * 16 * 64 + 2 * 16) * 4  # K and V weights [16, 64] and biases [16]
SP_NORMS = 2 * 64 * 4

# (tp, sp) -> {(phase, op): (collectives, payload bytes)}: the theory, written out by hand
EXPECTED = {
    (2, False): {("fwd", "all_reduce"): (2, 2 * ACT), ("bwd", "all_reduce"): (2, 2 * ACT)},
    (2, True): {
        ("fwd", "all_gather"): (2, ACT), ("fwd", "reduce_scatter"): (2, 2 * ACT),
        ("bwd", "all_gather"): (2, ACT), ("bwd", "reduce_scatter"): (2, 2 * ACT),
        ("sp_grad_sync", "all_reduce"): (1, SP_NORMS),
    },
    (4, False): {
        ("fwd", "all_reduce"): (2, 2 * ACT), ("bwd", "all_reduce"): (2, 2 * ACT),
        ("kv_grad_sync", "all_reduce"): (4, KV_SYNC),
    },
    (4, True): {
        ("fwd", "all_gather"): (2, ACT // 2), ("fwd", "reduce_scatter"): (2, 2 * ACT),
        ("bwd", "all_gather"): (2, ACT // 2), ("bwd", "reduce_scatter"): (2, 2 * ACT),
        ("kv_grad_sync", "all_reduce"): (4, KV_SYNC), ("sp_grad_sync", "all_reduce"): (1, SP_NORMS),
    },
}


@pytest.fixture(scope="module")
def results():
    """All four cases in one spawn of 4 ranks (tp=2 runs as tp=2 x dp=2)."""
    return {(case["tp"], case["sequence_parallel"]): case for case in run(CONFIG, CASES)}


@pytest.mark.parametrize("tp,sp", CASES)
def test_counted_bytes_equal_itemized_theory(results, tp, sp):
    case = results[(tp, sp)]
    counted = {(row["phase"], row["op"]): (row["count"], row["bytes"]) for row in case["terms"] if row["count"]}
    assert counted == EXPECTED[(tp, sp)]
    assert {(t.phase, t.op): (t.count, t.payload_bytes) for t in theory(CONFIG, tp, sp)} == EXPECTED[(tp, sp)]
    assert case["total"]["ratio"] == 1.0


def test_sp_collectives_cost_the_all_reduces_they_replace(results):
    for tp in (2, 4):
        ring = {sp: sum(r["ring_bytes_per_rank"] for r in results[(tp, sp)]["terms"] if r["kind"] == "activation")
                for sp in (False, True)}
        assert ring[True] == pytest.approx(ring[False])


@pytest.mark.parametrize("tp,sp", CASES)
def test_block_matches_unsharded_reference(results, tp, sp):
    # measure_case asserts (rtol=1e-4, atol=1e-5) on every rank and lists what it compared
    checked = results[(tp, sp)]["checked_against_reference"]
    assert {"output", "input_grad", "grad:qkv.weight_qkv", "grad:norm1.weight"} <= set(checked)
