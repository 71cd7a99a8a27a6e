"""nnScaler's parallel-module API on nxd_hf (docs/nnscaler.md; reference:
nnscaler-parallel-module.md). A plain list of imports: each helper appends its own."""

from nxd_hf.nnscaler.api import parallelize
from nxd_hf.nnscaler.config import ComputeConfig
from nxd_hf.fx_tp.derive import TracedGraph
from nxd_hf.nnscaler.module import ParallelModule
from nxd_hf.nnscaler.policy import Plan
from nxd_hf.nnscaler.reducer import Reducer, non_parallel_module_reducer
from nxd_hf.nnscaler.optimizer import (
    ParallelOptimizer, PlainParallelOptimizer, ZeroParallelOptimizer, build_optimizer,
)
from nxd_hf.nnscaler.state_dicts import (
    EXTRA_STATE_KEY, add_extra_state_hooks, load_merged_state_dict, load_merged_state_dicts, merge_state_dicts,
)
from nxd_hf.nnscaler.deduped import deduped_state_dict, load_deduped_state_dict
from nxd_hf.nnscaler.broadcast import broadcast_weights
from nxd_hf.nnscaler.reuse import BroadcastGenFilesStrategy, GenFiles, ReuseType, prepare_gen_savedir
