"""nnScaler's parallel-module API on nxd_hf (docs/nnscaler.md; reference:
nnscaler-parallel-module.md). A plain list of imports: each helper appends its own."""

from nxd_hf.nnscaler.api import parallelize
from nxd_hf.nnscaler.config import ComputeConfig
from nxd_hf.nnscaler.derive import TracedGraph
from nxd_hf.nnscaler.module import ParallelModule
from nxd_hf.nnscaler.policy import Plan
from nxd_hf.nnscaler.reducer import NonParallelReducer, non_parallel_module_reducer
