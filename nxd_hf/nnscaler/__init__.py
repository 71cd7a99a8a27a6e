"""nnScaler's parallel-module API on nxd_hf (``docs/nnscaler.md``)."""

from nxd_hf.nnscaler.optimizer import (
    ParallelOptimizer, PlainParallelOptimizer, Reducer, ZeroParallelOptimizer, build_optimizer,
)
from nxd_hf.nnscaler.state_dicts import (
    EXTRA_STATE_KEY, add_extra_state_hooks, load_merged_state_dicts, merge_state_dicts,
)
from nxd_hf.nnscaler.deduped import deduped_state_dict, load_deduped_state_dict
from nxd_hf.nnscaler.broadcast import broadcast_weights
from nxd_hf.nnscaler.reuse import BroadcastGenFilesStrategy, GenFiles, ReuseType, prepare_gen_savedir
