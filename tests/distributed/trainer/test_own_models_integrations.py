"""Models that are not Hugging Face's (``own_models``) beyond ``test_config_api_own_models.py``:
a plain PyTorch decoder at tp=2 x pp=2 through the config API (its layout derived inside each
transformer layer); NxDTrainer at pp=2, dp=2, with LoRA and ``evaluate``; NxD's Lightning classes;
each against one process on the same weights and data."""

import contextlib
import io
import os
import warnings

import pytest
import pytorch_lightning as pl
import torch

import nxd_hf
import test_lightning as lt
from nxd_hf import backend, parallel_state
from nxd_hf.lightning import NeuronLTModule, NxDStrategy
from support import own_models
from test_config_api_own_models import _dummy, check_trains_like_one_process


def test_plain_decoder_tp2_pp2_trains_like_one_process(ranks4):
    """Used to be refused ("derives a plain module's tensor-parallel layout for the whole module only")."""
    results = ranks4.run(check_trains_like_one_process, parallel=False, tp=2, pp=2)
    kinds = {k: v for r in results for k, v in r["kinds"].items()}
    assert kinds == {"embed": "Embedding", "head": "Linear", "layers.0.q": "ColumnParallelLinear",
                     "layers.0.o": "RowParallelLinear", "layers.0.down": "RowParallelLinear"}, kinds
    assert any("['embed', 'head'] outside them stay replicated" in w for w in results[0]["warnings"]), results[0]


class PlainOwnModule(pl.LightningModule):
    """Plain Lightning on the plain decoder (its forward returns the loss): the reference."""

    def __init__(self):
        super().__init__()
        self.model = own_models.reference()

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch)
        self.log("loss", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch), on_step=False, on_epoch=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.model.parameters(), **lt.OPT)
        return [optimizer], [{"scheduler": lt.scheduler(optimizer), "interval": "step"}]


def _own_loaders(dp: int):
    """test_lightning.loaders' batches and order, of the decoder's inputs (``input_ids``, ``labels``)."""
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, own_models.VOCAB, (lt.N_TRAIN + 8, lt.SEQ), generator=g)
    data = [{"input_ids": row, "labels": row.clone()} for row in rows]
    order = torch.utils.data.DistributedSampler(data[:lt.N_TRAIN], num_replicas=1, rank=0, shuffle=True,
                                                seed=0) if dp == 0 else None
    per_replica = lt.GLOBAL_BATCH // max(dp, 1)
    return (torch.utils.data.DataLoader(data[:lt.N_TRAIN], batch_size=per_replica, sampler=order),
            torch.utils.data.DataLoader(data[lt.N_TRAIN:], batch_size=per_replica))


def check_lightning_own_model(out: str, parallel: bool, tp=1, pp=1, zero1=False) -> None:
    """NeuronLTModule + NxDStrategy on the decoder built from parallel layers or plain (8 steps:
    AdamW, LinearLR, clipping at 1.0; 2 validations) against plain Lightning in one process:
    every logged loss, the validation losses, the final weights."""
    out = lt._shared(out)
    ref_trainer, ref_losses = lt._trainer(os.path.join(out, f"ref{backend.rank()}"), epochs=lt.EPOCHS,
                                          gradient_clip_val=1.0)
    reference = PlainOwnModule()
    with contextlib.redirect_stdout(io.StringIO()):
        ref_trainer.fit(reference, *_own_loaders(0))
    parallel_state.destroy_model_parallel()
    config = nxd_hf.neuronx_distributed_config(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, pipeline_config=own_models.PIPELINE if pp > 1 else None,
        optimizer_config={"zero_one_enabled": zero1, "grad_clipping": True, "max_grad_norm": 1.0},
        dummy_forward_args=_dummy() if tp > 1 and not parallel else None)
    module = NeuronLTModule(own_models.build, config, torch.optim.AdamW, lt.scheduler, model_args=(parallel,),
                            opt_kwargs=lt.OPT)
    trainer, losses = lt._trainer(os.path.join(out, "nxd"), NxDStrategy(config), lt.EPOCHS)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore", UserWarning)  # the derived layout's replicated head
        trainer.fit(module, *_own_loaders(parallel_state.get_data_parallel_size()))
    lt._check_run(losses, ref_losses, trainer.lightning_module.model, reference.model.state_dict())


LIGHTNING_CASES = {  # world 2
    "parallel_layers_tp2": dict(parallel=True, tp=2),
    "plain_tp2": dict(parallel=False, tp=2),
    "plain_pp2": dict(parallel=False, pp=2),
}


@pytest.mark.parametrize("case", list(LIGHTNING_CASES))
def test_lightning_own_model_matches_plain_lightning(ranks2, tmp_path, case):
    ranks2.run(check_lightning_own_model, str(tmp_path), **LIGHTNING_CASES[case])
