"""The process groups: starting the world, making and naming groups, their errors, and the
small host-side agreement (barriers, objects, the store)."""

import atexit
import contextlib
import datetime
import os
import warnings

import torch.distributed as dist

from nxd_hf.backend.devices import SELF, _served_devices, default_backend, default_device, set_cuda_device_from_env


def p2p_group(group):
    """The group to send point-to-point on for ``group``: its plain-gloo twin when sends are
    staged through the CPU (``p2p_device``) and the group itself does not serve the CPU."""
    return _p2p_twins.get(group, group)


_p2p_twins: dict = {}


def _init_world_of_one() -> None:
    """A plain ``python script.py``: one process on the default backend (module docstring)."""
    name = default_backend()
    if name == "xla":  # a world of one makes no collective call: gloo, as before torch-xla's init
        name = "gloo"
    set_cuda_device_from_env()
    dist.init_process_group(name, store=dist.HashStore(), rank=0, world_size=1)
    atexit.register(_destroy_world_at_exit)


def _destroy_world_at_exit() -> None:
    """The world nxd_hf started is torn down at exit when the script did not do it: a gloo
    group left alive aborts the interpreter now and then ("terminate called without an active
    exception") as its threads are destroyed after Python's."""
    if dist.is_initialized():
        dist.destroy_process_group()


def init_process_group_from_env(timeout: datetime.timedelta | None = None) -> None:
    """Initialize the default group from the torchrun environment (RANK, WORLD_SIZE, ...), or
    as a world of one process when the script was started without torchrun (module
    docstring). ``timeout`` bounds its collectives (None: torch's default)."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:  # plain `python script.py`
        _init_world_of_one()
        return
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise ValueError(
                f"torch.distributed is not initialized and ${var} is not set: launch with "
                "torchrun, or call torch.distributed.init_process_group() first"
            )
    backend = default_backend()
    kwargs = {}
    if backend == "xla":
        import torch_xla.distributed.xla_backend  # noqa: F401  registers the backend

        kwargs["init_method"] = "xla://"
    else:
        set_cuda_device_from_env()
    dist.init_process_group(backend, timeout=timeout, **kwargs)
    atexit.register(_destroy_world_at_exit)


def is_initialized() -> bool:
    """Whether torch.distributed's default process group exists (someone started it)."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def warn_once(message: str, category: type[Warning] = UserWarning, *, stacklevel: int = 1) -> None:
    """A warning every rank would give alike, given by rank 0 only (under torchrun before the
    process group exists, by the process whose ``RANK`` is 0). ``stacklevel`` as ``warnings.warn``'s
    counted from the caller."""
    if (dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))) == 0:
        warnings.warn(message, category, stacklevel=stacklevel + 1)


def new_group(ranks: list[int], *, timeout: datetime.timedelta | None = None, name: str = "",
              point_to_point: bool = False):
    """A process group of ``ranks``; ``timeout`` bounds every collective on it (None: torch's
    default, 30 minutes; 10 for nccl); ``name`` says which group it is in error messages.
    ``point_to_point``: the group sends point-to-point (the pipeline), so it gets a plain gloo
    twin when sends are staged through the CPU (``p2p_group``). Called on every rank, as
    ``torch.distributed.new_group``."""
    group = dist.new_group(ranks, timeout=timeout)
    _group_names[group] = (name, list(ranks), timeout)
    served = _served_devices()  # a new group has the default group's backends
    if point_to_point and served.get(default_device().type) == "gloo" and "cpu" not in served:
        twin = dist.new_group(ranks, timeout=timeout, backend="gloo")
        if rank() in ranks:
            _p2p_twins[group] = twin
    return group


def new_host_group(name: str):
    """A gloo group of every rank beside the default one, for host-side agreement that must never
    pair with a collective a failed peer left waiting on another group. Called on every rank."""
    group = dist.new_group(backend="gloo")
    _group_names[group] = (name, list(range(world_size())), None)
    return group


def destroy_group(group) -> None:
    _group_names.pop(group, None)
    twin = _p2p_twins.pop(group, None)
    if twin is not None:
        dist.destroy_process_group(twin)
    dist.destroy_process_group(group)


_group_names: dict = {}


@contextlib.contextmanager
def _named_errors(op: str, group):
    """Turn a collective's backend error into one that names the group and what to check."""
    try:
        yield
    except RuntimeError as error:
        text = str(error).lower()
        name, ranks, timeout = _group_names.get(group, ("world", list(range(world_size())), None))
        where = f"{op} on the {name} group (global ranks {ranks})"
        if "connection" in text:  # gloo: a peer exited or reset the connection
            raise RuntimeError(f"{where} failed: a rank of this group failed or exited ({error})") from error
        if "timed out" not in text and "timeout" not in text:
            raise
        limit = f"{timeout.total_seconds():g}s" if timeout else "its timeout"
        raise TimeoutError(
            f"{where} timed out after {limit}: not every rank of the group entered the same collective. Check "
            "that every rank runs the same steps (same number of batches, same code path, same input shapes "
            "within a tensor-parallel group) and that no rank failed; for steps that are slow, raise timeout= of "
            f"nxd_hf.parallelize / neuronx_distributed_config / initialize_model_parallel ({error})"
        ) from error


def group_size(group) -> int:
    if group is SELF or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index within ``group``."""
    if group is SELF or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def global_rank(group, rank_in_group: int) -> int:
    """The global rank of ``group``'s rank ``rank_in_group``."""
    if group is SELF or not dist.is_initialized():
        return rank()
    return dist.get_global_rank(group, rank_in_group)


def barrier(group=None) -> None:
    if dist.is_initialized():
        with _named_errors("barrier", group):
            dist.barrier(group=group)


def arrival_barrier(timeout_s: float, group=None) -> None:
    """A barrier that raises, naming the missing ranks, when some rank has not arrived within
    ``timeout_s`` (gloo's ``monitored_barrier``); other backends wait for the process group's
    own timeout."""
    if not dist.is_initialized():
        return
    if dist.get_backend(group) == "gloo":
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
    else:
        dist.barrier(group=group)


def all_gather_object(obj, group=None) -> list:
    """Every rank's picklable ``obj`` (in group-rank order); small metadata only."""
    if not dist.is_initialized() or group_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def post_first(key: str, value: str) -> str:
    """Write ``value`` under ``key`` in the default group's store unless some rank wrote there
    first; return what the key holds (the first writer's value)."""
    store = dist.distributed_c10d._get_default_store()
    return store.compare_set(key, "", value).decode(errors="replace")


_groups_aborted = False


def groups_aborted() -> bool:
    """Whether this rank aborted its process groups (``abort_groups``)."""
    return _groups_aborted


def abort_groups() -> None:
    """Abort every process group of this rank (the default one included): a peer waiting on
    this rank in a send, receive or collective gets an error at once instead of waiting for
    the timeout. Nothing can communicate afterwards."""
    global _groups_aborted
    _groups_aborted = True
    groups = list(dist.distributed_c10d._world.pg_map)
    for group in groups:
        try:
            group.abort()
        except RuntimeError:  # already aborted, or a backend without abort
            pass
