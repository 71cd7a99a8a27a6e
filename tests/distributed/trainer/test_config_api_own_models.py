"""The config API with models that are not Hugging Face's (``own_models``): a plain PyTorch
decoder at tp=2 (its layout derived from its traced graph, as ``nxd_hf.nnscaler`` derives it),
at tp=2 x dp=2 + ZeRO-1 and at pp=2 through torch.fx (NxD's ``tracer_cls="torch"``); LoRA
(``lora_config``) on a plain decoder and on one built from nxd_hf's parallel layers, at tp=2 and
pp=2; checkpoints of the derived layout across layouts; each against one process on the same
weights and data (loss, gradients, weights after AdamW steps with clipping, the eval loss), and
the errors that name the fix (a non-tensor between the stages of a plain module included). (tp=2, pp=2, dp=2 + ZeRO-1 of the parallel-layers decoder and pp=2 / ZeRO-1
of the plain one: tests/distributed/test_trainer_api.py.)"""

import warnings
import zlib

import peft
import pytest
import torch
from torch import nn

from support import hf_parity
import nxd_hf
from support import own_models
from nxd_hf import backend, parallel_state
from nxd_hf.parallel_layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
from nxd_hf.parallel_layers.sharding import full_tensor, local_shard
from nxd_hf.trainer.config import NxDConfig
from nxd_hf.trainer.own_model import _check_plain_tp

TOL = hf_parity.TOL
MAX_NORM = 0.5  # small enough that clipping is active in every step
LORA_TARGETS = ["q", "v", "up", "down"]  # column and row layers
# AdamW's first update is lr * g / (|g| + eps): for an entry whose gradient is near eps (one of
# layers.3.down's is 3e-8 in step 0, 1e-8 after clipping) the default eps=1e-8 turns fp32 rounding
# of g (which differs between the sharded sum and the one-process one, and between CPUs' kernels)
# into a 2e-5 weight difference. eps=1e-6 bounds that amplification to lr / eps = 1e3.
ADAMW = dict(lr=1e-3, eps=1e-6)


def _dummy():
    ids, labels = own_models.batch(0)
    return {"input_ids": ids[:2], "labels": labels[:2]}


def _lora_config():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS)


def _adapter_value(name: str, shape) -> torch.Tensor:
    """Nonzero A and B (B starts at zero in peft: A would get no gradient in the first step)."""
    return 0.1 * torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))


def _reference(lora: bool):
    reference = own_models.reference()
    if lora:
        peft.inject_adapter_in_model(_lora_config(), reference)
        with torch.no_grad():
            for name, param in reference.named_parameters():
                if "lora_" in name:
                    param.copy_(_adapter_value(name, param.shape))
    return reference


def _config(tp=1, pp=1, zero1=False, lora=False, **kwargs):
    parallel_state.destroy_model_parallel()
    return nxd_hf.neuronx_distributed_config(
        tensor_parallel_size=tp, pipeline_parallel_size=pp,
        pipeline_config={**own_models.PIPELINE, **kwargs.pop("pipeline_config", {})} if pp > 1 else None,
        optimizer_config={"zero_one_enabled": zero1, "max_grad_norm": MAX_NORM},
        lora_config=_lora_config() if lora else None, **{"dummy_forward_args": _dummy() if tp > 1 else None, **kwargs})


def _build(parallel: bool, seed=0, lora=False, **layout):
    nxd_config = _config(lora=lora, **layout)
    model = nxd_hf.initialize_parallel_model(nxd_config, own_models.build, parallel, seed)
    if lora:  # the reference's adapters (peft draws its own from each process's generator)
        adapters = {n: p for n, p in _reference(True).named_parameters() if "lora_" in n}
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(local_shard(param, adapters[name].detach()))
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, nxd_hf.initialize_parallel_optimizer(nxd_config, torch.optim.AdamW, trainable, **ADAMW)


def _train(model, optimizer, steps) -> list[torch.Tensor]:
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_size()
    losses = []
    for step in steps:
        ids, labels = (t.chunk(dp_size)[dp_rank] for t in own_models.batch(step))
        losses.append(model.run_train(input_ids=ids, labels=labels))
        optimizer.step()
        optimizer.zero_grad()
    return losses


def check_trains_like_one_process(parallel: bool, steps=3, lora=False, **layout) -> dict:
    reference = _reference(lora)
    trainable = [p for p in reference.parameters() if p.requires_grad]
    ref_optimizer = torch.optim.AdamW(trainable, **ADAMW)
    ref_losses = []
    for step in range(steps):
        loss = reference(*own_models.batch(step))
        loss.backward()
        ref_losses.append(loss.detach())
        if step == 0:
            ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}
        torch.nn.utils.clip_grad_norm_(trainable, MAX_NORM)
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, optimizer = _build(parallel, lora=lora, **layout)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_size()
    losses = []
    for step in range(steps):
        ids, labels = (t.chunk(dp_size)[dp_rank] for t in own_models.batch(step))
        losses.append(model.run_train(input_ids=ids, labels=labels))
        if step == 0:
            grads = {n: p for n, p in model.named_parameters() if p.grad is not None}
            assert set(grads) <= set(ref_grads) and grads, sorted(set(grads) ^ set(ref_grads))
            for name, param in grads.items():
                grad = full_tensor(param, param.grad).clone()
                if layout.get("zero1"):  # ZeRO-1 takes the DP mean in step(): the grads are this replica's
                    backend.all_reduce(grad, parallel_state.get_data_parallel_group())
                    grad /= dp_size
                torch.testing.assert_close(grad, ref_grads[name], **TOL, msg=lambda m: f"grad {name}: {m}")
        optimizer.step()
        optimizer.zero_grad()
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), **TOL)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(full_tensor(param), ref_params[name].detach(), **TOL, msg=lambda m: f"{name}: {m}")
    model.eval()  # a derived layout runs the eval-mode graph
    ids, labels = (t.chunk(dp_size)[dp_rank] for t in own_models.batch(steps))
    with torch.no_grad():
        torch.testing.assert_close(model.run_eval(input_ids=ids, labels=labels),
                                   reference.eval()(ids, labels), **TOL)  # this replica's rows
    kinds = {name: type(m.base_layer if hasattr(m, "base_layer") else m).__name__
             for name, m in model.named_modules() if name in ("embed", "head", "layers.0.q", "layers.0.o", "layers.0.down")}
    return {"kinds": kinds, "warnings": [str(w.message) for w in caught]}


SHARDED = {"embed": ParallelEmbedding.__name__, "layers.0.q": ColumnParallelLinear.__name__,
           "layers.0.o": RowParallelLinear.__name__, "layers.0.down": RowParallelLinear.__name__,
           "head": nn.Linear.__name__}  # the head's output feeds cross_entropy over the vocabulary: no exact split

CASES = {  # world 2
    "plain_tp2": dict(parallel=False, tp=2),
    "plain_tp2_lora": dict(parallel=False, tp=2, lora=True),
    "plain_pp2_torch_fx": dict(parallel=False, pp=2, pipeline_config={"tracer_cls": "torch"}),
    "plain_pp2_lora": dict(parallel=False, pp=2, lora=True),
    "parallel_layers_tp2_lora": dict(parallel=True, tp=2, lora=True),
    "parallel_layers_pp2_lora": dict(parallel=True, pp=2, lora=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_own_model_trains_like_one_process(ranks2, case):
    results = ranks2.run(check_trains_like_one_process, **CASES[case])
    if CASES[case].get("tp") and not CASES[case]["parallel"]:
        assert all(r["kinds"] == SHARDED for r in results), results[0]["kinds"]
        assert any("['head'] have no exact split" in w for w in results[0]["warnings"]), results[0]["warnings"]


def test_plain_decoder_tp2_dp2_zero1_trains_like_one_process(ranks4):
    results = ranks4.run(check_trains_like_one_process, parallel=False, tp=2, zero1=True)
    assert all(r["kinds"] == SHARDED for r in results)


def check_checkpoint_across_layouts(path: str, lora: bool, save: dict, load: dict) -> None:
    """save_checkpoint of the plain decoder at one layout, load_checkpoint into one built with
    other weights (LoRA: other adapters) at another: the same losses on as the model that went
    on training."""
    model, optimizer = _build(False, lora=lora, **save)
    _train(model, optimizer, range(2))
    nxd_hf.save_checkpoint(path, tag="step2", model=model, optimizer=optimizer, user_content={"step": 2})
    expected = torch.stack(_train(model, optimizer, range(2, 4)))
    # LoRA: the checkpoint holds the adapters (and their optimizer state), the base comes from model_fn
    model, optimizer = _build(False, seed=0 if lora else 7, lora=lora, **load)
    assert nxd_hf.load_checkpoint(path, model=model, optimizer=optimizer) == {"step": 2}
    torch.testing.assert_close(torch.stack(_train(model, optimizer, range(2, 4))), expected, **TOL)


CHECKPOINTS = {  # world 2
    "plain_tp2_to_pp2": dict(lora=False, save=dict(tp=2), load=dict(pp=2)),
    "plain_pp2_to_tp2": dict(lora=False, save=dict(pp=2), load=dict(tp=2)),
    "plain_lora_tp2_to_dp2_zero1": dict(lora=True, save=dict(tp=2), load=dict(zero1=True)),
}


@pytest.mark.parametrize("layouts", list(CHECKPOINTS))
def test_plain_decoder_checkpoint_across_layouts(ranks2, tmp_path, layouts):
    ranks2.run(check_checkpoint_across_layouts, str(tmp_path / layouts), **CHECKPOINTS[layouts])


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x, scale: float = 1.0):
        return (self.down(torch.relu(self.up(x))) * scale).sum()


def check_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match=r"neuronx_distributed_config\(dummy_forward_args="):
        nxd_hf.initialize_parallel_model(_config(tp=2, dummy_forward_args=None), own_models.build, False)
    parallel_state.destroy_model_parallel()
    meta = nxd_hf.neuronx_distributed_config(tensor_parallel_size=2, dummy_forward_args=_dummy(), model_init_config={
        "meta_device_init": True, "param_init_fn": lambda module: None})
    with pytest.raises(ValueError, match="meta device"):
        nxd_hf.initialize_parallel_model(meta, own_models.build, False)
    config = _config(tp=2, dummy_forward_args={"x": torch.ones(2, 4)})
    model = nxd_hf.initialize_parallel_model(config, _Scaled)
    assert type(model.module.up) is ColumnParallelLinear and type(model.module.down) is RowParallelLinear
    model.run_train(torch.ones(2, 4))
    model.run_train(torch.ones(2, 4), scale=1.0)  # the default the graph was traced with
    with pytest.raises(ValueError, match="scale, which was not in dummy_forward_args"):
        model.run_train(torch.ones(2, 4), scale=2.0)


def test_errors_name_the_fix(ranks2):
    ranks2.run(check_errors_name_the_fix)


@pytest.mark.parametrize(("options", "match"), [
    (dict(activation_checkpoint_config="full"), "runs as its traced graph"),
])
def test_plain_tp_refusals(options, match):
    with pytest.raises(ValueError, match=match):
        _check_plain_tp("Plain", NxDConfig(tensor_parallel_size=2, **options))



def test_non_tensor_at_a_stage_boundary_names_the_value():
    """A plain module split into stages passes a Python int between its layers (``n = x.shape[1]``;
    ``layer(h, n)``): it used to fail in run_train with AttributeError: 'int' object has no attribute 'shape'."""
    from nxd_hf.pipeline.stages import flat_boundary_values

    graph = torch.fx.symbolic_trace(lambda x: x.shape[1]).graph
    node = [n for n in graph.nodes if n.op == "call_function"][-1]  # shape[1]
    node.meta["val"] = 3
    with pytest.raises(ValueError, match=r"getitem \(int, not a tensor\) crosses a pipeline stage boundary"):
        flat_boundary_values([node], {node.name: "tensor"})


class _DictDecoder(own_models.OwnDecoder):
    """``OwnDecoder`` whose forward returns ``{"loss": ...}``, as ``transformers.Trainer`` takes a
    module's output (it cannot index a bare scalar loss)."""

    def forward(self, input_ids, labels):
        return {"loss": super().forward(input_ids, labels)}


def _trainer_rows(n=12):
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": ids, "labels": ids.clone()}
            for ids in torch.randint(0, own_models.VOCAB, (n, 8), generator=g)]


TRAINER_ARGS = dict(per_device_train_batch_size=4, max_steps=3, learning_rate=1e-3, logging_steps=1, max_grad_norm=0.5,
                    weight_decay=0.1, save_strategy="no", report_to=[], disable_tqdm=True, seed=7)


def check_nxd_trainer_matches_trainer(out_dir: str) -> dict:
    """NxDTrainer at tp=2 on a decoder built from nxd_hf's parallel layers (its forward returning
    the loss, or a dict holding it) against transformers.Trainer on the plain decoder in one
    process: logged losses and grad norms, final weights, save_model's weights."""
    import json
    import os

    import transformers
    from safetensors.torch import load_file

    hidden = {name: os.environ.pop(name) for name in ("LOCAL_RANK",) if name in os.environ}
    try:  # without LOCAL_RANK accelerate sees a one-process run
        ref_args = transformers.TrainingArguments(output_dir=f"{out_dir}/ref", **TRAINER_ARGS)
    finally:
        os.environ.update(hidden)
    torch.manual_seed(0)  # own_models.reference's weights
    reference = _DictDecoder(parallel=False)
    ref = transformers.Trainer(reference, ref_args, train_dataset=_trainer_rows())
    ref.train()
    want = {key: [h[key] for h in ref.state.log_history if key in h] for key in ("loss", "grad_norm")}
    results = {}
    for output in ("dict", "tensor"):
        parallel_state.destroy_model_parallel()
        nxd_hf.neuronx_distributed_config(tensor_parallel_size=2)  # the parallel layers are built at tp=2
        model = own_models.build(parallel=True)
        if output == "dict":
            as_dict = _DictDecoder(parallel=True)
            as_dict.load_state_dict(model.state_dict())
            model = as_dict
        args = nxd_hf.NxDTrainingArguments(output_dir=f"{out_dir}/{output}", tensor_parallel_size=2, **TRAINER_ARGS)
        ours = nxd_hf.NxDTrainer(model, args, train_dataset=_trainer_rows())
        ours.train()
        for key, values in want.items():
            got = [h[key] for h in ours.state.log_history if key in h]
            torch.testing.assert_close(torch.tensor(got), torch.tensor(values), **TOL, msg=lambda m: f"{output} {key}: {m}")
        ref_params = dict(reference.named_parameters())
        assert ours.nxd_model.module is model  # used as built: no second sharding
        for name, param in ours.nxd_model.named_parameters():
            torch.testing.assert_close(full_tensor(param), ref_params[name].detach(), **TOL,
                                       msg=lambda m: f"{output} {name}: {m}")
        ours.save_model(f"{out_dir}/{output}/saved")
        if backend.rank() == 0:
            with open(f"{out_dir}/{output}/saved/model.safetensors.index.json") as index:
                files = set(json.load(index)["weight_map"].values())
            saved = {k: v for f in files for k, v in load_file(f"{out_dir}/{output}/saved/{f}").items()}
            assert set(saved) == set(ref_params), sorted(set(saved) ^ set(ref_params))
            for name, tensor in saved.items():
                torch.testing.assert_close(tensor, ref_params[name].detach(), **TOL, msg=lambda m: f"saved {name}: {m}")
        results[output] = want["loss"]
    parallel_state.destroy_model_parallel()  # built before any groups: whole weights in every layer
    unsharded = own_models.build(parallel=True)
    args = nxd_hf.NxDTrainingArguments(output_dir=f"{out_dir}/unsharded", tensor_parallel_size=2, **TRAINER_ARGS)
    with pytest.raises(ValueError, match="parallel layers were built at tensor_parallel_size=1"):
        nxd_hf.NxDTrainer(unsharded, args, train_dataset=_trainer_rows())
    with pytest.raises(ValueError, match="NxDTrainer shards no plain module over tensor_parallel_size > 1"):
        nxd_hf.NxDTrainer(own_models.reference(), args, train_dataset=_trainer_rows())
    return results


def test_nxd_trainer_own_parallel_layers_model_matches_trainer(ranks2, tmp_path):
    results = ranks2.run(check_nxd_trainer_matches_trainer, str(tmp_path))
    assert len(results[0]["dict"]) == 3
