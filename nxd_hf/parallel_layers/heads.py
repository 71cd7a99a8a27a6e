"""Attention-head layout over tensor parallelism: the one place that decides which query and
K/V rows each rank holds, used by ``GQAQKVColumnParallelLinear``, the HF plans (``nxd_hf.tp``)
and ``pad_model``. Everything takes the head counts and ``head_dim`` of one attention layer,
so layers of one model may differ.

Layout, for ``num_heads`` query heads and ``num_kv_heads`` K/V heads of ``head_dim``:

- K and V are replicated ``kv_size_multiplier`` (m) times, each head copied m times in a row
  (``k0 k0 k1 k1`` for m = 2), then sharded contiguously: rank i holds ``num_kv_heads * m / tp``
  copies. Unlike NxD, which tiles the copies, this keeps Q contiguously sharded: the copies on
  rank i are exactly the K/V heads its query heads read (HF's ``repeat_kv`` works locally).
- Q is sharded contiguously by heads. When ``tp`` does not divide ``num_heads``, each K/V group
  of query heads is padded with zero heads up to a multiple of m.
- Multi-head attention (``num_kv_heads == num_heads``, m = 1) pads Q, K and V alike with zero
  heads at the end (NxD's ``pad_model``).
"""

import dataclasses

import torch


def gqa_layout(num_heads: int, num_kv_heads: int, head_dim: int, kv_size_multiplier: int, tp_rank: int, tp_size: int):
    """(q_rows, kv_rows, padded_num_heads) for one rank: the logical Q and K/V row of each local
    row, -1 for a padded row. Pure; unit-tested."""
    m = kv_size_multiplier
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if num_kv_heads == num_heads and m == 1:  # MHA: pad every projection with zero heads
        padded_num_heads = -(-num_heads // tp_size) * tp_size
        rows = padded_head_rows(num_heads, padded_num_heads, head_dim, tp_size)[tp_rank]
        return rows, rows, padded_num_heads
    if (num_kv_heads * m) % tp_size != 0:
        fits = next(k for k in range(1, tp_size + 1) if (num_kv_heads * k) % tp_size == 0)
        raise ValueError(
            f"num_kv_heads ({num_kv_heads}) x kv_size_multiplier ({m}) must be divisible by the tensor "
            f"parallel size ({tp_size}); use kv_size_multiplier={fits} (or a multiple of it)"
        )
    _check_replication(num_kv_heads, m, tp_size)
    group = num_heads // num_kv_heads
    padded_group = -(-group // m) * m
    padded_num_heads = num_kv_heads * padded_group
    q_local, kv_local = padded_num_heads // tp_size, num_kv_heads * m // tp_size
    slots = torch.arange(tp_rank * q_local, (tp_rank + 1) * q_local)
    in_group = slots % padded_group
    q_heads = torch.where(in_group < group, slots // padded_group * group + in_group, -1)
    kv_heads = torch.arange(tp_rank * kv_local, (tp_rank + 1) * kv_local) // m
    return _head_rows(q_heads, head_dim), _head_rows(kv_heads, head_dim), padded_num_heads


def _check_replication(num_kv_heads: int, m: int, tp_size: int) -> None:
    """A K/V replication factor gives every rank whole copies that its query heads read: m
    divides tp (each head's m copies on m ranks), or is a multiple of it (NxD's modules take
    kv_size_multiplier=tp-multiples: each rank then holds m/tp copies of the same heads). Others
    (3 at tp=2) leave a rank with a mix its query heads cannot be matched to without padding."""
    if tp_size % m and m % tp_size:
        valid = [k for k in range(1, tp_size + 1) if tp_size % k == 0 and (num_kv_heads * k) % tp_size == 0]
        raise ValueError(
            f"kv_size_multiplier={m} is not a valid K/V replication factor for num_kv_heads={num_kv_heads} and "
            f"tensor_parallel_size={tp_size}: it must divide tensor_parallel_size or be a multiple of it, with "
            f"num_kv_heads x kv_size_multiplier a multiple of tensor_parallel_size. Use one of {valid} (or "
            f"'auto': {valid[0]})")


def _head_rows(heads: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The rows of ``heads`` (-1: a padding head, whose rows are -1)."""
    d = torch.arange(head_dim)
    return torch.where(heads[:, None] >= 0, heads[:, None] * head_dim + d, -1).reshape(-1)


def auto_kv_size_multiplier(num_heads: int, num_kv_heads: int, tp_size: int) -> int:
    """The smallest K/V replication that fits ``tp_size`` (1 for multi-head attention, which
    pads its heads instead)."""
    if num_heads == num_kv_heads:
        return 1
    return next(k for k in range(1, tp_size + 1) if (num_kv_heads * k) % tp_size == 0)


def padded_head_rows(num_heads: int, num_padded_heads: int, head_dim: int, tp_size: int) -> list[torch.Tensor]:
    """Every rank's rows of a projection of ``num_heads`` real heads followed by zero heads up to
    ``num_padded_heads``, sharded contiguously over ``tp_size`` ranks."""
    assert num_padded_heads % tp_size == 0 and num_padded_heads >= num_heads
    local = num_padded_heads // tp_size
    heads = torch.arange(num_padded_heads).view(tp_size, local)
    return [_head_rows(torch.where(h < num_heads, h, -1), head_dim) for h in heads]


@dataclasses.dataclass(kw_only=True)
class HeadLayout:
    """Rows of this rank for every head-sharded projection of one attention layer, and its
    local head counts."""

    num_heads: int
    """Query heads of the unsharded layer."""
    num_kv_heads: int
    """K/V heads of the unsharded layer."""
    head_dim: int
    """Size of one head."""
    kv_size_multiplier: int
    """Copies of each K/V head across the TP group."""
    q_rows: torch.Tensor
    """Logical query row of each local row (-1: padding)."""
    kv_rows: torch.Tensor
    """Logical K (or V) row of each local row (-1: padding)."""
    padded_num_heads: int
    """Query heads after padding, over all ranks."""

    @property
    def local(self) -> dict[str, int]:
        num_heads = len(self.q_rows) // self.head_dim
        num_kv_heads = len(self.kv_rows) // self.head_dim
        return {
            "num_heads": num_heads, "num_kv_heads": num_kv_heads, "num_kv_groups": num_heads // num_kv_heads,
            "q_size": len(self.q_rows), "kv_size": len(self.kv_rows),
        }

    def rows(self, kind: str) -> tuple[torch.Tensor, int | torch.Tensor]:
        """(local rows, copies per row) of a projection laid out as ``kind``: "q", "kv", a
        stacked fused "qkv" ``[q; k; v]``, GPT-NeoX's per-head interleaved "qkv_per_head", or a
        query fused with its output gate per head, "q_gated"."""
        m = self.kv_size_multiplier
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if kind == "q":
            return self.q_rows, 1
        if kind == "kv":
            return self.kv_rows, m
        if kind == "qkv":
            rows = torch.cat([self.q_rows, _shift(self.kv_rows, q_size), _shift(self.kv_rows, q_size + kv_size)])
            replicas = torch.cat([torch.ones(len(self.q_rows), dtype=torch.long),
                                  torch.full((2 * len(self.kv_rows),), m)])
            return rows, (replicas if m > 1 else 1)
        if kind == "qkv_per_head":  # head h holds rows [h*3d, (h+1)*3d) = [q_h; k_h; v_h]
            assert m == 1 and self.num_heads == self.num_kv_heads
            return self._per_query_head(3), 1
        if kind == "q_gated":  # head h holds rows [h*2d, (h+1)*2d) = [q_h; gate_h] (Qwen3.5)
            return self._per_query_head(2), 1
        raise AssertionError(kind)

    def head_blocks(self, size: int) -> torch.Tensor:
        """Rows of a projection of ``size`` rows where each query head owns one contiguous block of
        ``size / num_heads`` rows, whatever its width (multi-head latent attention's ``q_b_proj``
        ``[q_nope_h; q_rope_h]``, ``kv_b_proj`` ``[k_nope_h; v_h]``, the input of its ``o_proj``)."""
        if size % self.num_heads:
            raise ValueError(f"a per-head projection of {size} rows is not a whole number of blocks for "
                             f"{self.num_heads} heads; register a hand-written patch with nxd_hf.register_patch")
        return _head_rows(self.local_heads(), size // self.num_heads)

    def local_heads(self) -> torch.Tensor:
        """The logical query head of each local head (-1: padding)."""
        heads = self.q_rows.view(-1, self.head_dim)[:, 0]
        return torch.where(heads >= 0, heads // self.head_dim, -1)

    def _per_query_head(self, width: int) -> torch.Tensor:
        """Rows of a projection holding ``width`` head-sized blocks per query head, head by head."""
        return _head_rows(self.local_heads(), width * self.head_dim)


def _shift(rows: torch.Tensor, offset: int) -> torch.Tensor:
    return torch.where(rows >= 0, rows + offset, -1)


def head_layout(num_heads: int, num_kv_heads: int, head_dim: int, tp_rank: int, tp_size: int, *,
                pad_model: bool | str = "auto", kv_size_multiplier: int | str = "auto") -> HeadLayout:
    """The layout of one attention layer for ``tp_size`` ranks; ValueError (naming what works)
    when it cannot fit."""
    if kv_size_multiplier == "auto":
        kv_size_multiplier = auto_kv_size_multiplier(num_heads, num_kv_heads, tp_size)
    if not isinstance(kv_size_multiplier, int) or isinstance(kv_size_multiplier, bool) or kv_size_multiplier < 1:
        raise ValueError(f"kv_size_multiplier must be 'auto' or a positive int, got {kv_size_multiplier!r}")
    q_rows, kv_rows, padded = gqa_layout(num_heads, num_kv_heads, head_dim, kv_size_multiplier, tp_rank, tp_size)
    if padded != num_heads and pad_model is False:
        fits = [t for t in range(1, num_heads + 1) if num_heads % t == 0 and (num_kv_heads % t == 0 or t % num_kv_heads == 0)]
        raise ValueError(
            f"{num_heads} attention heads do not divide over tensor_parallel_size={tp_size} and pad_model=False: "
            f"use pad_model='auto' (pads to {padded} heads) or a tensor_parallel_size in {fits}"
        )
    return HeadLayout(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, kv_size_multiplier=kv_size_multiplier,
        q_rows=q_rows, kv_rows=kv_rows, padded_num_heads=padded,
    )
