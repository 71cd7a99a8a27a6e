"""Models that are not Hugging Face's (``own_models``) beyond ``test_config_api_own_models.py``:
a plain PyTorch decoder at tp=2 x pp=2 through the config API (its layout derived inside each
transformer layer); NxDTrainer at pp=2, dp=2, with LoRA and ``evaluate``; NxD's Lightning classes;
each against one process on the same weights and data."""

import contextlib
import io
import os
import warnings

import peft
import pytest
import pytorch_lightning as pl
import torch
import transformers

import nxd_hf
import test_config_api_own_models as own_api
import test_lightning as lt
from nxd_hf import backend, parallel_state
from nxd_hf.lightning import NeuronLTModule, NxDStrategy
from nxd_hf.parallel_layers.sharding import full_tensor, local_shard
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
    accumulating = NeuronLTModule(own_models.build, config, torch.optim.AdamW, model_args=(parallel,), grad_accum_steps=2)
    with pytest.raises(ValueError, match="computes its own loss: its micro-batches' gradients would add up"):
        accumulating.configure_model()


LIGHTNING_CASES = {  # world 2
    "parallel_layers_tp2": dict(parallel=True, tp=2),
    "plain_tp2": dict(parallel=False, tp=2),
    "plain_pp2": dict(parallel=False, pp=2),
}


@pytest.mark.parametrize("case", list(LIGHTNING_CASES))
def test_lightning_own_model_matches_plain_lightning(ranks2, tmp_path, case):
    ranks2.run(check_lightning_own_model, str(tmp_path), **LIGHTNING_CASES[case])


def _trainer_reference(out_dir: str, lora: bool):
    """transformers.Trainer on the plain decoder in one process (LoRA: test_config_api_own_models'
    adapters, the base frozen); its log, final weights and ``evaluate``'s loss."""
    hidden = {name: os.environ.pop(name) for name in ("LOCAL_RANK",) if name in os.environ}
    try:  # without LOCAL_RANK accelerate sees a one-process run
        args = transformers.TrainingArguments(output_dir=f"{out_dir}/ref", **own_api.TRAINER_ARGS)
    finally:
        os.environ.update(hidden)
    torch.manual_seed(0)  # own_models.reference's weights
    reference = own_api._DictDecoder(parallel=False)
    if lora:
        peft.inject_adapter_in_model(own_api._lora_config(), reference)
        with torch.no_grad():
            for name, param in reference.named_parameters():
                if "lora_" in name:
                    param.copy_(own_api._adapter_value(name, param.shape))
    trainer = transformers.Trainer(reference, args, train_dataset=own_api._trainer_rows(),
                                   eval_dataset=own_api._trainer_rows(8))
    trainer.train()
    log = {key: [h[key] for h in trainer.state.log_history if key in h] for key in ("loss", "grad_norm")}
    return log, dict(reference.named_parameters()), trainer.evaluate()["eval_loss"]


def check_nxd_trainer_own_model(out_dir: str, parallel: bool, tp=1, pp=1, zero1=False, lora=False) -> None:
    """NxDTrainer on the decoder (built from parallel layers, or plain; at pp > 1 passed as the
    config API's NxDModel, which carries pipeline_config) against transformers.Trainer in one
    process: logged losses and grad norms, final weights, ``evaluate``'s loss."""
    out_dir = lt._shared(out_dir)
    want, ref_params, ref_eval = _trainer_reference(out_dir, lora)
    parallel_state.destroy_model_parallel()
    if pp > 1:  # the layout the arguments ask for, with the model's pipeline_config
        config = nxd_hf.neuronx_distributed_config(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                                   pipeline_config=own_models.PIPELINE)
        model = nxd_hf.initialize_parallel_model(config, _loaded, parallel)
    else:
        nxd_hf.neuronx_distributed_config(tensor_parallel_size=tp)  # the parallel layers are built at tp
        model = _loaded(parallel)
    dp = parallel_state.get_data_parallel_size()  # per_device_train_batch_size is each replica's, as under DDP
    args = nxd_hf.NxDTrainingArguments(output_dir=f"{out_dir}/ours", tensor_parallel_size=tp,
                                       pipeline_parallel_size=pp, zero_1=zero1,
                                       num_microbatches=2 if pp > 1 else None, **{
                                           **own_api.TRAINER_ARGS, "per_device_train_batch_size": 4 // dp})
    ours = nxd_hf.NxDTrainer(model, args, train_dataset=own_api._trainer_rows(), eval_dataset=own_api._trainer_rows(8),
                             peft_config=own_api._lora_config() if lora else None)
    if lora:  # the reference's adapters (peft draws its own)
        with torch.no_grad():
            for name, param in ours.nxd_model.named_parameters():
                if "lora_" in name:
                    param.copy_(local_shard(param, own_api._adapter_value(name, ref_params[name].shape)))
    ours.train()
    for key, values in want.items():
        got = [h[key] for h in ours.state.log_history if key in h]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(values), **own_api.TOL, msg=lambda m: f"{key}: {m}")
    for name, param in ours.nxd_model.named_parameters():
        torch.testing.assert_close(full_tensor(param), ref_params[name].detach(), **own_api.TOL,
                                   msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(ours.evaluate()["eval_loss"], ref_eval, **own_api.TOL)
    if pp > 1:  # the module itself: NxDTrainingArguments carry no pipeline_config
        with pytest.raises(ValueError, match=r"names no transformer layer class .* pass NxDTrainer that NxDModel"):
            nxd_hf.NxDTrainer(_loaded(parallel), args, train_dataset=own_api._trainer_rows())


def _loaded(parallel: bool):
    """``_DictDecoder`` holding (its shards of) ``own_models.reference()``'s weights."""
    model = own_api._DictDecoder(parallel)
    model.load_state_dict(own_models.build(parallel).state_dict())
    return model


TRAINER_CASES = {  # world 2
    "parallel_layers_pp2": dict(parallel=True, pp=2),
    "plain_pp2": dict(parallel=False, pp=2),
    "parallel_layers_dp2_zero1": dict(parallel=True, zero1=True),
    "plain_dp2": dict(parallel=False),
    "parallel_layers_tp2_lora": dict(parallel=True, tp=2, lora=True),
    "plain_dp2_lora": dict(parallel=False, lora=True),
}


@pytest.mark.parametrize("case", list(TRAINER_CASES))
def test_nxd_trainer_own_model_matches_trainer(ranks2, tmp_path, case):
    ranks2.run(check_nxd_trainer_own_model, str(tmp_path), **TRAINER_CASES[case])
