"""parallel_cross_entropy on vocab-sharded logits equals torch's cross_entropy on the full,
unpadded logits: loss and local logit gradients, every reduction, label smoothing, ignored
labels, and a vocab the TP size does not divide (padded columns hold garbage)."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from nxd_hf import parallel_state
from nxd_hf.parallel_layers.loss_functions import parallel_cross_entropy

VOCABS = (8, 11)  # 11: padded to 12 at tp 2 and 4
REDUCTIONS = ("none", "mean", "sum")
SMOOTHINGS = (0.0, 0.1)
IGNORE_INDICES = (None, -100, 5)  # None: no ignored label; 5 is a real class used as ignore_index
NUM_CASES = len(VOCABS) * len(REDUCTIONS) * len(SMOOTHINGS) * len(IGNORE_INDICES)
TOL = dict(rtol=1e-4, atol=1e-5)


def _case_tensors(vocab: int, ignore_index: int | None, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(2, 5, vocab, generator=g)  # [b, s, V]
    labels = torch.randint(0, vocab, (2, 5), generator=g)
    labels[0, 0], labels[1, 0] = 0, vocab - 1  # first and last real column (the last sits beside padding)
    if ignore_index is not None:
        labels[0, 2] = labels[1, 3] = labels[1, 4] = ignore_index
    upstream = torch.randn(2, 5, generator=g)  # grad of a "none" loss
    return logits, labels, upstream


def _check_case(vocab, reduction, smoothing, ignore_index, seed):
    tp_size = parallel_state.get_tensor_model_parallel_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    logits, labels, upstream = _case_tensors(vocab, ignore_index, seed)
    kwargs = {} if ignore_index is None else {"ignore_index": ignore_index}
    case = (tp_size, vocab, reduction, smoothing, ignore_index)

    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, vocab), labels.view(-1), reduction=reduction,
                          label_smoothing=smoothing, **kwargs)
    ref = ref.view(labels.shape) if reduction == "none" else ref
    ref.backward(upstream if reduction == "none" else None)

    local_vocab = -(-vocab // tp_size)
    num_pad = local_vocab * tp_size - vocab
    garbage = 1e4 + 1e3 * torch.randn(2, 5, num_pad, generator=torch.Generator().manual_seed(seed + 1))
    padded = torch.cat([logits, garbage], dim=-1)
    cols = slice(tp_rank * local_vocab, (tp_rank + 1) * local_vocab)
    local = padded[..., cols].clone().requires_grad_()
    before = local.detach().clone()

    loss = parallel_cross_entropy(local, labels, label_smoothing=smoothing, reduction=reduction,
                                  vocab_size=vocab if num_pad else None, **kwargs)
    assert loss.shape == ref.shape, case
    torch.testing.assert_close(loss, ref.detach(), **TOL, msg=lambda m: f"{case}: loss {m}")
    if ignore_index is not None and reduction == "none":
        ignored = loss[labels == ignore_index]
        assert len(ignored) >= 3 and torch.equal(ignored, torch.zeros_like(ignored)), case
    loss.backward(upstream if reduction == "none" else None)

    expected_grad = torch.cat([ref_logits.grad, torch.zeros(2, 5, num_pad)], dim=-1)[..., cols]
    torch.testing.assert_close(local.grad, expected_grad, **TOL, msg=lambda m: f"{case}: grad {m}")
    is_pad = torch.arange(cols.start, cols.stop) >= vocab
    assert torch.equal(local.grad[..., is_pad], torch.zeros_like(local.grad[..., is_pad])), case
    assert torch.equal(local.detach(), before), f"{case}: input modified in place"


CASES = list(itertools.product(VOCABS, REDUCTIONS, SMOOTHINGS, IGNORE_INDICES))


def _check_all_cases() -> int:
    for seed, (vocab, reduction, smoothing, ignore_index) in enumerate(CASES):
        _check_case(vocab, reduction, smoothing, ignore_index, seed)
    return len(CASES)


@pytest.mark.parametrize("seed,vocab,reduction,smoothing,ignore_index",
                         [(seed, *case) for seed, case in enumerate(CASES)],
                         ids=[f"vocab{v}-{r}-smoothing{s}-ignore{i}" for v, r, s, i in CASES])
@pytest.mark.parametrize("tp", [1, 2, 4], ids=lambda tp: f"tp{tp}")
def test_matches_torch_cross_entropy(ranks4, tp, seed, vocab, reduction, smoothing, ignore_index):
    ranks4.run(_check_case, vocab, reduction, smoothing, ignore_index, seed, model_parallel=(tp, 1))


def test_matches_torch_cross_entropy_without_distributed():
    assert not parallel_state.model_parallel_is_initialized()
    assert _check_all_cases() == NUM_CASES


def test_padded_columns_ignored_without_distributed():
    """At tp 1, extra columns beyond vocab_size are padding too."""
    logits, labels, _ = _case_tensors(11, -100, seed=7)
    padded = torch.cat([logits, torch.full((2, 5, 1), 1e4)], dim=-1).requires_grad_()
    loss = parallel_cross_entropy(padded, labels, label_smoothing=0.1, reduction="mean", vocab_size=11)
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, 11), labels.view(-1), label_smoothing=0.1)
    torch.testing.assert_close(loss, ref.detach(), **TOL)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(padded.grad[..., :11], ref_logits.grad, **TOL)
    assert torch.equal(padded.grad[..., 11], torch.zeros(2, 5))


def test_bad_arguments_raise():
    logits, labels = torch.randn(3, 4), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="reduction"):
        parallel_cross_entropy(logits, labels, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        parallel_cross_entropy(logits, labels, label_smoothing=1.5)
    with pytest.raises(ValueError, match="vocab_size"):
        parallel_cross_entropy(logits, labels, vocab_size=5)
