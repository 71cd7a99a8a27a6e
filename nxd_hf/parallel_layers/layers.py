"""Sharded ``nn.Linear`` and ``nn.Embedding`` replacements (NxD's parallel layers).

Weights are stored torch-style (``[out, in]``). With the same seed, a sharded layer's weight
and bias equal the slices of the unsharded ``nn.Linear``/``nn.Embedding`` (its default init
is used when ``init_method`` is None; NxD defaults to its own init instead). A sharded size
that the TP size does not divide is padded at the end with zero rows that never reach outputs
or gradients.
"""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nxd_hf.guards import device_checks
from nxd_hf.parallel_layers import mappings
from nxd_hf.parallel_layers.sharding import (
    contiguous_shard_index, gather_logical, gather_positions, local_rows_mask, mark_partial_grad_over_tp,
    set_tensor_model_parallel_attributes, shard_from_full, tp_coords,
)
from nxd_hf import parallel_state


def linear_init_(weight: torch.Tensor, bias: torch.Tensor | None, init_method: Callable | None) -> None:
    """``nn.Linear``'s own init when ``init_method`` is None; else ``init_method`` and zero bias."""
    if init_method is None:
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        if bias is not None:
            bound = 1 / math.sqrt(weight.shape[1]) if weight.shape[1] > 0 else 0
            nn.init.uniform_(bias, -bound, bound)
    else:
        init_method(weight)
        if bias is not None:
            bias.zero_()


def set_local_(module: nn.Module, name: str, local: torch.Tensor) -> None:
    """Write ``local`` into parameter ``name``, materializing it first if it is on meta."""
    param = getattr(module, name)
    if param.is_meta:
        new = nn.Parameter(local.to(param.dtype), requires_grad=param.requires_grad)
        new.__dict__.update(param.__dict__)  # sharding metadata
        setattr(module, name, new)
    else:
        with torch.no_grad():
            param.copy_(local)


class _WholeLayerSizes:
    """``nn.Linear``'s size names for the whole (unsharded) layer: HF code reads them (e.g. the LM
    head's ``out_features`` as the vocabulary size). The local shard's sizes are
    ``*_size_per_partition``."""

    @property
    def in_features(self) -> int:
        return self.input_size

    @property
    def out_features(self) -> int:
        return self.output_size


class ColumnParallelLinear(_WholeLayerSizes, nn.Module):
    """``Y = XA + b`` with ``A = [A_1 ... A_p]`` split by output columns; rank i computes
    ``Y_i = X A_i + b_i``. Forward: copy (or, under SP, all-gather the sequence) of X, then
    optionally all-gather of Y. A custom ``shard_index`` (e.g. an attention head layout) may
    hold rows on several ranks; ``num_replicas`` > 1 then sums their gradients in backward.
    ``skip_input_collective``: the caller already copied X into the tensor-parallel region (or
    gathered its sequence) once for several layers, as ``nxd_hf.tp`` does for HF modules."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = True,
        sequence_parallel_enabled: bool = False, dtype: torch.dtype = torch.float32, device=None,
        init_method: Callable | None = None, stride: int = 1, *, shard_index: torch.Tensor | None = None,
        num_replicas: int = 1, skip_input_collective: bool = False,
    ):
        super().__init__()
        if gather_output and shard_index is not None:
            raise ValueError("ColumnParallelLinear: a custom shard_index needs gather_output=False")
        self.input_size, self.output_size = input_size, output_size
        self.gather_output, self.sequence_parallel_enabled = gather_output, sequence_parallel_enabled
        self.init_method, self.stride, self.num_replicas = init_method, stride, num_replicas
        self._has_replicas = bool((torch.as_tensor(num_replicas) > 1).any())  # int, or per row
        self.skip_input_collective = skip_input_collective
        tp_rank, tp_size = tp_coords()
        self._gather_positions = None  # a plain contiguous gather is in logical order up to trailing padding
        if shard_index is None:
            shard_index = contiguous_shard_index(output_size, tp_rank, tp_size, stride)
            if stride > 1 and gather_output:
                all_indices = [contiguous_shard_index(output_size, r, tp_size, stride) for r in range(tp_size)]
                self._gather_positions = gather_positions(all_indices, output_size)
        self.output_size_per_partition = len(shard_index)
        self.weight = nn.Parameter(torch.empty(len(shard_index), input_size, dtype=dtype, device=device))
        attrs = dict(partition_dim=0, logical_size=output_size, shard_index=shard_index, stride=stride,
                     num_replicas=num_replicas)
        set_tensor_model_parallel_attributes(self.weight, **attrs)
        if bias:
            self.bias = nn.Parameter(torch.empty(len(shard_index), dtype=dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, **attrs)
        else:
            self.register_parameter("bias", None)
        if not self.weight.is_meta:
            self.init_weight_cpu()

    def init_weight_cpu(self) -> None:
        """(Re-)initialize as the slice of an unsharded layer initialized on CPU."""
        full_weight = torch.empty(self.output_size, self.input_size)
        full_bias = torch.empty(self.output_size) if self.bias is not None else None
        linear_init_(full_weight, full_bias, self.init_method)
        set_local_(self, "weight", shard_from_full(full_weight, 0, self.weight.shard_index))
        if full_bias is not None:
            set_local_(self, "bias", shard_from_full(full_bias, 0, self.bias.shard_index))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_from_region(self.forward_local(self.input_to_region(x)))

    def input_to_region(self, x: torch.Tensor) -> torch.Tensor:
        """X as every TP rank's local matmul sees it (replicated, full sequence)."""
        if self.skip_input_collective:
            return x  # the caller entered the tensor-parallel region once for several layers
        if self.sequence_parallel_enabled:
            return mappings.gather_from_sequence_parallel_region(x, to_model_parallel=True)  # [b, s, in]
        return mappings.copy_to_tensor_model_parallel_region(x)

    def forward_local(self, x: torch.Tensor) -> torch.Tensor:
        """``X A_i + b_i`` on this rank's rows: [b, s, in] -> [b, s, out/tp]."""
        weight, bias = self.weight, self.bias
        # rows held by several ranks (replicated K/V; per row for a fused [q; k; v]): sum their grads
        if self._has_replicas:
            rows, size = self.weight.shard_index, self.output_size
            weight = mappings.SumReplicaGrads.apply(weight, rows, size)
            bias = None if bias is None else mappings.SumReplicaGrads.apply(bias, rows, size)
        return F.linear(x, weight, bias)

    def output_from_region(self, y: torch.Tensor) -> torch.Tensor:
        """The local output, or with ``gather_output`` the full one in logical order."""
        if not self.gather_output:
            return y
        return gather_logical(y, self._gather_positions, self.output_size)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, local_out={self.output_size_per_partition}"


class RowParallelLinear(_WholeLayerSizes, nn.Module):
    """``Y = XA + b`` with ``A = [A_1; ...; A_p]`` split by input rows and ``X = [X_1 ... X_p]``:
    ``Y = sum_i X_i A_i + b``. Forward: all-reduce of the partial sums (reduce-scatter along the
    sequence under SP); ``b`` is replicated and added after the reduction."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = False,
        sequence_parallel_enabled: bool = False, dtype: torch.dtype = torch.float32, device=None,
        init_method: Callable | None = None, stride: int = 1, *, shard_index: torch.Tensor | None = None,
    ):
        super().__init__()
        device = device or None  # NxD documents device=False as this layer's default
        if sequence_parallel_enabled and not input_is_parallel:
            raise ValueError("RowParallelLinear with sequence_parallel_enabled=True needs input_is_parallel=True")
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel, self.sequence_parallel_enabled = input_is_parallel, sequence_parallel_enabled
        self.init_method, self.stride = init_method, stride
        tp_rank, tp_size = tp_coords()
        if shard_index is None:
            shard_index = contiguous_shard_index(input_size, tp_rank, tp_size, stride)
        elif not input_is_parallel:
            raise ValueError("RowParallelLinear: a custom shard_index needs input_is_parallel=True")
        self.input_size_per_partition = len(shard_index)
        self.weight = nn.Parameter(torch.empty(output_size, len(shard_index), dtype=dtype, device=device))
        set_tensor_model_parallel_attributes(
            self.weight, partition_dim=1, logical_size=input_size, shard_index=shard_index, stride=stride
        )
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype, device=device))
            mark_partial_grad_over_tp(self.bias, sequence_parallel_enabled)
        else:
            self.register_parameter("bias", None)
        self.set_input_padding(shard_index)
        if not self.weight.is_meta:
            self.init_weight_cpu()

    def set_input_padding(self, shard_index: torch.Tensor) -> None:
        """Zero the local input columns that are padding, so their weight columns get no grad."""
        keep = local_rows_mask(shard_index)
        self.register_buffer("input_keep_mask", None if keep is None else keep.float(), persistent=False)

    def init_weight_cpu(self) -> None:
        """(Re-)initialize as the slice of an unsharded layer initialized on CPU."""
        full_weight = torch.empty(self.output_size, self.input_size)
        full_bias = torch.empty(self.output_size) if self.bias is not None else None
        linear_init_(full_weight, full_bias, self.init_method)
        set_local_(self, "weight", shard_from_full(full_weight, 1, self.weight.shard_index))
        if full_bias is not None:
            set_local_(self, "bias", full_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce_partial(F.linear(self.local_input(x), self.weight))  # partial sum [b, s, out]

    def local_input(self, x: torch.Tensor) -> torch.Tensor:
        """``X_i``: this rank's input columns, padding columns zeroed."""
        if not self.input_is_parallel:
            tp_size = parallel_state.get_tensor_model_parallel_size()
            padded = self.input_size_per_partition * tp_size
            x = F.pad(x, (0, padded - x.shape[-1])) if padded != x.shape[-1] else x
            x = mappings.scatter_to_tensor_model_parallel_region(x)
        if self.input_keep_mask is not None:
            x = x * self.input_keep_mask.to(device=x.device, dtype=x.dtype)
        return x

    def reduce_partial(self, y: torch.Tensor) -> torch.Tensor:
        """Sum the partial outputs over TP (reduce-scatter along the sequence under SP), add b."""
        if self.sequence_parallel_enabled:
            mappings.check_sequence_divisible(y)
            y = mappings.reduce_scatter_to_sequence_parallel_region(y)  # [b, s/tp, out]
        else:
            y = mappings.reduce_from_tensor_model_parallel_region(y)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, local_in={self.input_size_per_partition}"


class ParallelEmbedding(nn.Module):
    """Embedding table ``E = [E_1; ...; E_p]`` split over the vocab (padded to a multiple of
    the TP size). Rank i looks up the ids it owns, zeros elsewhere; the partial lookups are
    summed by an all-reduce, or reduce-scattered along the sequence under SP. ``check_ids``
    (default True; ``parallelize(check_inputs=False)`` clears it): every forward checks on the
    device that the ids are in ``[0, num_embeddings)`` (``nxd_hf.guards.device_checks``); an id
    outside would match no rank's rows and embed as zeros."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
        init_method: Callable = nn.init.normal_, dtype: torch.dtype = torch.float32, device=None,
        sequence_parallel_enabled: bool = False,
    ):
        super().__init__()
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.init_method, self.sequence_parallel_enabled = init_method, sequence_parallel_enabled
        self.check_ids = True
        tp_rank, tp_size = tp_coords()
        shard_index = contiguous_shard_index(num_embeddings, tp_rank, tp_size)
        self.num_embeddings_per_partition = len(shard_index)
        self.vocab_start_index = tp_rank * len(shard_index)
        self.weight = nn.Parameter(torch.empty(len(shard_index), embedding_dim, dtype=dtype, device=device))
        set_tensor_model_parallel_attributes(
            self.weight, partition_dim=0, logical_size=num_embeddings, shard_index=shard_index
        )
        local_pad = None if padding_idx is None else padding_idx - self.vocab_start_index
        self.local_padding_idx = local_pad if local_pad is not None and 0 <= local_pad < len(shard_index) else None
        if not self.weight.is_meta:
            self.init_weight_cpu()

    def init_weight_cpu(self) -> None:
        """(Re-)initialize as the slice of an unsharded ``nn.Embedding`` initialized on CPU."""
        full = torch.empty(self.num_embeddings, self.embedding_dim)
        self.init_method(full)
        if self.padding_idx is not None:
            full[self.padding_idx].zero_()
        set_local_(self, "weight", shard_from_full(full, 0, self.weight.shard_index))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        start, local = self.vocab_start_index, self.num_embeddings_per_partition
        if local == self.num_embeddings and not self.sequence_parallel_enabled:  # one rank holds it all (tp=1)
            return F.embedding(input_ids, self.weight, self.local_padding_idx)
        if self.check_ids:
            device_checks.check_ids(input_ids, self.num_embeddings)
        outside = (input_ids < start) | (input_ids >= start + local)
        local_ids = (input_ids - start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, self.local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # [b, s, h], partial
        if self.sequence_parallel_enabled:
            mappings.check_sequence_divisible(out)
            return mappings.reduce_scatter_to_sequence_parallel_region(out)
        return mappings.reduce_from_tensor_model_parallel_region(out)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, local={self.num_embeddings_per_partition}"
