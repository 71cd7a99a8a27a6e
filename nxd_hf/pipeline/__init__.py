"""Pipeline parallelism: HF-aware tracing, partitioning, schedules and point-to-point
(the runtime is ``torch.distributed.pipelining``)."""

from nxd_hf.pipeline.model import NxDPPModel
from nxd_hf.pipeline.runtime import SCHEDULES

__all__ = ["NxDPPModel", "SCHEDULES"]
