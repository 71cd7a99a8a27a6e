"""Communication volume of one transformer block's forward + backward under tensor parallelism,
counted in ``nxd_hf.backend`` and set beside the theory, term by term.

Payload = the size of the tensor each rank hands to a collective (the whole tensor for
all-reduce and reduce-scatter, the local shard for all-gather). With a = b*s*h*4 bytes (fp32):

- activations, Megatron TP: 2 all-reduces of a in forward (o_proj, down) and 2 in backward
  (the inputs of qkv and gate_up);
- with sequence parallelism each all-reduce becomes an all-gather (payload a/tp) plus a
  reduce-scatter (payload a): 2 of each in forward and 2 of each in backward;
- design extras: when K/V heads are replicated (kv_size_multiplier > 1) the gradients of the
  copies are summed, one all-reduce each for the K and V weights ([kv, h]) and biases ([kv]);
  under SP the norm weights' partial gradients are summed, one bucketed all-reduce.

The ``ring B/rank`` column converts payload to bytes a rank sends in a ring algorithm
(all-reduce 2(p-1)/p x N, reduce-scatter (p-1)/p x N, all-gather (p-1) x shard): on that scale
SP's all-gather + reduce-scatter costs exactly the all-reduce it replaces.

``bench/comm_volume/run.py`` prints these as tables; ``tests/distributed/test_comm_volume.py`` checks them.
"""

import dataclasses

import torch

from nxd_hf import backend, parallel_state
from nxd_hf.parallel_layers.grads import allreduce_sequence_parallel_gradients
from nxd_hf.plan.comm import Term, block_terms, ring_send_bytes
from nxd_hf.testing import run_distributed
from bench.comm_volume.tp_block import (
    BlockConfig, ReferenceBlock, TPBlock, kv_size_multiplier, load_from_reference_, local_part, unsharded_tensors,
)

CASES = [(2, False), (2, True), (4, False), (4, True)]  # (tp, sequence_parallel)


def theory(config: BlockConfig, tp: int, sequence_parallel: bool) -> list[Term]:
    """The collectives one forward + backward + grad sync of the block needs, itemized (the
    theory lives in ``nxd_hf.plan.comm``, where the plan search prices whole steps with it)."""
    return block_terms(batch=config.batch, seq=config.seq, hidden=config.hidden, num_kv_heads=config.num_kv_heads,
                       head_dim=config.head_dim, qkv_bias=config.qkv_bias, tp=tp, sequence_parallel=sequence_parallel)


class _TagDuring:
    """Autograd node hooks that label the collectives issued while one node runs backward."""

    def __init__(self, tag: str):
        self.tag, self.context = tag, None

    def enter(self, grad_outputs):
        self.context = backend.comm_tag(self.tag)
        self.context.__enter__()

    def exit(self, grad_inputs, grad_outputs):
        self.context.__exit__(None, None, None)


def tag_backward_of(output: torch.Tensor, node_name: str, tag: str) -> int:
    """Label with ``tag`` the collectives of every node called ``node_name`` in ``output``'s
    backward graph (backward runs outside any ``comm_tag`` of the forward); returns how many."""
    seen, stack, found = set(), [output.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name() == node_name:
            hooks = _TagDuring(tag)
            node.register_prehook(hooks.enter)
            node.register_hook(hooks.exit)
            found += 1
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _seq_chunk(t: torch.Tensor) -> torch.Tensor:
    tp_size, tp_rank = parallel_state.get_tensor_model_parallel_size(), parallel_state.get_tensor_model_parallel_rank()
    return t.chunk(tp_size, dim=1)[tp_rank]


def measure_case(config: BlockConfig, *, sequence_parallel: bool) -> dict:
    """On every rank of an initialized TP group: count one forward + backward + SP grad sync
    of the block, then check it against the unsharded reference. Returns the records."""
    torch.manual_seed(0)
    ref = ReferenceBlock(config)
    x = torch.randn(config.batch, config.seq, config.hidden)
    grad_out = torch.randn_like(x)
    block = TPBlock(config, sequence_parallel=sequence_parallel)
    load_from_reference_(block, ref)
    local = _seq_chunk if sequence_parallel else (lambda t: t)
    x_local = local(x).clone().requires_grad_()  # [b, s/tp, h] under SP
    with backend.count_comm() as records:
        with backend.comm_tag("fwd"):
            out = block(x_local)
        tag_backward_of(out, "SumReplicaGradsBackward", "kv_grad_sync")
        with backend.comm_tag("bwd"):
            out.backward(local(grad_out))
        with backend.comm_tag("sp_grad_sync"):
            allreduce_sequence_parallel_gradients(block.parameters())
    checked = _check_against_reference(block, ref, x, grad_out, out, x_local.grad, sequence_parallel)
    # the group's global ranks differ between data-parallel replicas; the payloads must not
    return {"records": [{k: v for k, v in dataclasses.asdict(r).items() if k != "ranks"} for r in records],
            "checked": checked}


def _check_against_reference(block, ref, x, grad_out, out, x_grad, sequence_parallel) -> list[str]:
    x_ref = x.clone().requires_grad_()
    out_ref = ref(x_ref)
    out_ref.backward(grad_out)
    if sequence_parallel:  # outside count_comm: not part of the block's traffic
        group = parallel_state.get_tensor_model_parallel_group()
        out, x_grad = backend.all_gather(out.detach(), 1, group), backend.all_gather(x_grad, 1, group)
    close = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, out_ref.detach(), **close, msg=lambda m: f"block output: {m}")
    torch.testing.assert_close(x_grad, x_ref.grad, **close, msg=lambda m: f"input grad: {m}")
    full_grads = unsharded_tensors(ref, lambda p: p.grad)
    for name, param in block.named_parameters():
        expected = local_part(param, full_grads[name])
        torch.testing.assert_close(param.grad, expected, **close, msg=lambda m, n=name: f"grad of {n}: {m}")
    return ["output", "input_grad", *(f"grad:{name}" for name, _ in block.named_parameters())]


def measure_cases(config: BlockConfig, cases: list[tuple[int, bool]]) -> list[dict]:
    """Rank body: each (tp, sequence_parallel) case on this world (dp = world / tp)."""
    results = []
    for tp, sequence_parallel in cases:
        parallel_state.initialize_model_parallel(tp)
        results.append(measure_case(config, sequence_parallel=sequence_parallel))
    return results


def compare(records: list[dict], terms: list[Term]) -> dict:
    """Counted vs theory per (phase, op) term; counted terms missing from theory are rows too."""
    rows = {(t.phase, t.op): dict(phase=t.phase, op=t.op, kind=t.kind, formula=t.formula, theory_count=t.count,
                                  theory_bytes=t.payload_bytes, count=0, bytes=0, ring_bytes_per_rank=0.0)
            for t in terms}
    for r in records:
        row = rows.setdefault((r["tag"], r["op"]), dict(
            phase=r["tag"], op=r["op"], kind="unexpected", formula="-", theory_count=0, theory_bytes=0,
            count=0, bytes=0, ring_bytes_per_rank=0.0))
        row["count"] += 1
        row["bytes"] += r["payload_bytes"]
        row["ring_bytes_per_rank"] += ring_send_bytes(r["op"], r["group_size"], r["payload_bytes"])
    for row in rows.values():
        row["ratio"] = row["bytes"] / row["theory_bytes"] if row["theory_bytes"] else None
    rows = list(rows.values())
    total = {key: sum(row[key] for row in rows)
             for key in ("count", "theory_count", "bytes", "theory_bytes", "ring_bytes_per_rank")}
    total["ratio"] = total["bytes"] / total["theory_bytes"] if total["theory_bytes"] else None
    extras = [dict(phase=row["phase"], op=row["op"], bytes=row["bytes"],
                   share_of_total=row["bytes"] / total["bytes"] if total["bytes"] else 0.0)
              for row in rows if row["kind"] != "activation"]
    return {"terms": rows, "total": total, "extra_terms": extras}


def run(config: BlockConfig, cases: list[tuple[int, bool]] = CASES) -> list[dict]:
    """Spawn one world of max(tp) gloo ranks, measure every case, compare with theory."""
    world_size = max(tp for tp, _ in cases)
    per_rank = run_distributed(measure_cases, world_size, config, cases)
    results = []
    for i, (tp, sequence_parallel) in enumerate(cases):
        records = per_rank[0][i]["records"]
        assert all(rank[i]["records"] == records for rank in per_rank), "ranks disagree on their collectives"
        results.append(dict(tp=tp, sequence_parallel=sequence_parallel,
                            kv_size_multiplier=kv_size_multiplier(config.num_kv_heads, tp),
                            checked_against_reference=per_rank[0][i]["checked"],
                            **compare(records, theory(config, tp, sequence_parallel))))
    return results
