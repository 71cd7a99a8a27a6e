"""PAS policies: what layout a module gets on the ``plan_ngpus`` ranks of a unit.

A policy is a builtin name or a callable ``policy(graph, compute_config) -> Plan``. The callable
receives the module's ``nxd_hf.fx_tp.derive.TracedGraph`` (torch.fx graphs of its forward in
training and eval mode, each node annotated with its shape and, in ``graph.derived``, nxd_hf's
exact tensor-parallel layout for ``plan_ngpus`` ranks) and returns a ``Plan``: the tensor- and
pipeline-parallel sizes and a layout per module ("column", "row", "vocab"; unnamed modules are
replicated). nxd_hf checks the plan is exact (every column's output reaches row layers only
through ops that keep the split) and raises a ValueError naming the module otherwise.
"""

import dataclasses
from collections.abc import Callable

from nxd_hf.fx_tp import derive
from nxd_hf.nnscaler.config import ComputeConfig

BUILTIN = ("dp", "data", "tp", "pp", "hybrid", "autodist")


@dataclasses.dataclass(kw_only=True)
class Plan:
    """One unit's layout (what a policy returns; saved as JSON in ``gen_savedir``)."""

    tp_size: int = 1
    """Tensor-parallel ranks of a unit."""
    pp_size: int = 1
    """Pipeline stages of a unit (end2end modules only)."""
    layouts: dict[str, str] = dataclasses.field(default_factory=dict)
    """Module name -> "column" | "row" | "vocab"; other modules are replicated."""

    def as_dict(self) -> dict:
        return {"tp_size": self.tp_size, "pp_size": self.pp_size, "layouts": dict(sorted(self.layouts.items()))}


def resolve(pas_policy: str | Callable, config: ComputeConfig, graph: derive.TracedGraph | None, *,
            module=None, dummy_forward_args: dict | None = None) -> Plan:
    """The plan of ``pas_policy`` (``graph`` None for a Hugging Face model: its registered plan)."""
    n = config.plan_ngpus
    if isinstance(pas_policy, str):
        if pas_policy not in BUILTIN:
            raise ValueError(f"pas_policy {pas_policy!r} is not a builtin policy {BUILTIN} nor a callable")
        if pas_policy == "autodist":
            return _autodist(module, dummy_forward_args or {}, config, graph)
        if pas_policy in ("dp", "data"):
            if n != 1:
                raise ValueError(f"pas_policy={pas_policy!r} replicates the module: it needs plan_ngpus=1 (got {n}); "
                                 "data parallelism comes from runtime_ngpus (runtime_ngpus / plan_ngpus replicas)")
            return Plan()
        if pas_policy in ("pp", "hybrid") and not config.use_end2end:
            raise ValueError(f"pas_policy={pas_policy!r} uses pipeline parallelism, which needs an end2end module: "
                             "set ComputeConfig(use_end2end=True) (first argument the sample, first output the loss)")
        if pas_policy == "tp":
            return _checked(Plan(tp_size=n, layouts=_derived(graph, n)), config, graph)
        if pas_policy == "pp":
            return _checked(Plan(pp_size=n), config, graph)
        pp = config.pas_config.get("pipeline_nstages", max(n // 2, 1))
        if n % pp:
            raise ValueError(f"pas_policy='hybrid' splits plan_ngpus={n} into pipeline_nstages={pp} stages x tp: "
                             "give a plan_ngpus that pipeline_nstages divides")
        return _checked(Plan(tp_size=n // pp, pp_size=pp, layouts=_derived(graph, n // pp)), config, graph)
    if not callable(pas_policy):
        raise ValueError(f"pas_policy must be a builtin name {BUILTIN} or a callable, got {type(pas_policy).__name__}")
    if graph is not None:
        derive.derive_layouts(graph, n)
    plan = pas_policy(graph, config)
    if not isinstance(plan, Plan):
        raise ValueError(f"a pas_policy function must return an nxd_hf.nnscaler.Plan, got {type(plan).__name__}")
    _check_names(plan, graph)
    if graph is not None and plan.tp_size > 1:
        _check_exact(plan, graph)
    return _checked(plan, config, graph)


def _derived(graph, tp: int) -> dict[str, str]:
    return derive.derive_layouts(graph, tp) if graph is not None else {}


def _checked(plan: Plan, config: ComputeConfig, graph) -> Plan:
    if plan.tp_size * plan.pp_size != config.plan_ngpus:
        raise ValueError(f"the policy's plan has tp={plan.tp_size} x pp={plan.pp_size} = {plan.tp_size * plan.pp_size} "
                         f"ranks but ComputeConfig.plan_ngpus={config.plan_ngpus}: make them equal")
    if plan.pp_size > 1 and not config.use_end2end:
        raise ValueError("pipeline parallelism (pp_size > 1) needs an end2end module: set ComputeConfig(use_end2end=True)")
    _check_names(plan, graph)
    return plan


def _check_names(plan: Plan, graph) -> None:
    bad = {name: lay for name, lay in plan.layouts.items() if lay not in derive.LAYOUTS}
    if bad:
        raise ValueError(f"unknown layouts {bad}: a layout is one of {derive.LAYOUTS}")
    if graph is not None:
        missing = sorted(set(plan.layouts) - set(graph.modules))
        if missing:
            raise ValueError(f"the plan names modules the traced forward does not call: {missing}")


def _check_exact(plan: Plan, graph: derive.TracedGraph) -> None:
    """A user's layout is applied only if nxd_hf derives the same rows from its columns."""
    columns = {name for name, lay in plan.layouts.items() if lay == "column"}
    derived = derive.derive_layouts(graph, plan.tp_size, columns=columns)
    for name, lay in plan.layouts.items():
        if lay == "vocab" and derived.get(name) != "vocab":
            raise ValueError(f"{name!r} cannot be split by vocabulary: only an nn.Embedding whose weight is not shared")
    want = {k: v for k, v in plan.layouts.items() if v in ("column", "row")}
    have = {k: v for k, v in derived.items() if v in ("column", "row")}
    if want != have:
        wrong = sorted(set(want.items()) ^ set(have.items()))
        raise ValueError(f"the policy's tensor-parallel layout is not exact: {wrong} differ from what its columns "
                         f"imply ({have}); a column's output must reach only row layers, through ops that keep the "
                         "split (elementwise, reshape, attention by heads)")
    graph.derived = dict(plan.layouts)


def _autodist(module, dummy_forward_args: dict, config: ComputeConfig, graph) -> Plan:
    """nxd_hf's plan search (``nxd_hf.plan``) picks the unit's tp x pp for a Hugging Face model: the
    best predicted layout with ``plan_ngpus`` ranks per unit (pipeline stages only for end2end
    modules, ZeRO-1 as ``use_zero``), from the config and the dummy batch's shape."""
    if graph is not None:
        raise ValueError("pas_policy='autodist' uses nxd_hf.plan's cost model, which reads a Hugging Face model's config; "
                         "for a plain module use 'tp', 'pp', 'hybrid', 'dp' or a policy function")
    from nxd_hf.plan.api import plan as search
    from nxd_hf.plan.auto import device_memory_bytes

    ids = next((v for v in dummy_forward_args.values() if hasattr(v, "shape") and v.dim() == 2), None)
    if ids is None:
        raise ValueError("pas_policy='autodist' reads the batch and sequence size from a [batch, seq] tensor in "
                         "dummy_forward_args (e.g. input_ids)")
    result = search(module, world_size=config.runtime_ngpus, device_memory=device_memory_bytes(),
                    seq_len=ids.shape[1], micro_batch_size=ids.shape[0])
    for prediction in result.ranked:
        layout = prediction.layout
        if (layout.tp * layout.pp == config.plan_ngpus and layout.ep == 1 and not layout.sequence_parallel
                and not layout.recompute and (layout.pp == 1 or config.use_end2end)
                and (layout.zero_1 == config.use_zero or layout.dp == 1)):
            return Plan(tp_size=layout.tp, pp_size=layout.pp)
    raise ValueError(f"pas_policy='autodist': no layout of plan_ngpus={config.plan_ngpus} fits (nxd_hf.plan rejected "
                     f"{len(result.rejected)}; e.g. {result.rejected[0].reason if result.rejected else 'none fits'}). "
                     "Use another plan_ngpus, or `nxd-hf plan` to see every layout")
