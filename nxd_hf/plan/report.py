"""The plan as a table (``nxd-hf plan``), and as plain data (JSON)."""

import dataclasses

from nxd_hf.plan.search import PlanResult

GiB = 2**30
_MEMORY = ("parameters", "gradients", "optimizer_state", "activations", "loss", "communication_buffers", "lora")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _gib(x: float, unit: int = GiB) -> str:
    return f"{x / unit:.2f}"


def format_plan(result: PlanResult, *, top: int = 10, rejected: int = 10) -> str:
    """The ``top`` ranked layouts with their memory and time items, then ``rejected`` reasons."""
    s, c, w = result.shape, result.cluster, result.workload
    lines = [f"{s.model_type}: {_count(s.total_params)} parameters, {s.num_layers} layers, hidden {s.hidden}, "
             f"heads {s.num_heads}/{s.num_kv_heads}, vocab {s.vocab}"
             + (f", {s.num_experts} experts top-{s.top_k}" if s.num_experts else ""),
             f"cluster: {c.world_size} ranks ({c.nodes} node(s), {c.name}), {c.device_memory / GiB:.1f} GiB each; "
             f"seq {w.seq_len}, micro batch {w.micro_batch_size}, global batch {w.global_batch_size}"
             + (f", LoRA r={w.lora_r} on {','.join(w.lora_targets)}" if w.lora else ""), ""]
    unit, unit_name = (GiB, "GiB") if c.device_memory >= 4 * GiB else (2**20, "MiB")
    head = (f"{'#':>2} {'layout':<38} {'peak ' + unit_name:>8} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} "
            f"{'loss':>6} {'buffers':>7} {'lora':>6} {'step s':>9} {'compute':>9} {'comm':>9} {'bubble':>8}")
    lines += [head, "-" * len(head)]
    for i, p in enumerate(result.ranked[:top], 1):
        m, t = p.memory, p.time
        comm = sum(v for k, v in t.items() if ":" in k)
        lines.append(f"{i:>2} {p.layout.name():<38} {_gib(m['peak'], unit):>8} "
                     + " ".join(f"{_gib(m[k], unit):>{7 if k not in ('loss', 'lora') else 6}}" for k in _MEMORY)
                     + f" {t['step']:>9.4f} {t['compute']:>9.4f} {comm:>9.4f} {t['bubble']:>8.4f}")
    if not result.ranked:
        lines.append("   (no layout fits)")
    lines += ["", f"{len(result.ranked)} layouts fit; {len(result.rejected)} rejected"
              + (" (count, reason, an example):" if result.rejected else "")]
    groups: dict[str, list] = {}
    for r in result.rejected:  # "does not fit: needs ..." differ by their numbers: one group
        groups.setdefault(r.reason.split(":")[0] if r.reason.startswith("does not fit") else r.reason, []).append(r)
    for _, members in sorted(groups.items(), key=lambda kv: -len(kv[1]))[:rejected]:
        lines.append(f"   {len(members):>3} x {members[0].reason}   (e.g. {members[0].layout.name()})")
    return "\n".join(lines)


def as_dict(result: PlanResult) -> dict:
    return dict(
        shape=dataclasses.asdict(result.shape), cluster=dataclasses.asdict(result.cluster),
        workload=dataclasses.asdict(result.workload),
        ranked=[dict(layout=p.layout.as_dict(), memory=p.memory, time=p.time,
                     comm=[dataclasses.asdict(t) for t in p.comm]) for p in result.ranked],
        rejected=[dict(layout=r.layout.as_dict(), reason=r.reason) for r in result.rejected])
