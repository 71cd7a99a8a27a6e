"""``nxd_hf.plan``: which layout (tp, pp, dp, ep, sequence parallelism, ZeRO-1, microbatches,
schedule, recomputation) to run a model with, on a given cluster and memory budget, with the
predicted peak memory per rank and step time of each, and why the others were rejected.

The search is ``nxd_hf.plan.plan(model_or_config, world_size=8, device_memory="80GB",
seq_len=4096)`` (also ``nxd_hf.plan_layout(...)``). Modules: ``shapes`` (the model, its parameters per
rank by nxd_hf's sharding rules), ``memory``, ``comm`` / ``step_comm``, ``compute`` (the cost
model), ``search``, ``report`` (the table), ``auto`` (the "auto" sizes and nnScaler's autodist
policy). docs/plan.md describes the model and how ``bench/plan`` checks it.
"""

from nxd_hf.plan.api import load_config, plan
from nxd_hf.plan.auto import autodist_policy, resolve_auto_sizes
from nxd_hf.plan.cluster import PRESETS, Cluster, make_cluster, parse_bytes
from nxd_hf.plan.layout import Layout, Prediction, Rejected
from nxd_hf.plan.report import format_plan
from nxd_hf.plan.search import PlanResult

__all__ = ["PRESETS", "Cluster", "Layout", "PlanResult", "Prediction", "Rejected", "autodist_policy", "format_plan",
           "load_config", "make_cluster", "parse_bytes", "plan", "resolve_auto_sizes"]

