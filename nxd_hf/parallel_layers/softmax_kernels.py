"""The fused loss's softmax in two Triton kernels per chunk of logits, as Liger's cross-entropy
does it but vocab-parallel: one pass reads each row for its max and sum of exponentials (online,
in fp32), the TP group all-reduces those per-token numbers, a second pass reads the row again and
writes ``d loss / d logits`` over it in place, in the logits' dtype. Each logit is read twice and
written once in its own dtype, where torch's eager ops (``loss_functions.vocab_parallel_softmax``
and ``grad_of_logits``) pass over an fp32 copy of the chunk about five times.

Used on CUDA tensors when Triton is installed (it comes with torch's CUDA builds). Triton's own
``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors, in its interpreter: that is how the
tests check them on a machine without a GPU. Each launch is a torch custom op, so that
``torch.compile`` keeps it as one opaque call instead of tracing into it.
"""

import functools
import importlib.util
import os

import torch

from nxd_hf import backend, parallel_state
from nxd_hf.parallel_layers.loss_functions import local_columns, soft_capped

TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
_MAX_BLOCK = 32768  # columns per step of a row, as Liger's cross-entropy (32 warps hold it in registers)


def usable(device: torch.device, kernel: str) -> bool:
    """Whether ``kernel`` ("auto", "triton" or "torch") means these kernels on ``device``;
    a ValueError where "triton" cannot run."""
    if kernel not in ("auto", "triton", "torch"):
        raise ValueError(f"kernel must be 'auto', 'triton' or 'torch', not {kernel!r}")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if kernel == "triton" and not (TRITON_INSTALLED and (device.type == "cuda" or interpreted)):
        raise ValueError(f"kernel='triton' needs Triton installed (it is {'' if TRITON_INSTALLED else 'not '}here) and a "
                         f"CUDA tensor (this one is on {device.type}; TRITON_INTERPRET=1 runs the kernels on CPU "
                         "tensors in Triton's interpreter): use kernel='torch'")
    return kernel == "triton" or (kernel == "auto" and TRITON_INSTALLED and device.type == "cuda")


@functools.cache
def _kernels():
    """The two kernels, built on first use (importing Triton is slow, and ``TRITON_INTERPRET`` is
    read when a kernel is defined)."""
    import triton
    import triton.language as tl

    @triton.jit
    def row_stats(logits, stride, num_real, softcap, row_max, row_sum_exp, row_sum, WITH_SUM: tl.constexpr,
                  SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        start_of_row = logits + row * stride
        m = float("-inf")
        s = 0.0
        total = 0.0
        for start in range(0, num_real, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(start_of_row + cols, mask=cols < num_real, other=float("-inf")).to(tl.float32)
            if SOFTCAP:
                x = tl.where(cols < num_real, softcap * (2.0 * tl.sigmoid(2.0 * x / softcap) - 1.0), float("-inf"))
            m_new = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
            if WITH_SUM:
                total += tl.sum(tl.where(cols < num_real, x, 0.0), 0)
        tl.store(row_max + row, m)
        tl.store(row_sum_exp + row, s)
        if WITH_SUM:
            tl.store(row_sum + row, total)

    @triton.jit
    def grad_in_place(logits, stride, num_cols, num_real, label, row_max, row_sum_exp, row_scale,
                      target_weight, uniform_weight, softcap, SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        start_of_row = logits + row * stride
        m = tl.load(row_max + row)
        scale = tl.load(row_scale + row)
        inv = scale / tl.load(row_sum_exp + row)
        y = tl.load(label + row)
        for start in range(0, num_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(start_of_row + cols, mask=cols < num_cols, other=0.0)
            z = x.to(tl.float32)
            if SOFTCAP:  # z = c tanh(x / c), d z / d x = 1 - tanh^2 (inline: Triton finds no jit helper in a closure)
                t = 2.0 * tl.sigmoid(2.0 * z / softcap) - 1.0
                z = softcap * t
            g = tl.exp(z - m) * inv - scale * uniform_weight
            g = tl.where(cols == y, g - scale * target_weight, g)
            if SOFTCAP:
                g = g * (1.0 - t * t)
            g = tl.where(cols < num_real, g, 0.0)
            tl.store(start_of_row + cols, g.to(x.dtype), mask=cols < num_cols)

    return row_stats, grad_in_place


def _launch_shape(num_cols: int) -> dict:
    import triton

    block = min(_MAX_BLOCK, triton.next_power_of_2(num_cols))
    return {"BLOCK": block, "num_warps": 32 if block >= _MAX_BLOCK else max(4, block // 1024)}


@torch.library.custom_op("nxd_hf::logit_row_stats", mutates_args=())
def logit_row_stats(logits: torch.Tensor, num_real: int, with_sum: bool, softcap: float) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of ``logits [rows, cols]`` over its first ``num_real`` columns (at least one), of
    ``z = x`` or, with ``softcap`` (0: none), ``z = softcap * tanh(x / softcap)``: the max, the sum
    of ``exp(z - max)`` and (``with_sum``) the sum of ``z``, in fp32."""
    rows = logits.shape[0]
    row_max, row_sum_exp, row_sum = (torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3))
    if rows:
        row_stats, _ = _kernels()
        row_stats[(rows,)](logits, logits.stride(0), num_real, softcap, row_max, row_sum_exp, row_sum,
                           WITH_SUM=with_sum, SOFTCAP=bool(softcap), **_launch_shape(num_real))
    return row_max, row_sum_exp, row_sum if with_sum else row_sum.zero_()


@logit_row_stats.register_fake
def _(logits, num_real, with_sum, softcap):
    return tuple(logits.new_empty(logits.shape[0], dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("nxd_hf::softmax_grad_", mutates_args=("logits",))
def softmax_grad_(logits: torch.Tensor, label: torch.Tensor, row_max: torch.Tensor, row_sum_exp: torch.Tensor,
                  row_scale: torch.Tensor, num_real: int, target_weight: float, uniform_weight: float,
                  softcap: float) -> None:
    """Overwrite ``logits [rows, cols]`` with ``scale * (exp(z - max) / sum_exp - target_weight *
    onehot(label) - uniform_weight) * dz/dx`` per row over the first ``num_real`` columns, zero
    after them (``label`` -1: no column of this rank); ``z`` as ``logit_row_stats``'s."""
    if logits.shape[0]:
        _, grad_in_place = _kernels()
        grad_in_place[(logits.shape[0],)](logits, logits.stride(0), logits.shape[1], num_real, label, row_max,
                                          row_sum_exp, row_scale, target_weight, uniform_weight, softcap,
                                          SOFTCAP=bool(softcap), **_launch_shape(logits.shape[1]))


@softmax_grad_.register_fake
def _(logits, label, row_max, row_sum_exp, row_scale, num_real, target_weight, uniform_weight, softcap):
    return None


def loss_and_grad_in_place(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float, ignore_index: int,
                           vocab_size: int, softcap: float = 0.0) -> torch.Tensor:
    """The per-token vocab-parallel cross-entropy of ``logits [rows, V/tp]`` (contiguous rows)
    against ``labels [rows]``, as ``loss_functions.vocab_parallel_softmax`` computes it (fp32, a
    max and the stacked sums all-reduced on the TP group), with ``logits`` overwritten by the
    gradient of the summed loss (0 at ignored tokens and padded columns). ``softcap`` (0: none):
    the loss of ``softcap * tanh(logits / softcap)``, its gradient with respect to ``logits``."""
    assert logits.dim() == 2 and logits.stride(1) == 1, "rows of contiguous logits"
    group = parallel_state.get_tensor_model_parallel_group()
    num_real, ignored, owned, safe_label = local_columns(logits, labels, vocab_size, ignore_index)
    target = soft_capped(logits.gather(-1, safe_label.unsqueeze(-1)).squeeze(-1), softcap).float()
    target = target.masked_fill(~owned, 0.0)
    if num_real:
        row_max, sum_exp, row_sum = logit_row_stats(logits, num_real, bool(label_smoothing), softcap)
    else:
        row_max = torch.full_like(target, float("-inf"))
        sum_exp, row_sum = torch.zeros_like(target), torch.zeros_like(target)
    z_max = row_max.clone()
    backend.all_reduce(z_max, group, op="max")
    rescaled = sum_exp * (row_max - z_max).exp() if num_real else sum_exp
    sums = torch.stack([rescaled, target, row_sum] if label_smoothing else [rescaled, target])
    backend.all_reduce(sums, group)

    loss = sums[0].log() - (1.0 - label_smoothing) * (sums[1] - z_max)
    if label_smoothing:
        loss = loss - label_smoothing * (sums[2] / vocab_size - z_max)
    loss = loss.masked_fill(ignored, 0.0)
    softmax_grad_(logits, safe_label.masked_fill(~owned, -1), z_max, sums[0], (~ignored).float(), num_real,
                  1.0 - label_smoothing, label_smoothing / vocab_size, softcap)
    return loss
