"""The flat layout ZeRO-1 shards: one buffer per (param group, dtype), split over DP.

The trainable parameters of one param group and dtype are laid end to end in a flat buffer of
``numel`` elements, padded with zeros to ``dp x shard_numel``. DP rank r owns the contiguous
columns ``[r x shard_numel, (r + 1) x shard_numel)``. Viewing the buffer as ``[dp, shard_numel]``,
bucket k is the column range ``[c_k, c_k+1)`` of every row: its reduce-scatter input is
``dp x (c_k+1 - c_k)`` elements (at most ``bucket_size_mb``) and each rank's output lands in its
own slice, so buckets never need the whole flat buffer in memory. Nothing here communicates.
"""

import bisect
import dataclasses
from collections.abc import Callable

import torch

from nxd_hf.parallel_layers.sharding import is_sharded


@dataclasses.dataclass(kw_only=True)
class FlatGroup:
    group_index: int  # the optimizer param group these params belong to
    params: list[torch.Tensor]  # trainable, contiguous, one dtype and device
    offsets: list[int]  # start of each param in the flat buffer
    numel: int  # real elements (without padding)
    shard_numel: int  # elements each DP rank owns: padded numel / dp
    bucket_numel: int  # shard columns per bucket
    dp_size: int
    dp_rank: int

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    @property
    def shard_start(self) -> int:
        return self.dp_rank * self.shard_numel

    def buckets(self) -> list[tuple[int, int]]:
        """Shard column ranges ``(c0, c1)``, one per reduce-scatter / all-gather."""
        return [(c, min(c + self.bucket_numel, self.shard_numel)) for c in range(0, self.shard_numel, self.bucket_numel)]

    def _overlapping(self, lo: int, hi: int):
        """(param, param-local start, param-local end, start in [lo, hi)) for params meeting [lo, hi)."""
        i = max(bisect.bisect_right(self.offsets, lo) - 1, 0)
        while i < len(self.params) and self.offsets[i] < hi:
            p, off = self.params[i], self.offsets[i]
            a, b = max(lo, off) - off, min(hi, off + p.numel()) - off
            if a < b:
                yield p, a, b, off + a - lo
            i += 1

    def read(self, lo: int, hi: int, out: torch.Tensor, source: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        """``out[:] = flat[lo:hi]`` where the flat buffer holds ``source(param)``; holes
        (padding, a ``None`` source) read as zeros."""
        filled = 0
        for p, a, b, at in self._overlapping(lo, hi):
            src = source(p)
            if src is None:
                out[at : at + b - a].zero_()
            else:
                out[at : at + b - a].copy_(src.detach().view(-1)[a:b])
            filled = at + b - a
        out[filled:].zero_()  # padding past the last param

    def write_params(self, lo: int, hi: int, src: torch.Tensor) -> None:
        """``flat[lo:hi] = src`` into the parameters (padding is dropped)."""
        for p, a, b, at in self._overlapping(lo, hi):
            p.detach().view(-1)[a:b].copy_(src[at : at + b - a])

    def norm_segments(self, tp_rank: int) -> list[tuple[int, int, float | torch.Tensor]]:
        """(start, end, weight) ranges of this rank's shard that count in the global grad norm:
        TP-replicated params only on TP rank 0, ``count_in_grad_norm=False`` never, each element
        weighted by 1 / its number of copies across TP (``num_replicas``, an int or per row)."""
        segments = []
        lo, hi = self.shard_start, self.shard_start + self.shard_numel
        for p, a, b, at in self._overlapping(lo, hi):
            if not getattr(p, "count_in_grad_norm", True) or not (is_sharded(p) or tp_rank == 0):
                continue
            replicas = getattr(p, "num_replicas", 1)
            if isinstance(replicas, torch.Tensor):  # per row along partition_dim
                rows = (torch.arange(a, b) // p.stride(p.partition_dim)) % p.shape[p.partition_dim]
                weight = 1.0 / replicas.to(torch.float32)[rows].to(p.device)
            else:
                weight = 1.0 / replicas
            start = at
            last = segments[-1] if segments else None
            if last and isinstance(weight, float) and isinstance(last[2], float) and last[2] == weight and last[1] == start:
                segments[-1] = (last[0], start + b - a, weight)  # merge runs of equal weight
            else:
                segments.append((start, start + b - a, weight))
        return segments


def build_flat_groups(param_groups: list[dict], *, dp_size: int, dp_rank: int, bucket_size_mb: float) -> list[FlatGroup]:
    """One ``FlatGroup`` per (param group, dtype) with trainable params, in group order."""
    flat_groups = []
    for index, group in enumerate(param_groups):
        by_dtype: dict[tuple, list[torch.Tensor]] = {}
        for p in group["params"]:
            if not p.requires_grad:
                continue
            if not p.is_contiguous():
                raise ValueError("NeuronZero1Optimizer needs contiguous parameters; call .contiguous() on the model's weights")
            by_dtype.setdefault((p.dtype, p.device), []).append(p)
        for params in by_dtype.values():
            offsets = [0]
            for p in params[:-1]:
                offsets.append(offsets[-1] + p.numel())
            numel = offsets[-1] + params[-1].numel()
            if numel == 0:
                continue
            shard_numel = -(-numel // dp_size)
            element_size = params[0].element_size()
            bucket_numel = max(1, int(bucket_size_mb * 1024 * 1024) // (dp_size * element_size))
            flat_groups.append(FlatGroup(
                group_index=index, params=params, offsets=offsets, numel=numel, shard_numel=shard_numel,
                bucket_numel=min(bucket_numel, shard_numel), dp_size=dp_size, dp_rank=dp_rank,
            ))
    return flat_groups
