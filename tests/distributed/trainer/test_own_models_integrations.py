"""Models that are not Hugging Face's (``own_models``) beyond ``test_config_api_own_models.py``:
a plain PyTorch decoder at tp=2 x pp=2 through the config API (its layout derived inside each
transformer layer); NxDTrainer at pp=2, dp=2, with LoRA and ``evaluate``; NxD's Lightning classes;
each against one process on the same weights and data."""

import warnings

from test_config_api_own_models import check_trains_like_one_process


def test_plain_decoder_tp2_pp2_trains_like_one_process(ranks4):
    """Used to be refused ("derives a plain module's tensor-parallel layout for the whole module only")."""
    results = ranks4.run(check_trains_like_one_process, parallel=False, tp=2, pp=2)
    kinds = {k: v for r in results for k, v in r["kinds"].items()}
    assert kinds == {"embed": "Embedding", "head": "Linear", "layers.0.q": "ColumnParallelLinear",
                     "layers.0.o": "RowParallelLinear", "layers.0.down": "RowParallelLinear"}, kinds
    assert any("['embed', 'head'] outside them stay replicated" in w for w in results[0]["warnings"]), results[0]
