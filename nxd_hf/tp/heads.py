"""Per-rank attention-head layout of a model: which query and K/V rows each projection holds."""

import dataclasses

import torch

from nxd_hf.modules.qkv_linear import auto_kv_size_multiplier, gqa_layout


@dataclasses.dataclass(kw_only=True)
class HeadLayout:
    """Rows of this rank for every head-sharded projection, and its local head counts."""

    num_heads: int
    """Query heads of the unsharded model."""
    num_kv_heads: int
    """K/V heads of the unsharded model."""
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
        """(local rows, copies per row) of a projection laid out as ``kind`` (see ``plan.HeadRows``)."""
        m = self.kv_size_multiplier
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if kind == "q":
            return self.q_rows, 1
        if kind == "kv":
            return self.kv_rows, m
        if kind == "qkv":
            def shift(rows, offset):
                return torch.where(rows >= 0, rows + offset, -1)

            rows = torch.cat([self.q_rows, shift(self.kv_rows, q_size), shift(self.kv_rows, q_size + kv_size)])
            replicas = torch.cat([torch.ones(len(self.q_rows), dtype=torch.long),
                                  torch.full((2 * len(self.kv_rows),), m)])
            return rows, (replicas if m > 1 else 1)
        if kind == "qkv_per_head":  # GPT-NeoX: head h holds rows [h*3d, (h+1)*3d) = [q_h; k_h; v_h]
            assert m == 1 and self.num_heads == self.num_kv_heads
            heads = self.q_rows.view(-1, self.head_dim)[:, 0]
            heads = torch.where(heads >= 0, heads // self.head_dim, -1)
            offsets = torch.arange(3 * self.head_dim)
            rows = torch.where(heads[:, None] >= 0, heads[:, None] * 3 * self.head_dim + offsets, -1)
            return rows.reshape(-1), 1
        raise AssertionError(kind)


def head_layout(num_heads: int, num_kv_heads: int, head_dim: int, tp_rank: int, tp_size: int, *,
                pad_model: bool | str = "auto", kv_size_multiplier: int | str = "auto") -> HeadLayout:
    """The layout for ``tp_size`` ranks; ValueError (naming what works) when it cannot fit."""
    if kv_size_multiplier == "auto":
        kv_size_multiplier = auto_kv_size_multiplier(num_heads, num_kv_heads, tp_size)
    if not isinstance(kv_size_multiplier, int) or kv_size_multiplier < 1:
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
