"""The one module that talks to ``torch.distributed``.

Everything in nxd_hf that communicates goes through these functions, so gloo (CPU), nccl
(CUDA) and xla (torch-xla) differ here only, and so the payload bytes of every collective can
be counted in one place (``count_comm``; used by ``bench/comm_volume/run.py`` and the tests).

Payload is the size of the tensor a rank hands to the collective: the whole tensor for
all-reduce, broadcast and reduce-scatter, the local shard for all-gather. Collectives over a
group of size 1 are skipped and not counted.

Devices. ``default_device()`` is where a rank computes: ``cuda:LOCAL_RANK`` (modulo the GPUs
there) when the backend serves CUDA only (nccl, ``cuda:gloo``) or maps CUDA to nccl, the XLA
device under xla, else the CPU. ``collective_device(group)`` is where every tensor handed to
a collective on ``group`` lives — control tensors included (failure flags, input-check sums,
sizes, norms, checkpoint metadata): the compute device when the group's backend serves it,
else the CPU. Control tensors are built on that device rather than on a CPU side channel
(a ``cpu:gloo,cuda:nccl`` default group): that works whoever created the process group (a
user's own ``init_process_group("nccl")`` has no CPU backend), keeps one backend per group
(no second set of gloo connections per group), and the hot path (gradients, norms,
activations) is already on the device; the few control values cost one small host-device
copy, made where the host reads them anyway. Every collective checks that its tensor's
device type is one the group's backend serves and raises naming the op otherwise
(``tests/test_devices.py`` checks statically, without a GPU, that every tensor nxd_hf builds
names its device).

``NXD_HF_BACKEND`` overrides the backend: ``cuda:gloo`` runs 2-4 ranks on one GPU (nccl
refuses that) and, like nccl, refuses CPU tensors — the GPU test lane uses it. gloo cannot
send/recv CUDA tensors, so point-to-point (the pipeline) under a gloo backend that computes on
CUDA is staged through the CPU on a plain gloo twin of the group (``p2p_group``,
``p2p_device``).

A script started with plain ``python`` (no torchrun) gets a world of one process on the
default backend: nccl on ``cuda:0`` when a GPU is there — the same backend and device as
``torchrun --nproc_per_node 1``, so the two launches run the same code; a world of one makes
no collective call, so nccl costs nothing there.
"""

import contextlib
import dataclasses
import datetime
import os

import torch
import torch.distributed as dist


def default_backend() -> str:
    """``$NXD_HF_BACKEND`` when set (e.g. ``cuda:gloo``), ``xla`` when an XLA device is
    requested, else nccl with a GPU, gloo without."""
    requested = os.environ.get("NXD_HF_BACKEND")
    if requested:
        return requested
    if os.environ.get("PJRT_DEVICE"):
        return "xla"
    return "nccl" if torch.cuda.is_available() else "gloo"


def _config_devices(config: str) -> dict[str, str]:
    """device type -> backend name of a backend config ("cpu:gloo,cuda:gloo", "nccl", "cuda:gloo")."""
    defaults = {"gloo": ("cpu", "cuda"), "nccl": ("cuda",), "xla": ("xla",)}
    devices = {}
    for part in config.split(","):
        device, _, name = part.rpartition(":")
        for d in (device,) if device else defaults.get(name, ("cpu",)):
            devices[d] = name
    return {"xla": "xla"} if "xla" in devices.values() else devices  # however torch-xla registers it


def _served_devices(group=None) -> dict[str, str]:
    """device type -> backend name for ``group`` (the default group for None; SELF: the default backend)."""
    if not dist.is_initialized():
        return _config_devices(default_backend())
    return _config_devices(str(dist.get_backend_config(None if group is SELF else group)))


def _local_cuda_device() -> torch.device:
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError(f"the backend {default_backend()!r} computes on CUDA but no GPU is visible: run on a GPU "
                         "machine, or unset $NXD_HF_BACKEND (gloo on the CPU)")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank())) % count)


def default_device() -> torch.device:
    """The device a rank computes on for the backend in use (module docstring)."""
    served = _served_devices()
    if "xla" in served:
        import torch_xla.core.xla_model as xm  # optional extra

        return xm.xla_device()
    if _computes_on_cuda(served):
        return _local_cuda_device()
    return torch.device("cpu")


def _computes_on_cuda(served: dict[str, str]) -> bool:
    """CUDA-only backends, or CUDA on nccl; plain gloo (CPU and CUDA) computes on the CPU."""
    return "cuda" in served and ("cpu" not in served or served["cuda"] == "nccl")


def collective_device(group=None) -> torch.device:
    """Where tensors handed to a collective on ``group`` live (control tensors included): the
    compute device when the group's backend serves it, else the CPU."""
    device = default_device()
    return device if device.type in _served_devices(group) else torch.device("cpu")


def p2p_device(group=None, device: torch.device | None = None) -> torch.device:
    """Where tensors computed on ``device`` (default: the compute device) are sent point-to-point
    on ``group``: the CPU when gloo serves that device (gloo's send/recv of a CUDA tensor fails
    and breaks the group), else ``device`` itself."""
    device = device or default_device()
    return torch.device("cpu") if _served_devices(group).get(device.type) == "gloo" else device


def p2p_group(group):
    """The group to send point-to-point on for ``group``: its plain-gloo twin when sends are
    staged through the CPU (``p2p_device``) and the group itself does not serve the CPU."""
    return _p2p_twins.get(group, group)


_p2p_twins: dict = {}


def launch_device(name: str, local_rank: int = 0) -> str:
    """The device a rank with ``local_rank`` computes on under backend ``name`` (``nxd-hf env``)."""
    served = _config_devices(name)
    if "xla" in served:
        return "the XLA device"
    if _computes_on_cuda(served):
        count = torch.cuda.device_count()
        return f"cuda:{local_rank % count}" if count else "cuda (no GPU visible: it would fail)"
    return "cpu"


def _init_world_of_one() -> None:
    """A plain ``python script.py``: one process on the default backend (module docstring)."""
    name = default_backend()
    if name == "xla":  # a world of one makes no collective call: gloo, as before torch-xla's init
        name = "gloo"
    set_cuda_device_from_env()
    dist.init_process_group(name, store=dist.HashStore(), rank=0, world_size=1)


def set_cuda_device_from_env() -> None:
    """Select this rank's GPU (``LOCAL_RANK`` modulo the GPUs there) when the backend computes on CUDA."""
    if _computes_on_cuda(_config_devices(default_backend())) and torch.cuda.is_available():
        torch.cuda.set_device(_local_cuda_device())


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


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


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


SELF = "self"
"""The group of this rank alone (what ``parallel_state`` hands out before initialization)."""


def group_size(group) -> int:
    if group is SELF or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index within ``group``."""
    if group is SELF or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


# torch >= 2.13 renamed the flat collectives; torch-xla's torch (2.9) has only the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclasses.dataclass
class CommRecord:
    op: str
    group_size: int
    payload_bytes: int
    tag: str
    ranks: tuple[int, ...] = ()
    """Global ranks of the group."""


_records: list[CommRecord] | None = None
_tag = ""


@contextlib.contextmanager
def count_comm():
    """Collect a ``CommRecord`` for every collective issued inside the block."""
    global _records
    previous, _records = _records, []
    try:
        yield _records
    finally:
        _records = previous


@contextlib.contextmanager
def comm_tag(tag: str):
    """Label the collectives issued inside the block (shows up in ``CommRecord.tag``)."""
    global _tag
    previous, _tag = _tag, tag
    try:
        yield
    finally:
        _tag = previous


def _is_abstract(tensor: torch.Tensor) -> bool:
    """Meta or fake tensors (shape propagation): collectives only compute the output shape."""
    from torch._subclasses.fake_tensor import is_fake

    if torch.compiler.is_compiling():  # dynamo's fake tensors stand for real ones: trace the collective
        return tensor.is_meta
    return tensor.is_meta or is_fake(tensor)


def _record(op: str, tensor: torch.Tensor, group) -> None:
    """Check the tensor's device against the group's backend, and count the collective."""
    served = _served_devices(group)
    assert tensor.device.type in served, (
        f"nxd_hf bug: {op} of a {tensor.device.type} tensor on a group whose backend serves {sorted(served)} "
        "(build tensors handed to collectives on backend.collective_device(group))")
    if _records is not None:
        size = tensor.numel() * tensor.element_size()
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(world_size()))
        _records.append(CommRecord(op, group_size(group), size, _tag, ranks))


def all_reduce(tensor: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of ``tensor`` over ``group``; op is "sum", "max" or "min"."""
    if group_size(group) == 1 or _is_abstract(tensor):
        return tensor
    _record("all_reduce", tensor, group)
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    with _named_errors("all_reduce", group):
        dist.all_reduce(tensor, op=reduce_op, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim``, in group-rank order."""
    size = group_size(group)
    if size == 1:
        return tensor
    if _is_abstract(tensor):
        return torch.cat([tensor] * size, dim=dim)
    _record("all_gather", tensor, group)
    moved = tensor.movedim(dim, 0).contiguous()
    out = torch.empty((size * moved.shape[0], *moved.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    with _named_errors("all_gather", group):
        _all_gather_flat(out, moved, group=group)
    return out.movedim(0, dim)


def reduce_scatter(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` and return this rank's chunk along ``dim``."""
    size = group_size(group)
    if size == 1:
        return tensor
    assert tensor.shape[dim] % size == 0, (tensor.shape, dim, size)
    if _is_abstract(tensor):
        return tensor.narrow(dim, 0, tensor.shape[dim] // size).clone()
    _record("reduce_scatter", tensor, group)
    moved = tensor.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // size, *moved.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    with _named_errors("reduce_scatter", group):
        _reduce_scatter_flat(out, moved, group=group)
    return out.movedim(0, dim)


# Flat all-gather / reduce-scatter (ZeRO-1's buckets). gloo's own flat collectives copy their
# buffers into temporaries (4-6x the payload) and are slower than one broadcast / reduce per
# rank on the chunks in place: 25 MB on 2 (4) CPU ranks, median all-gather 48 (89) ms against
# broadcasts 16 (49) ms, reduce-scatter 71 (175) ms against reduces 47 (55) ms. nccl and xla
# use the native collectives. Either way one record per call, under the logical op's name.
def all_gather_into(out: torch.Tensor, tensor: torch.Tensor, group) -> torch.Tensor:
    """Every rank's 1-D ``tensor`` concatenated in group-rank order, written into the 1-D ``out``
    (``group size x`` as long); a copy over a group of one. On gloo: one broadcast per rank of
    its chunk of ``out``."""
    size = group_size(group)
    if size == 1:
        return out.copy_(tensor)
    _record("all_gather", tensor, group)
    with _named_errors("all_gather", group):
        if "gloo" not in dist.get_backend(group):  # cuda:gloo too
            _all_gather_flat(out, tensor, group=group)
        else:
            chunks = out.view(size, -1)
            chunks[group_rank(group)].copy_(tensor)
            _per_rank_chunk(chunks, group, lambda chunk, rank: dist.broadcast(chunk, src=rank, group=group,
                                                                              async_op=True))
    return out


def reduce_scatter_into(out: torch.Tensor, tensor: torch.Tensor, group) -> torch.Tensor:
    """Sum the 1-D ``tensor`` over ``group`` and write this rank's 1/size chunk into the 1-D
    ``out``; a copy over a group of one. ``tensor`` is scratch: it may be overwritten. On gloo:
    one reduce per chunk, to the rank that owns it."""
    size = group_size(group)
    if size == 1:
        return out.copy_(tensor)
    assert tensor.numel() == out.numel() * size, (tensor.shape, out.shape)
    _record("reduce_scatter", tensor, group)
    with _named_errors("reduce_scatter", group):
        if "gloo" not in dist.get_backend(group):  # cuda:gloo too
            _reduce_scatter_flat(out, tensor, group=group)
            return out
        chunks = tensor.view(size, -1)
        _per_rank_chunk(chunks, group, lambda chunk, rank: dist.reduce(chunk, dst=rank, group=group, async_op=True))
    return out.copy_(chunks[group_rank(group)])


def _per_rank_chunk(chunks: torch.Tensor, group, start) -> None:
    """gloo: ``start(chunks[j], global rank of group rank j)`` for every j (async work), then wait."""
    works = [start(chunks[j], dist.get_global_rank(group, j)) for j in range(len(chunks))]
    for work in works:
        work.wait()


def broadcast(tensor: torch.Tensor, src: int, group) -> torch.Tensor:
    """In-place broadcast from global rank ``src`` to every rank of ``group``."""
    if group_size(group) == 1 or _is_abstract(tensor):
        return tensor
    assert tensor.is_contiguous(), "broadcast of a non-contiguous view would send the wrong elements"
    _record("broadcast", tensor, group)
    with _named_errors("broadcast", group):
        dist.broadcast(tensor, src=src, group=group)
    return tensor


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


def abort_groups() -> None:
    """Abort every process group of this rank (the default one included): a peer waiting on
    this rank in a send, receive or collective gets an error at once instead of waiting for
    the timeout. Nothing can communicate afterwards."""
    groups = list(dist.distributed_c10d._world.pg_map)
    for group in groups:
        try:
            group.abort()
        except RuntimeError:  # already aborted, or a backend without abort
            pass
