"""NxD's LoRA checkpoint modes: save_checkpoint of a LoRA model from the
config API follows LoraConfig.save_lora_base / merge_lora / save_lora_config_adapter, and
load_lora_from_ckpt + load_checkpoint resume it.

tp=2 llama (all projections, lm_head in modules_to_save, bias="lora_only"): adapter only ->
plain PeftModel.from_pretrained; base and adapter -> consolidate + transformers + peft; merged ->
consolidate + transformers; each reloads through load_lora_from_ckpt with the saved logits, and
with load_checkpoint's optimizer state the next step equals the uninterrupted run."""

import dataclasses
import os
import warnings

from support import lora
import peft
import pytest
import torch
import transformers

import nxd_hf
from nxd_hf import backend, parallel_state
from nxd_hf.checkpoint import consolidate, load_checkpoint, save_checkpoint
from nxd_hf.checkpoint.store import read_index
from nxd_hf.modules.lora import LoraConfig
from nxd_hf.trainer import initialize_parallel_model, neuronx_distributed_config
from support import hf_parity


TOL = hf_parity.TOL
LR = 1e-2  # large enough that the adapters change the logits visibly
ADAPTER_ONLY, BASE_AND_ADAPTER, MERGED = "adapter_only", "base_and_adapter", "merged"


def _config(**lora_fields):
    parallel_state.destroy_model_parallel()
    lora = LoraConfig(**{"enable_lora": True, "lora_verbose": False, **lora_fields})
    return neuronx_distributed_config(tensor_parallel_size=2, lora_config=lora)


def _train_config():
    return _config(lora_rank=4, lora_alpha=8, lora_dropout=0.0, target_modules=lora.ALL_LLAMA,
                   modules_to_save=["lm_head"], bias="lora_only")


def _build(nxd_config, base_seed: int = 0):
    return initialize_parallel_model(nxd_config, lambda: hf_parity.build_pair("llama", seed=base_seed)[1])


def _step(model, optimizer, step: int) -> torch.Tensor:
    ids, labels = hf_parity.batch(seed=40 + step)
    loss = model.run_train(input_ids=ids, labels=labels)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=hf_parity.batch(seed=99)[0]).logits
    model.train()
    return logits


def _plain_logits(hf_model, adapter_dir: str | None = None) -> torch.Tensor:
    model = peft.PeftModel.from_pretrained(hf_model, adapter_dir) if adapter_dir else hf_model
    model.eval()
    with torch.no_grad():
        return model(input_ids=hf_parity.batch(seed=99)[0]).logits


def _consolidated(path: str, tag: str, out: str):
    if backend.rank() == 0:
        consolidate(path, out, tag=tag)
    backend.barrier()
    return transformers.LlamaForCausalLM.from_pretrained(out)


def _with_lora(nxd_config, **fields):
    return dataclasses.replace(nxd_config, lora_config=dataclasses.replace(nxd_config.lora_config, **fields))


def check_save_modes(tmp_dir: str) -> dict:
    """Train 3 steps, save in the three modes, check each reloads; then one more step (the
    uninterrupted run). Returns what the resumed runs must reproduce."""
    nxd_config = _train_config()
    model = _build(nxd_config)
    optimizer = _optimizer(model)
    for step in range(3):
        _step(model, optimizer, step)
    logits = _logits(model)
    plain_base = hf_parity.build_pair("llama")[0]
    assert not torch.allclose(logits, _plain_logits(plain_base), **TOL), "the adapters must change the logits"
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    path = os.path.join(tmp_dir, "ckpt")

    save_checkpoint(path, ADAPTER_ONLY, model=model, optimizer=optimizer, nxd_config=nxd_config)
    directory = os.path.join(path, ADAPTER_ONLY)
    assert sorted(os.listdir(os.path.join(directory, "adapter"))) == ["adapter_config.json", "adapter_model.safetensors"]
    index = read_index(directory)[0]
    assert "model" not in index["tensors"] and index["tensors"]["adapter"], "adapter only: no base tensors"
    assert not any("lora" not in n and "modules_to_save" not in n and not n.endswith("bias")
                   for n in index["tensors"]["adapter"])
    torch.testing.assert_close(_plain_logits(hf_parity.build_pair("llama")[0], f"{directory}/adapter"), logits, **TOL)
    with pytest.raises(ValueError, match="LoRA adapter only"):
        consolidate(path, os.path.join(tmp_dir, f"none{backend.rank()}"), tag=ADAPTER_ONLY)
    with pytest.raises(ValueError, match="LoRA adapters"):  # a plain HF directory cannot hold them
        model.save_pretrained(os.path.join(tmp_dir, "hf"))

    save_checkpoint(path, BASE_AND_ADAPTER, model=model, optimizer=optimizer,
                    nxd_config=_with_lora(nxd_config, save_lora_base=True))
    base = _consolidated(path, BASE_AND_ADAPTER, os.path.join(tmp_dir, "base"))
    original = hf_parity.build_pair("llama")[0].state_dict()
    assert base.state_dict().keys() == original.keys()
    for name, value in original.items():  # the original base under HF names (biases train with bias="lora_only")
        if not name.endswith("bias"):
            torch.testing.assert_close(base.state_dict()[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(_plain_logits(base, f"{path}/{BASE_AND_ADAPTER}/adapter"), logits, **TOL)

    # merged into the saved copy, the config apart (NxD's save_lora_config_adapter=False)
    save_checkpoint(path, MERGED, model=model, optimizer=optimizer,
                    nxd_config=_with_lora(nxd_config, save_lora_base=True, merge_lora=True,
                                          save_lora_config_adapter=False))
    directory = os.path.join(path, MERGED)
    assert os.listdir(os.path.join(directory, "adapter")) == ["adapter_model.safetensors"]
    assert os.listdir(os.path.join(directory, "lora_adapter")) == ["adapter_config.json"]
    merged = _consolidated(path, MERGED, os.path.join(tmp_dir, "merged"))
    assert not any("lora" in n or "base_layer" in n or "modules_to_save" in n for n in merged.state_dict())
    torch.testing.assert_close(_plain_logits(merged), logits, **TOL)

    for name, param in model.named_parameters():  # saving changed nothing
        assert torch.equal(param, before[name]), f"save_checkpoint changed {name}"
    torch.testing.assert_close(_logits(model), logits, rtol=0, atol=0)
    loss = _step(model, optimizer, 3)
    after = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"path": path, "logits": logits, "loss": loss, "after": after, "next_logits": _logits(model)}


def check_resume(tag: str, expected: dict, *, base_seed: int = 0, **lora_fields) -> None:
    """``load_lora_from_ckpt`` gives the saved logits; ``load_checkpoint`` then restores the
    optimizer, and the next step equals the uninterrupted run's."""
    nxd_config = _config(load_lora_from_ckpt=True, lora_save_dir=expected["path"], lora_load_tag=tag, **lora_fields)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _build(nxd_config, base_seed=base_seed)
    messages = [str(w.message) for w in caught]
    assert (tag == MERGED) == any("merged" in m for m in messages), messages
    assert ("lora_rank" in lora_fields) == any("lora_rank=8" in m for m in messages), messages
    torch.testing.assert_close(_logits(model), expected["logits"], **TOL, msg=lambda m: f"{tag} loaded: {m}")
    optimizer = _optimizer(model)
    load_checkpoint(expected["path"], tag, model=model, optimizer=optimizer)
    loss = _step(model, optimizer, 3)
    torch.testing.assert_close(loss, expected["loss"], **TOL, msg=lambda m: f"{tag} next loss: {m}")
    resumed = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert resumed.keys() == expected["after"].keys()
    for name, value in expected["after"].items():
        torch.testing.assert_close(resumed[name], value, **TOL, msg=lambda m: f"{tag} {name} after the step: {m}")
    torch.testing.assert_close(_logits(model), expected["next_logits"], **TOL)


def check_bad_input(tmp_dir: str) -> None:
    """load_lora_from_ckpt from a checkpoint of a model without LoRA: a ValueError on every rank."""
    parallel_state.destroy_model_parallel()
    plain = nxd_hf.parallelize(hf_parity.build_pair("llama")[1], tensor_parallel_size=2)
    save_checkpoint(os.path.join(tmp_dir, "plain"), "t", model=plain)
    nxd_config = _config(load_lora_from_ckpt=True, lora_save_dir=os.path.join(tmp_dir, "plain"), lora_load_tag="t")
    with pytest.raises(ValueError, match="holds no LoRA adapter"):
        _build(nxd_config)


def run_cases(tmp_dir: str) -> None:
    expected = check_save_modes(tmp_dir)
    check_resume(ADAPTER_ONLY, expected, lora_rank=8)  # lora_rank ignored (the saved r=4 is used), with a warning
    check_resume(BASE_AND_ADAPTER, expected, base_seed=5)  # another base: the saved one is loaded
    check_resume(MERGED, expected)  # the merged base is not loaded: the model's own (original) base stays
    check_bad_input(tmp_dir)


_saved = {}  # tmp_dir -> what check_save_modes returned, on this rank (the pool keeps it alive)


def saved_modes(tmp_dir: str) -> dict:
    """The three checkpoints of one training run, saved once per rank process and directory."""
    if tmp_dir not in _saved:
        _saved[tmp_dir] = check_save_modes(tmp_dir)
    return _saved[tmp_dir]


def save_once(tmp_dir: str) -> None:
    saved_modes(tmp_dir)


def resume(tmp_dir: str, mode: str, **kwargs) -> None:
    check_resume(mode, saved_modes(tmp_dir), **kwargs)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("lora_ckpt"))


def test_lora_checkpoint_save_modes_open_in_transformers_and_peft(ranks2, ckpt_dir):
    ranks2.run(save_once, ckpt_dir)


RESUMES = {
    "adapter_only": (ADAPTER_ONLY, dict(lora_rank=8)),  # lora_rank ignored (the saved r=4), warned
    "base_and_adapter": (BASE_AND_ADAPTER, dict(base_seed=5)),  # another base: the saved one loads
    "merged": (MERGED, {}),  # the merged base is not loaded: the model's own (original) base stays
}


@pytest.mark.parametrize("mode", list(RESUMES))
def test_lora_checkpoint_resumes_through_load_lora_from_ckpt(ranks2, ckpt_dir, mode):
    tag, kwargs = RESUMES[mode]
    ranks2.run(resume, ckpt_dir, tag, **kwargs)


def test_load_lora_from_a_checkpoint_without_lora_is_refused(ranks2, tmp_path):
    ranks2.run(check_bad_input, str(tmp_path))
