"""Ranks and process groups for tensor (TP), pipeline (PP), data (DP) and expert (EP) parallelism.

Rank layout is [PP, DP, TP] with TP fastest: global rank = (pp_rank * dp + dp_rank) * tp + tp_rank,
so the ranks of one TP group are contiguous (on one node when tp <= GPUs per node).
Names follow NxD's ``neuronx_distributed.parallel_state``. When nothing is initialized, every
getter answers as for a single process (tp = pp = dp = 1), so layers work without setup.

Expert parallelism is carved from the data-parallel dimension (as Megatron and torchtitan do,
docs/moe.md): for each (pp, tp) position the DP indices split into consecutive blocks of ``ep``;
an "expert" group is one block (the ranks that split the experts among them), an "expert_data"
group the ranks at the same position in every block (they hold the same experts: their expert
gradients are averaged over it). With ep = 1 the expert group is the rank alone and expert_data
is the data group (no extra groups are made).
"""

import dataclasses
import datetime

from nxd_hf import backend
from nxd_hf.parallel_sizes import ParallelSizes


@dataclasses.dataclass(kw_only=True)
class _State:
    sizes: ParallelSizes  # the layout the groups were made for
    groups: dict  # kind -> this rank's group
    ranks: dict  # kind -> this rank's index within its group of that kind
    rank_lists: dict  # kind -> list of rank lists, one per group of that kind
    timeout: datetime.timedelta | None = None  # of every group's collectives (None: torch's default)


_state: _State | None = None


GROUP_NAMES = {"tensor": "tensor-parallel (tp)", "data": "data-parallel (dp)", "pipeline": "pipeline-parallel (pp)",
               "model": "model-parallel (tp x pp)", "expert": "expert-parallel (ep)",
               "expert_data": "expert-data-parallel (dp / ep)", "context": "context-parallel (cp)"}


def as_timeout(timeout) -> datetime.timedelta | None:
    """``timeout`` (seconds or a ``timedelta``; None: torch's default) as a ``timedelta``."""
    if timeout is None or isinstance(timeout, datetime.timedelta):
        seconds = None if timeout is None else timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise ValueError(f"timeout must be seconds (int or float) or a datetime.timedelta, got {timeout!r}")
    if seconds is not None and seconds <= 0:
        raise ValueError(f"timeout must be positive, got {seconds} seconds")
    return None if seconds is None else datetime.timedelta(seconds=seconds)


def rank_lists(sizes: ParallelSizes) -> dict[str, list[list[int]]]:
    """Every group of every kind for a [PP, DP, TP] layout, plus the "expert" and "expert_data"
    groups carved from DP when ``ep`` > 1 (pure; unit-tested)."""
    tp, pp, dp, ep, cp = sizes.tp, sizes.pp, sizes.dp, sizes.ep, sizes.cp

    def rank(p, d, t):
        return (p * dp + d) * tp + t

    lists = {
        "tensor": [[rank(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "data": [[rank(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pipeline": [[rank(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
        # every rank holding a different part of one model replica: TP x PP
        "model": [[rank(p, d, t) for p in range(pp) for t in range(tp)] for d in range(dp)],
    }
    if ep > 1:
        blocks = range(dp // ep)
        lists["expert"] = [[rank(p, b * ep + e, t) for e in range(ep)] for p in range(pp) for t in range(tp)
                           for b in blocks]
        lists["expert_data"] = [[rank(p, b * ep + e, t) for b in blocks] for p in range(pp) for t in range(tp)
                                for e in range(ep)]
    if cp > 1:  # consecutive blocks of each data group, nearest to TP (Megatron's [pp, dp, cp, tp] order)
        lists["context"] = [ranks[i:i + cp] for ranks in lists["data"] for i in range(0, dp, cp)]
    return lists


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1, *,
                              timeout: float | datetime.timedelta | None = None,
                              expert_parallel_size: int = 1, context_parallel_size: int = 1) -> None:
    """Create the TP, PP, DP and model-parallel groups; initializes torch.distributed from the
    torchrun environment if needed. Calling it again first destroys the previous groups.

    timeout: seconds (or a timedelta) a collective on these groups may wait for the other
    ranks before it raises a ``TimeoutError`` naming the group; None keeps torch's default
    (30 minutes; 10 for nccl). Not in NxD, which takes the timeout from the launcher.

    expert_parallel_size: ranks the experts of a mixture-of-experts layer are split over, carved
    from the data-parallel ranks (module docstring); must divide the data-parallel size."""
    global _state
    ParallelSizes.check_sizes(tp=tensor_model_parallel_size, pp=pipeline_model_parallel_size, ep=expert_parallel_size,
                              cp=context_parallel_size)
    timeout = as_timeout(timeout)
    backend.init_process_group_from_env(timeout)
    if _state is not None:
        destroy_model_parallel()
    sizes = ParallelSizes.for_world(backend.world_size(), tp=tensor_model_parallel_size,
                                    pp=pipeline_model_parallel_size, ep=expert_parallel_size, cp=context_parallel_size)
    lists = rank_lists(sizes)
    me = backend.rank()
    groups, my_ranks = {}, {}
    for kind, rank_groups in lists.items():
        for ranks in rank_groups:  # every rank must create every group
            group = backend.new_group(ranks, timeout=timeout, name=GROUP_NAMES[kind],
                                      point_to_point=kind in ("pipeline", "context"))  # context: ring attention
            if me in ranks:
                groups[kind], my_ranks[kind] = group, ranks.index(me)
    _state = _State(sizes=sizes, groups=groups, ranks=my_ranks, rank_lists=lists, timeout=timeout)


_before_destroy: list = []
"""Callables run first by ``destroy_model_parallel`` (e.g. waiting for background checkpoint writes)."""


def register_before_destroy(fn) -> None:
    if fn not in _before_destroy:
        _before_destroy.append(fn)


def destroy_model_parallel() -> None:
    global _state
    for fn in _before_destroy:
        fn()
    if _state is not None:
        for group in _state.groups.values():
            backend.destroy_group(group)
    _state = None


def model_parallel_is_initialized() -> bool:
    return _state is not None


def get_parallel_sizes() -> ParallelSizes:
    """The layout of the groups (one process's, all sizes 1, when nothing is initialized)."""
    return _state.sizes if _state else ParallelSizes()


def get_collective_timeout() -> datetime.timedelta | None:
    """The ``timeout`` given to ``initialize_model_parallel``, for groups created later."""
    return _state.timeout if _state else None


def _rank_in(kind: str) -> int:
    return _state.ranks[kind] if _state else 0


def _group(kind: str, as_list: bool):
    if _state is None:
        return [[backend.rank()]] if as_list else backend.SELF
    return _state.rank_lists[kind] if as_list else _state.groups[kind]


# -- tensor parallel
def get_tensor_model_parallel_size() -> int:
    return get_parallel_sizes().tp


def get_tensor_model_parallel_rank() -> int:
    return _rank_in("tensor")


def get_tensor_model_parallel_group(as_list: bool = False):
    return _group("tensor", as_list)


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this rank's TP group."""
    return backend.rank() - get_tensor_model_parallel_rank()


# -- pipeline parallel
def get_pipeline_model_parallel_size() -> int:
    return get_parallel_sizes().pp


def get_pipeline_model_parallel_rank() -> int:
    return _rank_in("pipeline")


def get_pipeline_model_parallel_group(as_list: bool = False):
    return _group("pipeline", as_list)


# -- data parallel
def get_data_parallel_size() -> int:
    return get_parallel_sizes().dp


def get_data_parallel_rank() -> int:
    return _rank_in("data")


def get_data_parallel_group(as_list: bool = False):
    return _group("data", as_list)


# -- model parallel (TP x PP: one replica)
def get_model_parallel_group(as_list: bool = False):
    return _group("model", as_list)


def get_model_parallel_rank() -> int:
    return _rank_in("model")


# -- expert parallel (carved from data parallel; module docstring)
def get_expert_parallel_size() -> int:
    return get_parallel_sizes().ep


def get_expert_parallel_rank() -> int:
    return _rank_in("expert") if get_expert_parallel_size() > 1 else 0


def get_expert_parallel_group(as_list: bool = False):
    """The ranks splitting the experts among them (this rank alone at ep = 1)."""
    if get_expert_parallel_size() > 1:
        return _group("expert", as_list)
    return [[r] for r in range(backend.world_size())] if as_list else backend.SELF


def get_expert_data_parallel_size() -> int:
    return get_data_parallel_size() // get_expert_parallel_size()


def get_expert_data_parallel_rank() -> int:
    return _rank_in("expert_data") if get_expert_parallel_size() > 1 else get_data_parallel_rank()


def get_expert_data_parallel_group(as_list: bool = False):
    """The ranks holding the same experts (the data group at ep = 1)."""
    return _group("expert_data" if get_expert_parallel_size() > 1 else "data", as_list)


# -- context parallel (carved from data parallel: nxd_hf/context/groups.py)
def get_context_parallel_size() -> int:
    return get_parallel_sizes().cp


def get_context_parallel_rank() -> int:
    return _rank_in("context") if get_context_parallel_size() > 1 else 0


def get_context_parallel_group(as_list: bool = False):
    """The ranks splitting one replica's sequences among them (this rank alone at cp = 1)."""
    if get_context_parallel_size() > 1:
        return _group("context", as_list)
    return [[r] for r in range(backend.world_size())] if as_list else backend.SELF


def get_data_parallel_replicas() -> int:
    """Data-parallel ranks holding different batches: dp / cp (the cp ranks of one replica share one)."""
    return get_data_parallel_size() // get_context_parallel_size()


def get_data_parallel_replica_rank() -> int:
    return get_data_parallel_rank() // get_context_parallel_size()


# NxD spells some of these two ways; both work.
get_tensor_parallel_size = get_tensor_model_parallel_size
get_tensor_parallel_rank = get_tensor_model_parallel_rank
get_tensor_parallel_group = get_tensor_model_parallel_group
get_pipeline_parallel_size = get_pipeline_model_parallel_size
get_pipeline_parallel_rank = get_pipeline_model_parallel_rank
get_pipeline_parallel_group = get_pipeline_model_parallel_group
get_data_parallel_world_size = get_data_parallel_size
get_tensor_model_parallel_world_size = get_tensor_model_parallel_size
get_pipeline_model_parallel_world_size = get_pipeline_model_parallel_size


def rmsg(msg: str) -> str:
    """Prefix ``msg`` with this rank's coordinates, for logs."""
    return (
        f"[rank {backend.rank()} tp {get_tensor_model_parallel_rank()} "
        f"pp {get_pipeline_model_parallel_rank()} dp {get_data_parallel_rank()}] {msg}"
    )
