"""The fused loss: cross-entropy from the hidden states in chunks, the LM head
fused in, equal to F.cross_entropy of the full logits at tp=1 and vocab-parallel at tp=2."""

import itertools

import pytest

import fused_loss_cases

FUNCTION = list(itertools.product([1, 2], [0.0, 0.1], ["mean", "sum"], [3, 64]))


@pytest.mark.parametrize("tp, smoothing, reduction, chunk", FUNCTION,
                         ids=[f"tp{t}-smooth{s}-{r}-chunk{c}" for t, s, r, c in FUNCTION])
def test_fused_linear_cross_entropy_equals_torch(ranks2, tp, smoothing, reduction, chunk):
    ranks2.run(fused_loss_cases.check_function, smoothing, reduction, chunk, model_parallel=(tp, 1))


MODEL = [(1, False, False, False), (2, False, True, False), (2, True, False, True), (1, False, True, True)]


@pytest.mark.parametrize("tp, sp, num_items, gather_logits", MODEL,
                         ids=[f"tp{t}-sp{s}-num_items{n}-gather{g}" for t, s, n, g in MODEL])
def test_parallelize_fused_loss_matches_hf(ranks2, tp, sp, num_items, gather_logits):
    ranks2.run(fused_loss_cases.check_model, tp, sp, num_items, gather_logits)


def test_nxd_trainer_fused_loss_tp2(ranks2, tmp_path):
    ranks2.run(fused_loss_cases.check_trainer, str(tmp_path))


def test_fused_loss_refused_where_it_cannot_apply(ranks2):
    ranks2.run(fused_loss_cases.check_refusals)
