"""A candidate layout and what the cost model predicts for it (plans as data)."""

import dataclasses
from typing import Literal

from nxd_hf.parallel_sizes import ParallelSizes

Schedule = Literal["1f1b", "gpipe", "interleaved_1f1b"]


@dataclasses.dataclass(kw_only=True, frozen=True)
class Layout:
    """One way to run the model on the cluster."""

    sizes: ParallelSizes
    """tp, pp, dp (world / (tp x pp)) and ep (carved from dp; 1 for dense models)."""
    sequence_parallel: bool = False
    """Activations split along the sequence between TP regions."""
    zero_1: bool = False
    """Optimizer state sharded over dp."""
    data_parallel_sharding: str | None = None
    """"zero3" / "zero2": parameters, gradients and optimizer state sharded over dp by FSDP2
    (``parallelize(data_parallel_sharding=...)``, docs/fsdp.md); None: not."""
    num_microbatches: int = 1
    """Microbatches per optimizer step and replica (pipeline microbatches, or gradient accumulation at pp=1)."""
    schedule: Schedule | None = None
    """Pipeline schedule (None at pp=1)."""
    virtual_stages: int = 1
    """Pipeline stages per rank (interleaved schedules)."""
    recompute: bool = False
    """Full activation checkpointing of every decoder layer."""
    context_parallel_attention: Literal["ring", "all_to_all"] | None = None
    """How attention runs across the context-parallel ranks (None at cp=1; ``nxd_hf.context``)."""

    @property
    def tp(self) -> int:
        return self.sizes.tp

    @property
    def pp(self) -> int:
        return self.sizes.pp

    @property
    def dp(self) -> int:
        return self.sizes.dp

    @property
    def ep(self) -> int:
        return self.sizes.ep

    @property
    def cp(self) -> int:
        return self.sizes.cp

    @property
    def replicas(self) -> int:
        """Ranks holding different rows: dp / cp (the CP ranks of a replica split its sequences)."""
        return self.sizes.dp // self.sizes.cp

    def local_seq_len(self, seq_len: int) -> int:
        """Tokens of a sequence one rank holds: padded to a multiple of 2 x cp and split over cp."""
        return seq_len if self.cp == 1 else -(-seq_len // (2 * self.cp)) * 2

    def as_dict(self) -> dict:
        """The sizes and the other fields, flat (the report's JSON)."""
        rest = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sizes"}
        return {**dataclasses.asdict(self.sizes), **rest}

    def name(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}"]
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += [f"cp{self.cp} {self.context_parallel_attention}"] if self.cp > 1 else []
        parts += ["sp"] if self.sequence_parallel else []
        parts += ["zero1"] if self.zero_1 else []
        parts += [self.data_parallel_sharding] if self.data_parallel_sharding else []
        parts += [f"mb{self.num_microbatches}"]
        parts += [self.schedule + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else "")] if self.schedule else []
        parts += ["recompute"] if self.recompute else []
        return " ".join(parts)


@dataclasses.dataclass(kw_only=True)
class Prediction:
    """The cost model's numbers for one layout (bytes per rank, seconds per step)."""

    layout: Layout
    memory: dict
    """Peak bytes of the busiest rank, itemized: parameters, gradients, optimizer_state, activations,
    loss, communication_buffers, lora (and ``peak``, their peak-time sum)."""
    time: dict
    """Seconds per optimizer step, itemized: compute, one entry per communication term, bubble (and ``step``)."""
    comm: list
    """The communication terms of one step (``nxd_hf.plan.comm.Term``), payload bytes per rank."""
    fits: bool = True

    @property
    def peak_memory(self) -> int:
        return self.memory["peak"]

    @property
    def step_time(self) -> float:
        return self.time["step"]


@dataclasses.dataclass(kw_only=True)
class Rejected:
    """A layout that was not kept, and why."""

    layout: Layout
    reason: str
    peak_memory: int | None = None
