"""HF's fused experts under fake tensors (shape propagation while tracing and splitting).

transformers 5.x runs MoE experts through ``config._experts_implementation``; its "grouped_mm"
forward calls ``torch.nn.functional.grouped_mm``, whose CPU kernel takes fp32 but whose meta
(fake) registration accepts bf16 only. While nxd_hf propagates fake tensors, that dispatcher is
told grouped_mm is unavailable, so it takes transformers' own fallback op, which has a fake
registration of the same output shape and dtype. Real runs are untouched: the model computes
with the implementation HF chose.

Experts split over the expert-parallel group (``nxd_hf.moe.ep_dispatch``) exchange tokens by
all-to-all, which fake tensors cannot do (the split sizes are data) and which the other ranks
would have to join. On fake inputs they run their local experts on their own rows instead
(expert ids folded onto the local ones): the output has the shape, dtype and ``requires_grad``
of the real one, and no rank communicates, so tracing and per-shape stage metadata stay local.
Dense experts (Llama 4, ``nxd_hf.moe.ep_dense``) likewise run their local experts on this rank's
expert-major rows (viewed as ``E / ep`` experts of ``ep x T`` rows: the real output's shape).
"""

import contextlib

from torch._subclasses.fake_tensor import FakeTensor

from nxd_hf.moe.ep_dense import DenseExpertParallelForward
from nxd_hf.moe.ep_dispatch import ExpertParallelForward


@contextlib.contextmanager
def fake_safe_experts():
    """Inside the block, HF's grouped_mm experts dispatch to their fallback for fake tensors,
    and expert-parallel experts compute locally on them (module docstring)."""
    dispatch, exchange = ExpertParallelForward.__call__, DenseExpertParallelForward.__call__

    def local_on_fake(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        if isinstance(hidden_states, FakeTensor):
            return self.local_forward(hidden_states, top_k_index % self.num_local, top_k_weights, *args, **kwargs)
        return dispatch(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)

    def dense_local_on_fake(self, hidden_states):
        if isinstance(hidden_states, FakeTensor):
            return self.local_forward(hidden_states)
        return exchange(self, hidden_states)

    ExpertParallelForward.__call__ = local_on_fake
    DenseExpertParallelForward.__call__ = dense_local_on_fake
    try:
        with _grouped_mm_fallback():
            yield
    finally:
        ExpertParallelForward.__call__ = dispatch
        DenseExpertParallelForward.__call__ = exchange


@contextlib.contextmanager
def _grouped_mm_fallback():
    try:
        from transformers.integrations import moe
    except ImportError:  # a transformers without fused experts
        yield
        return
    original = moe._can_use_grouped_mm

    def can_use(input, weight, offs):
        if isinstance(input, FakeTensor) or isinstance(weight, FakeTensor):
            return False
        return original(input, weight, offs)

    moe._can_use_grouped_mm = can_use
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original
