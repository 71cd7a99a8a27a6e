"""``ParallelSizes``: the one value of a run's parallel layout (torchtitan's ``ParallelDims``).

Built and validated once, frozen: ``parallel_state`` holds the value its groups were made for,
``model.nxd`` the one its model was set up with, the plan search's ``Layout`` one per candidate,
and checkpoint headers write it. "auto" sizes are resolved into a new value
(``nxd_hf.plan.auto.resolve_auto_sizes``), never by changing one. An axis is one field: a size
that multiplies the world carries ``AXIS``; one carved from another (ep from dp) does not.
"""

import dataclasses
import math

AXIS = {"multiplies_world": True}
"""Field metadata of a size the world is the product of."""

ARGUMENT_NAMES = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size", "dp": "data_parallel_size",
                  "ep": "expert_parallel_size", "cp": "context_parallel_size"}
"""The user-facing argument of each size (``parallelize``, ``NxDTrainingArguments``, the config API)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelSizes:
    """Sizes of the rank layout [PP, DP, TP] (``parallel_state``'s module docstring)."""

    tp: int = dataclasses.field(default=1, metadata=AXIS)
    """Tensor-parallel size."""
    pp: int = dataclasses.field(default=1, metadata=AXIS)
    """Pipeline-parallel size (1: no pipeline)."""
    dp: int = dataclasses.field(default=1, metadata=AXIS)
    """Data-parallel size: the replicas, world / (tp x pp)."""
    ep: int = 1
    """Expert-parallel size: the ranks each mixture-of-experts layer's experts are split over,
    carved from the data-parallel ranks (it divides dp)."""
    cp: int = 1
    """Context-parallel size: the ranks each sequence is split over through attention, consecutive
    blocks of the data-parallel ranks (it divides dp; ``nxd_hf.context``)."""

    def __post_init__(self):
        self.check_sizes(**dataclasses.asdict(self))
        if self.dp % self.ep:
            raise ValueError(
                f"expert_parallel_size ({self.ep}) must divide the data-parallel size {self.dp} (world {self.world} / "
                f"(tp {self.tp} x pp {self.pp})): experts are split over data-parallel ranks. Use an "
                f"expert_parallel_size dividing {self.dp}, or launch {self.tp * self.pp * self.ep} x k processes")
        if self.dp % self.cp:
            raise ValueError(
                f"context_parallel_size ({self.cp}) must divide the data-parallel size {self.dp} (world {self.world} / "
                f"(tp {self.tp} x pp {self.pp})): launch {self.tp * self.pp * self.cp} x k processes, or use a "
                f"context_parallel_size dividing {self.dp}")

    @staticmethod
    def check_sizes(**sizes) -> None:
        """ValueError unless every size (``tp=2, ...``) is an int >= 1 (a "2" or 2.0 would fail deep inside)."""
        for field, size in sizes.items():
            name = ARGUMENT_NAMES.get(field, field)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{name} must be an int >= 1, got {size!r} ({type(size).__name__}): pass e.g. "
                                 f"{name}=2")

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1) -> "ParallelSizes":
        """The sizes of ``world_size`` ranks with these model-parallel sizes (dp is the rest)."""
        cls.check_sizes(tp=tp, pp=pp, ep=ep, cp=cp)  # before the arithmetic
        if world_size % (tp * pp):
            raise ValueError(
                f"world size {world_size} is not divisible by tensor_model_parallel_size ({tp}) x "
                f"pipeline_model_parallel_size ({pp}) = {tp * pp}: launch a multiple of {tp * pp} processes, e.g. "
                f"`torchrun --nproc_per_node {tp * pp} your_script.py`, or choose sizes whose product divides "
                f"{world_size}")
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp), ep=ep, cp=cp)

    @property
    def world(self) -> int:
        """The ranks of the layout: the product of the sizes that multiply it."""
        return math.prod(getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("multiplies_world"))

    @property
    def model_parallel(self) -> int:
        """Ranks holding different parts of one replica (tp x pp)."""
        return self.tp * self.pp

    def as_dict(self) -> dict[str, int]:
        """Every size and the world (checkpoint headers)."""
        return {**dataclasses.asdict(self), "world": self.world}
