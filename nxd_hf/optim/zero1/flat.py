"""The flat layout ZeRO-1 shards: one buffer per (param group, dtype), split over DP.

The trainable parameters of one param group and dtype are laid end to end in a flat buffer of
``numel`` elements, padded with zeros to ``dp x shard_numel``; each rank's slice (its master,
``shard_numel`` elements) is cut into buckets of shard columns ``[c_k, c_k+1)`` (at most
``bucket_size_mb`` of reduce-scatter input each). Two layouts:

- interleaved (the default): parameters in backward order (reversed, those whose gradient is
  only final after backward, partial over TP, last); bucket k is the contiguous flat range
  ``[dp x c_k, dp x c_k+1)``, cut in dp equal parts, part r owned by DP rank r. A bucket's
  gradients are complete together during backward and it reduce-scatters as it lies, so the
  reduce-scatter can start while backward goes on (``optim.zero1.overlap``);
- contiguous (the layout before the overlapped reduce-scatter; still read from old ``state_dict``s): parameters in their
  order, DP rank r owns the flat range ``[r x shard_numel, (r + 1) x shard_numel)``; bucket k
  is the columns ``[c_k, c_k+1)`` of every row of the ``[dp, shard_numel]`` view.

Either way buckets never need the whole flat buffer in memory. Nothing here communicates.
"""

import bisect
import dataclasses
from collections.abc import Callable

import torch

from nxd_hf.parallel_layers.sharding import has_partial_grad_over_tp, is_sharded


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
    interleaved: bool = True
    """The layout (module docstring): interleaved (True) or contiguous (False)."""

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def buckets(self) -> list[tuple[int, int]]:
        """Shard column ranges ``(c0, c1)``, one per reduce-scatter / all-gather."""
        return [(c, min(c + self.bucket_numel, self.shard_numel)) for c in range(0, self.shard_numel, self.bucket_numel)]

    def row_start(self, rank: int, c0: int, c1: int) -> int:
        """Where DP rank ``rank``'s columns ``[c0, c1)`` of bucket ``(c0, c1)`` start in the flat buffer
        (they are ``c1 - c0`` consecutive elements)."""
        return self.dp_size * c0 + rank * (c1 - c0) if self.interleaved else rank * self.shard_numel + c0

    def bucket_range(self, c0: int, c1: int) -> tuple[int, int]:
        """The flat range of bucket ``(c0, c1)`` (interleaved layout: its reduce-scatter input as it lies)."""
        assert self.interleaved
        return self.dp_size * c0, self.dp_size * c1

    def pieces(self, rank: int | None = None) -> list[tuple[int, int, int]]:
        """``(flat start, flat end, shard start)`` of the ranges DP rank ``rank`` (default this one) owns."""
        rank = self.dp_rank if rank is None else rank
        if not self.interleaved:
            return [(rank * self.shard_numel, (rank + 1) * self.shard_numel, 0)]
        return [(self.row_start(rank, c0, c1), self.row_start(rank, c0, c1) + c1 - c0, c0) for c0, c1 in self.buckets()]

    def param_pieces(self, index: int) -> list[tuple[int, int, int]]:
        """``(start, end, shard start)``: the elements ``[start, end)`` of ``params[index]`` (flattened)
        this rank owns, at that position of its shard (master slice)."""
        offset, numel, out = self.offsets[index], self.params[index].numel(), []
        for lo, hi, at in self.pieces():
            a, b = max(lo, offset), min(hi, offset + numel)
            if a < b:
                out.append((a - offset, b - offset, at + a - lo))
        return out

    def bucket_params(self, c0: int, c1: int) -> list[int]:
        """Indices of the parameters with elements in bucket ``(c0, c1)`` on any rank."""
        if self.interleaved:
            return self._indices(*self.bucket_range(c0, c1))
        rows = [self.row_start(r, c0, c1) for r in range(self.dp_size)]
        return sorted({i for lo in rows for i in self._indices(lo, lo + c1 - c0)})

    def _indices(self, lo: int, hi: int) -> list[int]:
        """Indices of the parameters meeting the flat range ``[lo, hi)``."""
        return [i for i, (p, off) in enumerate(zip(self.params, self.offsets)) if off < hi and lo < off + p.numel()]

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
        for lo, hi, shard_at in self.pieces():
            segments += self._norm_segments(lo, hi, shard_at, tp_rank)
        return _merged(segments)

    def _norm_segments(self, lo: int, hi: int, shard_at: int, tp_rank: int) -> list:
        segments = []
        for p, a, b, at in self._overlapping(lo, hi):
            if not getattr(p, "count_in_grad_norm", True) or not (is_sharded(p) or tp_rank == 0):
                continue
            replicas = getattr(p, "num_replicas", 1)
            if isinstance(replicas, torch.Tensor):  # per row along partition_dim
                rows = (torch.arange(a, b) // p.stride(p.partition_dim)) % p.shape[p.partition_dim]
                weight = 1.0 / replicas.to(torch.float32)[rows].to(p.device)
            else:
                weight = 1.0 / replicas
            segments.append((shard_at + at, shard_at + at + b - a, weight))
        return segments


NORM_ROW = 4096


def powered_sum(values: torch.Tensor, p: float) -> torch.Tensor:
    """``sum |v|^p`` of a long 1-D slice, accurate to fp32 rounding: the p-norms of rows of
    ``NORM_ROW`` elements, then a (pairwise) sum. One ``vector_norm`` over a whole ZeRO-1 shard
    accumulates serially on CPU: ~5e-5 relative off over 1M elements, ~2e-3 over 20M, where
    transformers.Trainer norms each parameter separately and a long shard made the two disagree."""
    whole = values.numel() - values.numel() % NORM_ROW
    rows = torch.linalg.vector_norm(values[:whole].view(-1, NORM_ROW), p, dim=1)
    return rows.pow(p).sum() + torch.linalg.vector_norm(values[whole:], p).pow(p)


def _merged(segments: list) -> list:
    """Adjacent segments of one float weight merged (fewer norm pieces)."""
    out = []
    for start, end, weight in segments:
        last = out[-1] if out else None
        if last and isinstance(weight, float) and isinstance(last[2], float) and last[2] == weight and last[1] == start:
            out[-1] = (last[0], end, weight)
        else:
            out.append((start, end, weight))
    return out


def backward_order(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """About the order backward completes their gradients: reversed, those summed over TP after
    backward (``partial_grad_over_tp``) last."""
    params = list(reversed(params))
    return [p for p in params if not has_partial_grad_over_tp(p)] + [p for p in params if has_partial_grad_over_tp(p)]


def build_flat_groups(param_groups: list[dict], *, dp_size: int, dp_rank: int, bucket_size_mb: float,
                      interleaved: bool = True) -> list[FlatGroup]:
    """One ``FlatGroup`` per (param group, dtype) with trainable params, in group order;
    ``interleaved``: the layout (module docstring)."""
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
            params = backward_order(params) if interleaved else params
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
                bucket_numel=min(bucket_numel, shard_numel), dp_size=dp_size, dp_rank=dp_rank, interleaved=interleaved,
            ))
    return flat_groups
