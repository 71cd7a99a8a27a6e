"""NxD's ``neuronx_distributed.parallel_layers.parallel_state`` import path: the same module
object as ``nxd_hf.parallel_state`` (one set of groups, whichever path imports it)."""

import sys

from nxd_hf import parallel_state

sys.modules[__name__] = parallel_state
