"""Autograd functions for every tensor-parallel collective (Megatron's f, g and friends).

All run on the tensor-parallel group. Tensor-parallel ops split and gather the last dim
(hidden/heads); sequence-parallel ops split and gather ``SEQ_DIM`` = 1 of HF's
``[batch, seq, hidden]`` activations.
"""

import torch

from nxd_hf import backend, parallel_state

SEQ_DIM = 1


def _tp_group():
    return parallel_state.get_tensor_model_parallel_group()


def _split(x: torch.Tensor, dim: int) -> torch.Tensor:
    tp_size = parallel_state.get_tensor_model_parallel_size()
    if tp_size == 1:
        return x
    assert x.shape[dim] % tp_size == 0, (x.shape, dim, tp_size)
    chunk = x.shape[dim] // tp_size
    return x.narrow(dim, parallel_state.get_tensor_model_parallel_rank() * chunk, chunk).contiguous()


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    if parallel_state.get_tensor_model_parallel_size() == 1:
        return x
    return backend.all_reduce(x.contiguous().clone(), _tp_group())


class CopyToTensorParallelRegion(torch.autograd.Function):
    """Identity forward, all-reduce backward (Megatron's f): input enters a sharded region."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad)


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """All-reduce forward, identity backward (Megatron's g): sums partial outputs."""

    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class ScatterToTensorParallelRegion(torch.autograd.Function):
    """Split the last dim forward (keep this rank's chunk), all-gather it backward."""

    @staticmethod
    def forward(ctx, x):
        return _split(x, -1)

    @staticmethod
    def backward(ctx, grad):
        return backend.all_gather(grad, -1, _tp_group())


class GatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather the last dim forward, split it backward."""

    @staticmethod
    def forward(ctx, x):
        return backend.all_gather(x, -1, _tp_group())

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1)


class ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Split the sequence dim forward, all-gather it backward: enters the SP region."""

    @staticmethod
    def forward(ctx, x):
        return _split(x, SEQ_DIM)

    @staticmethod
    def backward(ctx, grad):
        return backend.all_gather(grad, SEQ_DIM, _tp_group())


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather the sequence dim forward; backward reduce-scatters (the input feeds a
    tensor-parallel region whose ranks each hold a partial gradient) or, with
    ``to_model_parallel=False``, just splits (the full output is used identically everywhere)."""

    @staticmethod
    def forward(ctx, x, to_model_parallel=True):
        ctx.to_model_parallel = to_model_parallel
        return backend.all_gather(x, SEQ_DIM, _tp_group())

    @staticmethod
    def backward(ctx, grad):
        if ctx.to_model_parallel:
            return backend.reduce_scatter(grad, SEQ_DIM, _tp_group()), None
        return _split(grad, SEQ_DIM), None


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce-scatter along the sequence dim forward, all-gather backward: leaves a
    tensor-parallel region into the SP region (replaces Megatron's g under SP)."""

    @staticmethod
    def forward(ctx, x):
        return backend.reduce_scatter(x, SEQ_DIM, _tp_group())

    @staticmethod
    def backward(ctx, grad):
        return backend.all_gather(grad, SEQ_DIM, _tp_group())


class SumReplicaGrads(torch.autograd.Function):
    """Identity forward. Backward (on the TP group): scatter-add each local row's gradient into
    its logical row of a ``[logical_rows, ...]`` buffer, all-reduce it, and hand every copy the
    total, so each replicated copy's gradient equals the unreplicated one."""

    @staticmethod
    def forward(ctx, weight, rows, logical_rows):
        ctx.rows, ctx.logical_rows = rows, logical_rows
        return weight

    @staticmethod
    def backward(ctx, grad):
        real = (ctx.rows >= 0).to(grad.device)
        rows = ctx.rows.clamp(min=0).to(grad.device)  # padding rows (-1) carry zero gradient
        total = grad.new_zeros((ctx.logical_rows, *grad.shape[1:])).index_add_(0, rows, grad)
        backend.all_reduce(total, parallel_state.get_tensor_model_parallel_group())
        keep = real.view(-1, *([1] * (grad.dim() - 1))).to(grad.dtype)
        return total.index_select(0, rows) * keep, None, None


def _tp_is_one() -> bool:
    return parallel_state.get_tensor_model_parallel_size() == 1


# The wrappers skip the autograd Function entirely at tp = 1 (no collective, no graph node).
def copy_to_tensor_model_parallel_region(x):
    return x if _tp_is_one() else CopyToTensorParallelRegion.apply(x)


def reduce_from_tensor_model_parallel_region(x):
    return x if _tp_is_one() else ReduceFromTensorParallelRegion.apply(x)


def scatter_to_tensor_model_parallel_region(x):
    return x if _tp_is_one() else ScatterToTensorParallelRegion.apply(x)


def gather_from_tensor_model_parallel_region(x):
    return x if _tp_is_one() else GatherFromTensorParallelRegion.apply(x)


def check_sequence_divisible(x: torch.Tensor) -> None:
    """ValueError (with the fix) when the sequence dim cannot be split over TP ranks."""
    tp_size = parallel_state.get_tensor_model_parallel_size()
    if x.shape[SEQ_DIM] % tp_size != 0:
        raise ValueError(
            f"sequence parallelism needs the sequence length ({x.shape[SEQ_DIM]}) to be a multiple "
            f"of the tensor parallel size ({tp_size}): pad every batch to a multiple of {tp_size} "
            f"in the collator (e.g. DataCollatorWithPadding(pad_to_multiple_of={tp_size}))"
        )


def scatter_to_sequence_parallel_region(x):
    check_sequence_divisible(x)
    return x if _tp_is_one() else ScatterToSequenceParallelRegion.apply(x)


def gather_from_sequence_parallel_region(x, to_model_parallel: bool = True):
    return x if _tp_is_one() else GatherFromSequenceParallelRegion.apply(x, to_model_parallel)


def reduce_scatter_to_sequence_parallel_region(x):
    return x if _tp_is_one() else ReduceScatterToSequenceParallelRegion.apply(x)
