"""The every-step batch fingerprint: tensor-/pipeline-parallel ranks given different batches are
caught within one step, without the host waiting for the device.

Every checked forward computes a fixed-size fingerprint of its inputs on their device (a CRC of
names, shapes and dtypes, known on the host, and two sums of the values, never read back) and
starts an asynchronous all-reduce that gathers every rank's fingerprint into its own slot over
the model-parallel group (TP x PP: the ranks that must see the same batch).

- The layouts are compared before the forward's own collectives, in stream order: ranks with
  different shapes (a different sequence length) would meet in collectives of different sizes,
  which gloo answers by aborting a process and nccl by hanging. On the CPU the wait is the
  host's anyway (gloo's collectives are), and a mismatch raises the ValueError naming the
  ranks; on a GPU the stream waits for the all-reduce and a device-side assert compares, so the
  host never waits.
- The values are compared on the host at the next forward (long arrived by then), so ranks
  fed different batches of one shape raise that ValueError, on every rank of the group, one
  step later.
"""

import zlib

import torch

from nxd_hf import backend, parallel_state
from nxd_hf.guards import device_checks

FIELDS = 3  # layout CRC, sum of the values, position-weighted sum of the values
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _values(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as int64, floats by their bits (two equal batches match exactly)."""
    flat = tensor.detach().reshape(-1)
    if flat.is_floating_point() or flat.is_complex():
        flat = flat.contiguous().view(_INTS[flat.element_size()] if not flat.is_complex() else torch.uint8)
    return flat.long()


def fingerprint(tensors: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """``[FIELDS]`` int64 on ``device``, computed without a host sync (sums wrap identically)."""
    layout = repr(sorted((name, tuple(t.shape), str(t.dtype)) for name, t in tensors.items()))
    total = torch.zeros((), dtype=torch.long, device=device)
    weighted = torch.zeros((), dtype=torch.long, device=device)
    for name in sorted(tensors):
        values = _values(tensors[name]).to(device, non_blocking=True)
        weights = torch.arange(values.numel(), device=device) % 65521 + 1
        total = total + values.sum()
        weighted = weighted + (values * weights).sum()
    crc = torch.tensor(zlib.crc32(layout.encode()), dtype=torch.long).to(device, non_blocking=True)
    return torch.stack([crc, total, weighted])


class PendingFingerprints:
    """The fingerprints of the last checked forward, in flight over the model-parallel group."""

    def __init__(self):
        self._work = None  # ((host copy of the [group size, FIELDS] slots, its CUDA event), ranks, inputs in words)

    def start(self, tensors: dict[str, torch.Tensor], describe) -> None:
        """Check the previous forward's fingerprints, send this one's and compare the layouts
        (before the forward's collectives). ``describe()``: this rank's inputs in words."""
        self.check()
        group = parallel_state.get_model_parallel_group()
        size = backend.group_size(group)
        if size == 1:
            return
        device = backend.collective_device(group)
        slots = torch.zeros(size, FIELDS, dtype=torch.long, device=device)
        slots[backend.group_rank(group)] = fingerprint(tensors, device)
        ranks = next(r for r in parallel_state.get_model_parallel_group(as_list=True) if backend.rank() in r)
        handle, mine = backend.all_reduce_async(slots, group), describe()
        handle.wait()  # gloo: done on return; nccl: the compute stream waits, the host does not
        layouts = slots[:, 0]
        same_layout = (layouts == layouts[0]).all()
        if slots.device.type == "cpu" and not bool(same_layout):
            raise ValueError(differs_message(ranks, mine, _same(ranks, slots[:, :1])))
        device_checks.assert_on_device(same_layout, differs_message(ranks, mine))
        self._work = (_to_host(slots), ranks, mine)

    def check(self) -> None:
        """Wait for the fingerprints in flight (if any) and raise when the ranks' differ."""
        if self._work is None:
            return
        (slots, ready), ranks, mine = self._work
        self._work = None
        if ready is not None:
            ready.synchronize()  # recorded a step ago: long passed
        if bool((slots != slots[0]).any()):
            raise ValueError(differs_message(ranks, mine, _same(ranks, slots)))


def _to_host(slots: torch.Tensor) -> tuple[torch.Tensor, object]:
    """(a host copy of ``slots``, the CUDA event that marks it written, or None): a CUDA copy is
    queued on the stream into pinned memory, so the host does not wait for it now."""
    if slots.device.type != "cuda":
        return slots.cpu(), None
    host = torch.empty(slots.shape, dtype=slots.dtype, pin_memory=True)
    host.copy_(slots, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def _same(ranks: list[int], slots: torch.Tensor) -> list[list[int]]:
    """The ranks grouped by equal fingerprints."""
    groups = {}
    for rank, row in zip(ranks, slots.tolist()):
        groups.setdefault(tuple(row), []).append(rank)
    return sorted(groups.values())


def differs_message(ranks: list[int], mine: str, same: list[list[int]] | None = None) -> str:
    split = "" if same is None or len(same) < 2 else f" (ranks with the same inputs: {same})"
    return (
        f"bad inputs (nxd_hf's input check): the ranks {ranks} of one tensor-/pipeline-parallel group got different "
        f"inputs{split} (names, shapes or values; this rank has {mine}). Every rank of a tensor-parallel group, and "
        "every pipeline stage, must get the same batch: only data-parallel ranks get different ones. Sample by "
        "data-parallel rank, e.g. DistributedSampler(dataset, num_replicas=parallel_state.get_data_parallel_size(), "
        "rank=parallel_state.get_data_parallel_rank()) with the same seed on every rank")
