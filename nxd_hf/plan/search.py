"""The search: every (tp, pp, dp, ep, cp, sequence parallelism, ZeRO-1 or ZeRO-2/3, schedule, recomputation)
for the world size, each checked against nxd_hf's rules and priced by the cost model; the ones
that fit are ranked by predicted step time (then memory), the others kept with the reason."""

import dataclasses

import torch

from nxd_hf.parallel_sizes import ParallelSizes
from nxd_hf.plan.activations import ActivationTrace, trace_activations
from nxd_hf.plan.cluster import Cluster
from nxd_hf.plan.compute import step_time
from nxd_hf.plan.layout import Layout, Prediction, Rejected
from nxd_hf.plan.memory import Workload, peak_memory
from nxd_hf.plan.shapes import ModelShape, experts_supported, rank_params
from nxd_hf.plan.step_comm import step_terms

GiB = 2**30


@dataclasses.dataclass(kw_only=True)
class PlanResult:
    """Ranked layouts that fit (best first) and the rejected ones with their reasons."""

    ranked: list[Prediction]
    rejected: list[Rejected]
    shape: ModelShape
    cluster: Cluster
    workload: Workload
    activations: str = "traced"
    """How activations were priced: "traced" (one meta-device forward of the model) or, when that
    forward fails, the config formula and why."""

    @property
    def best(self) -> Prediction:
        if not self.ranked:
            reasons = sorted({r.reason.split(":")[0] for r in self.rejected})
            raise ValueError(f"no layout of {self.shape.model_type} fits {self.cluster.world_size} ranks of "
                             f"{self.cluster.device_memory / GiB:.1f} GiB ({'; '.join(reasons)}): use more ranks or "
                             "memory, a shorter sequence, a smaller micro batch, or LoRA")
        return self.ranked[0]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(shape: ModelShape, world_size: int, work: Workload, *, schedules=("1f1b", "gpipe", "interleaved_1f1b"),
               fixed: dict | None = None):
    """Every layout of ``world_size`` ranks (``fixed``: field values to keep, e.g. {"tp": 2})."""
    fixed = fixed or {}
    for tp in _divisors(world_size):
        for pp in _divisors(world_size // tp):
            dp = world_size // (tp * pp)
            eps = [e for e in _divisors(dp) if shape.num_experts and shape.num_experts % e == 0] or [1]
            for ep, cp, attention in _context_choices(eps, dp, pp):
                # the CP ranks of a replica share its rows: dp / cp replicas take different ones
                microbatches = max(1, work.global_batch_size // (dp // cp * work.micro_batch_size))
                for sp in ([False, True] if tp > 1 else [False]):
                    for zero_1, sharding in _dp_options(dp, pp, ep, cp, fixed.get("data_parallel_sharding")):
                        for recompute in (False, True):
                            for schedule, virtual in ([(s, 2 if s.startswith("interleaved") else 1) for s in schedules]
                                                      if pp > 1 else [(None, 1)]):
                                sizes = ParallelSizes(tp=tp, pp=pp, dp=dp, ep=ep, cp=cp)
                                layout = Layout(sizes=sizes, sequence_parallel=sp, zero_1=zero_1,
                                                data_parallel_sharding=sharding,
                                                num_microbatches=microbatches, schedule=schedule,
                                                virtual_stages=virtual, recompute=recompute,
                                                context_parallel_attention=attention)
                                if all(getattr(layout, k) == v for k, v in fixed.items()):
                                    yield layout


def _dp_options(dp: int, pp: int, ep: int, cp: int, asked: str | None) -> list[tuple[bool, str | None]]:
    """(ZeRO-1, data_parallel_sharding) pairs of a dp: ZeRO-1 and FSDP2's ZeRO-3/ZeRO-2 are
    alternatives. FSDP2 also runs with pp, ep and cp > 1, but the plan offers it at pp = ep = cp = 1
    only, the case its memory model of ZeRO-2/3 (``memory.fsdp_memory``) was written for.
    At dp = 1 sharding changes nothing: offered only when ``asked`` (the run is set to use it)."""
    fsdp = [(False, "zero3"), (False, "zero2")] if pp == 1 and ep == 1 and cp == 1 else []
    if dp == 1:
        return [(False, None)] + ([(False, asked)] if asked and fsdp else [])
    return [(False, None), (True, None)] + fsdp


def _context_choices(eps: list[int], dp: int, pp: int):
    """(ep, cp, attention): context parallelism (carved from dp) with ring or all-to-all attention.
    It also composes with pipeline and expert parallelism; the plan does not offer those combinations."""
    yield from ((ep, 1, None) for ep in eps)
    if pp == 1 and 1 in eps:
        for cp in _divisors(dp)[1:]:
            yield 1, cp, "ring"
            yield 1, cp, "all_to_all"


def why_not(shape: ModelShape, work: Workload, layout: Layout) -> str | None:
    """The rule a layout breaks, in words, or None."""
    if work.global_batch_size % (layout.replicas * work.micro_batch_size):
        replicas = f"dp={layout.dp}" + (f"/cp={layout.cp} replicas" if layout.cp > 1 else "")
        return f"global batch {work.global_batch_size} does not divide into {replicas} x micro batch {work.micro_batch_size}"
    if layout.context_parallel_attention == "all_to_all" and (shape.num_heads // layout.tp) % layout.cp:
        return (f"all-to-all attention splits the {shape.num_heads // layout.tp} heads per tensor-parallel rank over "
                f"cp={layout.cp}")
    if layout.pp * layout.virtual_stages > shape.num_layers:
        return f"{layout.pp * layout.virtual_stages} pipeline stages for {shape.num_layers} layers"
    if layout.schedule == "1f1b" and layout.num_microbatches < layout.pp:
        return f"1f1b needs microbatches ({layout.num_microbatches}) >= pp ({layout.pp})"
    if layout.schedule == "interleaved_1f1b" and layout.num_microbatches % layout.pp:
        return f"interleaved_1f1b needs microbatches ({layout.num_microbatches}) a multiple of pp ({layout.pp})"
    if layout.sequence_parallel and not shape.sequence_parallel:
        return f"{shape.model_type} does not support sequence parallelism"
    if layout.sequence_parallel and work.seq_len % layout.tp:
        return f"sequence length {work.seq_len} does not divide over tp={layout.tp} (sequence parallelism)"
    if shape.num_experts and layout.dp % layout.ep:
        return f"ep={layout.ep} does not divide dp={layout.dp} (experts are carved from data parallelism)"
    if shape.num_experts:
        return experts_supported(layout.tp, layout.pp, layout.ep, layout.zero_1, shape.num_experts)
    return None


def predict(shape: ModelShape, counts, work: Workload, layout: Layout, cluster: Cluster, *,
            trace: ActivationTrace | None = None) -> Prediction:
    """The cost model's numbers for one valid layout (``counts``: ``shapes.rank_params`` at its tp, ep;
    ``trace``: the model's traced activations, ``plan.activations``)."""
    memory = peak_memory(shape, counts, work, layout, trace=trace)
    terms = step_terms(shape, counts, work, layout, memory["pp_rank"], trace=trace)
    return Prediction(layout=layout, memory=memory, comm=terms, time=step_time(shape, work, layout, cluster, terms))


def search(config, model, shape: ModelShape, work: Workload, cluster: Cluster, *, lora_config=None,
           memory_margin: float = 0.1, fixed: dict | None = None) -> PlanResult:
    """Rank every layout of ``cluster`` for ``work``; a layout fits when its predicted peak stays
    under ``(1 - memory_margin) x device_memory`` (the margin covers the allocator's slack)."""
    ranked, rejected, params = [], [], {}
    budget = cluster.device_memory * (1 - memory_margin)
    trace, how = traced(config, work, lora_config, device="cpu" if cluster.name == "cpu" else "cuda")
    for layout in candidates(shape, cluster.world_size, work, fixed=fixed):
        reason = why_not(shape, work, layout)
        if reason is None and (layout.tp, layout.ep) not in params:
            try:
                params[layout.tp, layout.ep] = rank_params(config, model, tp=layout.tp, ep=layout.ep,
                                                           lora_config=lora_config)
            except ValueError as error:
                params[layout.tp, layout.ep] = str(error)
        if reason is None and isinstance(params[layout.tp, layout.ep], str):
            reason = f"nxd_hf cannot shard it: {params[layout.tp, layout.ep]}"
        if reason is not None:
            rejected.append(Rejected(layout=layout, reason=reason))
            continue
        prediction = predict(shape, params[layout.tp, layout.ep], work, layout, cluster, trace=trace)
        memory = prediction.memory
        if memory["peak"] > budget:
            rejected.append(Rejected(layout=layout, peak_memory=memory["peak"], reason=(
                f"does not fit: needs {memory['peak'] / GiB:.2f} GiB per rank of {budget / GiB:.2f} GiB usable")))
            continue
        ranked.append(prediction)
    ranked.sort(key=lambda p: (p.step_time, p.peak_memory))
    return PlanResult(ranked=ranked, rejected=rejected, shape=shape, cluster=cluster, workload=work, activations=how)


def traced(config, work: Workload, lora_config=None, device: str = "cuda") -> tuple[ActivationTrace | None, str]:
    """The model's activations for ``work`` traced on the meta device, or None and why not (a model
    whose forward cannot run on the meta device is priced by the config formula instead)."""
    dtype = torch.float32 if work.param_bytes == 4 else torch.bfloat16
    try:
        return trace_activations(config, micro_batch_size=work.micro_batch_size, seq_len=work.seq_len, dtype=dtype,
                                 lora_config=lora_config, device=device), "traced"
    except Exception as error:  # a third-party forward that cannot run on meta falls back to the formula
        return None, f"config formula (the meta-device forward failed: {type(error).__name__}: {error})"
