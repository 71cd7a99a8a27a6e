"""The collectives, each counted (``count_comm``) and checked against its group's backend."""

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from nxd_hf.backend.devices import _served_devices
from nxd_hf.backend.groups import _named_errors, group_rank, group_size, p2p_group, world_size


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


def is_abstract(tensor: torch.Tensor) -> bool:
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
    if group_size(group) == 1 or is_abstract(tensor):
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
    if is_abstract(tensor):
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
    if is_abstract(tensor):
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
    one reduce per chunk, to the rank that owns it (``reduce_scatter_async``, waited)."""
    handle = reduce_scatter_async(out, tensor, group)
    with _named_errors("reduce_scatter", group):  # a peer's failure surfaces in the wait
        handle.wait()
    return out


def _per_rank_chunk(chunks: torch.Tensor, group, start) -> None:
    """gloo: ``start(chunks[j], global rank of group rank j)`` for every j (async work), then wait."""
    works = [start(chunks[j], dist.get_global_rank(group, j)) for j in range(len(chunks))]
    for work in works:
        work.wait()


def broadcast(tensor: torch.Tensor, src: int, group) -> torch.Tensor:
    """In-place broadcast from global rank ``src`` to every rank of ``group``."""
    if group_size(group) == 1 or is_abstract(tensor):
        return tensor
    assert tensor.is_contiguous(), "broadcast of a non-contiguous view would send the wrong elements"
    _record("broadcast", tensor, group)
    with _named_errors("broadcast", group):
        dist.broadcast(tensor, src=src, group=group)
    return tensor


def all_to_all(tensor: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Expert-parallel exchange of rows: ``tensor``'s first ``in_splits[0]`` rows go to group rank
    0, the next ``in_splits[1]`` to rank 1, ...; returns the rows received, ``out_splits[j]``
    from rank j, in group-rank order (variable sizes; gloo serves it on the CPU)."""
    if group_size(group) == 1:
        return tensor
    out = torch.empty((sum(out_splits), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    if is_abstract(tensor):
        return out
    _record("all_to_all", tensor, group)
    with _named_errors("all_to_all", group):
        dist.all_to_all_single(out, tensor.contiguous(), out_splits, in_splits, group=group)
    return out


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """``counts[j]`` (int64, one per group rank) is what this rank sends to rank j; returns what
    each rank sends to this one (the split sizes of an ``all_to_all``, exchanged first)."""
    if group_size(group) == 1:
        return counts
    received = torch.empty_like(counts)
    _record("all_to_all", counts, group)
    with _named_errors("all_to_all", group):
        dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received


class _AllToAllRows(torch.autograd.Function):
    """``all_to_all`` of each tensor (same split sizes) forward; the reverse exchange of their
    gradients backward, in the same order on every rank (one autograd node). ``tags`` name each
    tensor's exchange in ``CommRecord.tag`` (".backward" added for the gradient)."""

    tags: tuple[str, ...] = ()

    @classmethod
    def forward(cls, ctx, out_splits, in_splits, group, *tensors):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        outs = []
        for tag, tensor in zip(cls.tags, tensors, strict=True):
            with comm_tag(tag):
                outs.append(all_to_all(tensor, out_splits, in_splits, group))
        ctx.outputs = [(out.shape, out.dtype, out.device) for out in outs]
        return tuple(outs) if len(outs) > 1 else outs[0]

    @classmethod
    def backward(cls, ctx, *grads):
        out_splits, in_splits = ctx.splits
        result = []
        for tag, grad, (shape, dtype, device) in zip(cls.tags, grads, ctx.outputs):
            grad = torch.zeros(shape, dtype=dtype, device=device) if grad is None else grad.contiguous()
            with comm_tag(tag + ".backward"):  # every rank exchanges, with or without a gradient
                result.append(all_to_all(grad, in_splits, out_splits, ctx.group))
        return None, None, None, *result


class DispatchTokens(_AllToAllRows):
    """Token rows and their routing weights to the ranks holding their experts (expert
    parallelism's dispatch): ``apply(out_splits, in_splits, group, rows, weights)``."""

    tags = ("ep_dispatch", "ep_dispatch_weights")


class DispatchRows(_AllToAllRows):
    """Rows alone (no routing weights) to the ranks holding their experts: the dense experts'
    dispatch (Llama 4: every token through every expert): ``apply(out_splits, in_splits, group, rows)``."""

    tags = ("ep_dispatch",)


class CombineTokens(_AllToAllRows):
    """Expert outputs back to the ranks the tokens came from (expert parallelism's combine):
    ``apply(out_splits, in_splits, group, rows)``."""

    tags = ("ep_combine",)


class _Done:
    """The handle of a collective that had nothing to do (a group of one, an abstract tensor)."""

    def wait(self) -> bool:
        return True


def all_reduce_async(tensor: torch.Tensor, group):
    """Start an in-place sum of ``tensor`` over ``group``; returns a handle whose ``wait()``
    blocks until it is done (gloo runs it on its own thread, nccl on its stream)."""
    if group_size(group) == 1 or is_abstract(tensor):
        return _Done()
    _record("all_reduce", tensor, group)
    with _named_errors("all_reduce", group):
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)


class _ReduceScatterWork:
    """The handle of ``reduce_scatter_async``: ``wait()`` waits for its works and, on gloo, copies
    this rank's reduced chunk into ``out``."""

    def __init__(self, works: list, out: torch.Tensor | None = None, chunk: torch.Tensor | None = None):
        self.works, self.out, self.chunk = works, out, chunk

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        if self.out is not None:
            self.out.copy_(self.chunk)
        self.works, self.out = [], None
        return True


def reduce_scatter_async(out: torch.Tensor, tensor: torch.Tensor, group):
    """Start ``reduce_scatter_into(out, tensor, group)``; returns a handle whose ``wait()`` blocks
    until ``out`` holds the result (``tensor`` must stay untouched until then)."""
    size = group_size(group)
    if size == 1 or is_abstract(tensor):
        out.copy_(tensor)
        return _Done()
    assert tensor.numel() == out.numel() * size, (tensor.shape, out.shape)
    _record("reduce_scatter", tensor, group)
    with _named_errors("reduce_scatter", group):
        if "gloo" not in dist.get_backend(group):
            return _ReduceScatterWork([_reduce_scatter_flat(out, tensor, group=group, async_op=True)])
        chunks = tensor.view(size, -1)
        works = [dist.reduce(chunks[j], dst=dist.get_global_rank(group, j), group=group, async_op=True)
                 for j in range(size)]
        return _ReduceScatterWork(works, out, chunks[group_rank(group)])


class RingShift:
    """Pending ``ring_shift``: ``wait()`` returns the tensors received from the previous rank."""

    def __init__(self, works: list, received: list[torch.Tensor]):
        self.works, self.received = works, received

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return self.received


def ring_shift(tensors: list[torch.Tensor], group) -> RingShift:
    """Start sending each tensor to the next rank of ``group`` (group rank + 1, wrapping) and
    receiving the previous rank's tensors of the same shapes (ring attention's K/V hop). Counted
    as "send" with the payload of the tensors this rank sends."""
    size = group_size(group)
    if size == 1:
        return RingShift([], list(tensors))
    me = group_rank(group)
    to, frm = dist.get_global_rank(group, (me + 1) % size), dist.get_global_rank(group, (me - 1) % size)
    twin = p2p_group(group)  # a plain gloo twin when gloo computes on CUDA: sends staged through the CPU
    ops, received = [], []
    for tensor in tensors:
        tensor = tensor.contiguous() if twin is group else tensor.cpu()
        _record("send", tensor, twin)
        out = torch.empty_like(tensor)
        ops += [dist.P2POp(dist.isend, tensor, to, twin), dist.P2POp(dist.irecv, out, frm, twin)]
        received.append(out)
    with _named_errors("send/recv", group):
        works = dist.batch_isend_irecv(ops)
    if twin is not group:
        for work in works:
            work.wait()
        return RingShift([], [out.to(t.device) for out, t in zip(received, tensors)])
    return RingShift(works, received)
