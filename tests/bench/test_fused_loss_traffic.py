"""bench/fused_loss/traffic.py's model of the loss's memory traffic: both ways do the head's three
matmuls and no more, and the fused loss's elementwise traffic is below the unfused one's (it was
2.9x it with the fp32 gradient accumulated through a temporary), a quarter of it with the Triton
kernels."""

from bench.fused_loss.traffic import _count
from nxd_hf.parallel_layers import softmax_kernels


def check_traffic() -> None:
    tokens, vocab, hidden = 300, 4096, 64  # chunks of 2^27 / 4096 = 32768 tokens: one chunk
    unfused, fused = (_count(way, tokens, vocab, hidden) for way in ("unfused", "fused"))
    assert unfused.flops == fused.flops == 3 * 2 * tokens * vocab * hidden
    assert fused.bytes["elementwise"] < 0.7 * unfused.bytes["elementwise"], (fused.bytes, unfused.bytes)
    assert "aten.addmm_" in fused.by_op  # the head's gradient accumulated in place, not added from a temporary:
    assert fused.by_op["aten.add_"] < vocab * hidden, fused.by_op  # only the loss's running sum is added
    if not softmax_kernels.TRITON_INSTALLED:
        return
    kernels = _count("fused_triton", tokens, vocab, hidden)
    assert kernels.flops == unfused.flops
    # the Triton kernels: each bf16 logit read twice and overwritten once (6 bytes, and the per-token numbers)
    logits = tokens * vocab
    assert kernels.by_op["nxd_hf.logit_row_stats"] + kernels.by_op["nxd_hf.softmax_grad_"] < 6.1 * logits, kernels.by_op
    assert kernels.bytes["elementwise"] < 0.25 * unfused.bytes["elementwise"], (kernels.bytes, unfused.bytes)  # 0.18


def test_fused_loss_traffic_model(ranks2):
    ranks2.run(check_traffic, model_parallel=(1, 1))
