"""HF's fused experts under fake tensors (shape propagation while tracing and splitting).

transformers 5.x runs MoE experts through ``config._experts_implementation``; its "grouped_mm"
forward calls ``torch.nn.functional.grouped_mm``, whose CPU kernel takes fp32 but whose meta
(fake) registration accepts bf16 only. While nxd_hf propagates fake tensors, that dispatcher is
told grouped_mm is unavailable, so it takes transformers' own fallback op, which has a fake
registration of the same output shape and dtype. Real runs are untouched: the model computes
with the implementation HF chose.
"""

import contextlib

from torch._subclasses.fake_tensor import FakeTensor


@contextlib.contextmanager
def fake_safe_experts():
    """Inside the block, HF's grouped_mm experts dispatch to their fallback for fake tensors."""
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
