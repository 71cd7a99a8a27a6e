"""nnScaler's ``ComputeConfig``: the compute environment of a parallel module.

A *unit* is ``plan_ngpus`` ranks running one copy of the plan (tensor x pipeline parallel);
``runtime_ngpus / plan_ngpus`` units are the data-parallel replicas (nxd_hf's ``parallel_state``
data-parallel size). ``use_zero`` is ZeRO-1 (``nxd_hf.optim.NeuronZero1Optimizer``).
"""

import dataclasses
import warnings
from typing import Any

IGNORED = {  # field -> (its default, why nxd_hf ignores it)
    "constant_folding": (False, "nxd_hf runs the traced graph without folding constants"),
    "trace_strategy": ("cuda_run_cpu_offload", "nxd_hf traces with torch.fx on the dummy inputs where they are"),
    "zero_ngroups": (1, "ZeRO-1 shards over the whole data-parallel group"),
    "use_async_reducer": (False, "gradients are reduced at the end of backward (nxd_hf.parallel_layers.grad_reduction)"),
}


@dataclasses.dataclass(kw_only=True, frozen=True)
class ComputeConfig:
    """As nnScaler's ``ComputeConfig`` (positional ``plan_ngpus, runtime_ngpus`` allowed too)."""

    plan_ngpus: int
    """Ranks of one unit: tensor x pipeline parallel size of the plan."""
    runtime_ngpus: int
    """Ranks in all: the world size when the module is built; a multiple of ``plan_ngpus``."""
    constant_folding: bool = False
    """Ignored (warns when set)."""
    trace_strategy: str = "cuda_run_cpu_offload"
    """Ignored (warns when set)."""
    use_zero: bool | int = False
    """ZeRO-1 across units: the optimizer state is sharded over the data-parallel replicas and the
    optimizer does the data-parallel gradient reduction (``nxd_hf.optim.NeuronZero1Optimizer``)."""
    zero_ngroups: int = 1
    """Ignored (warns when set)."""
    zero_use_reduce_scatter: bool = False
    """ZeRO-1 reduce-scatters the gradients either way; False (nnScaler's all-reduce) then all-gathers
    the reduced slices, so every parameter's ``.grad`` is the synchronized gradient; True leaves
    ``.grad`` local (only the optimizer's slices are reduced)."""
    inference_only: bool = False
    """The module is only run with ``infer_step``/``forward`` under ``no_grad``: no gradient
    reduction is installed."""
    use_end2end: bool = False
    """The module's first argument is the sample and its first output the loss; needed for
    pipeline parallelism and ``train_step``/``infer_step``."""
    pas_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Policy options: ``pipeline_nmicros`` (micro-batches per ``train_step``, default the number
    of pipeline stages), ``pipeline_scheduler`` ("1f1b" or "gpipe"), ``pipeline_nstages``."""
    user_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Free-form; stored in the saved plan so a changed value is a changed plan."""
    use_async_reducer: bool = False
    """Ignored (warns when set)."""
    reducer_bucket_cap_mb: float | None = None
    """Bucket size of the data-parallel gradient all-reduce (None: nxd_hf's 25 MB)."""

    def __init__(self, plan_ngpus: int, runtime_ngpus: int, **fields):
        names = {f.name for f in dataclasses.fields(ComputeConfig)}
        unknown = set(fields) - names
        if unknown:
            raise ValueError(f"ComputeConfig got unknown fields {sorted(unknown)}; its fields are {sorted(names)}")
        for f in dataclasses.fields(ComputeConfig):
            if f.name in ("plan_ngpus", "runtime_ngpus"):
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            object.__setattr__(self, f.name, fields.get(f.name, default))
        object.__setattr__(self, "plan_ngpus", plan_ngpus)
        object.__setattr__(self, "runtime_ngpus", runtime_ngpus)
        self.__post_init__()

    def __post_init__(self):
        for name in ("plan_ngpus", "runtime_ngpus"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ComputeConfig.{name} must be a positive int, got {value!r}")
        if self.runtime_ngpus % self.plan_ngpus:
            raise ValueError(
                f"ComputeConfig: runtime_ngpus={self.runtime_ngpus} is not a multiple of plan_ngpus={self.plan_ngpus}: "
                "the runtime ranks are whole units of plan_ngpus ranks. Use a runtime_ngpus that plan_ngpus divides")
        if self.reducer_bucket_cap_mb is not None and self.reducer_bucket_cap_mb <= 0:
            raise ValueError(f"ComputeConfig.reducer_bucket_cap_mb must be positive, got {self.reducer_bucket_cap_mb}")
        scheduler = self.pas_config.get("pipeline_scheduler", "1f1b")
        if scheduler not in ("1f1b", "gpipe"):
            raise ValueError(f"pas_config['pipeline_scheduler'] must be '1f1b' or 'gpipe', got {scheduler!r}")
        nmicros = self.pas_config.get("pipeline_nmicros")
        if nmicros is not None and (not isinstance(nmicros, int) or nmicros < 1):
            raise ValueError(f"pas_config['pipeline_nmicros'] must be a positive int, got {nmicros!r}")
        for name, (default, why) in IGNORED.items():
            if getattr(self, name) != default:
                warnings.warn(f"ComputeConfig.{name}={getattr(self, name)!r} is ignored: {why}", stacklevel=3)

    @property
    def units(self) -> int:
        """Data-parallel replicas of the plan (nnScaler's scale units)."""
        return self.runtime_ngpus // self.plan_ngpus

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
