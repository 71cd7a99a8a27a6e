"""LoRA through peft on parallel models (nxd_hf.lora): five AdamW steps equal plain peft on the
unsharded model, PEFT-format round trips, merge, bad input, and the peft internals we rely on."""

import inspect

import peft
import pytest
import transformers

import lora_cases
import lora_io_cases
from nxd_hf.testing import run_distributed


TRAINING_TP2 = {  # name -> (model_type, tp, check_training's keyword arguments)
    "llama_all_linear": ("llama", 2, dict(target_modules="all-linear")),  # the same layers as plain peft's
    "gpt2_conv1d_fused_c_attn": ("gpt2", 2, dict(target_modules=["c_attn", "c_proj", "c_fc"])),
    "gpt_neox": ("gpt_neox", 2, dict(target_modules=["query_key_value", "dense", "dense_4h_to_h"])),
    # trained biases (not c_attn's: the key bias has a zero gradient, which Adam turns into noise)
    "gpt2_trained_biases": ("gpt2", 2, dict(target_modules=["c_proj", "c_fc"], bias="lora_only")),
    "bert_classification_modules_to_save": ("bert", 2, dict(
        task_model_cls=transformers.BertForSequenceClassification, task="cls",
        target_modules=["query", "key", "value", "dense"], modules_to_save=["classifier"])),
    "llama_tp1_dp2": ("llama", 1, dict(dp=2, target_modules=["q_proj", "v_proj", "down_proj"])),
}
TRAINING_TP4 = {
    # kv_heads 2 < tp 4: replicated K/V; a vocab-sharded embedding (101 rows padded to 104) trained in full
    "llama_kv_heads_fewer_than_tp_embedding_trained": ("llama", 4, dict(target_modules=lora_cases.ALL_LLAMA,
                                                                        modules_to_save=["embed_tokens"])),
    "qwen2_padded_heads_sequence_parallel": ("qwen2", 4, dict(sp=True, target_modules=lora_cases.ALL_LLAMA)),
    # fused [q; k; v] rows: padded query heads and replicated K/V heads in one layer
    "phi3_fused_qkv": ("phi3", 4, dict(target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])),
}


TRAINING = {**{(2, case): args for case, args in TRAINING_TP2.items()},
            **{(4, case): args for case, args in TRAINING_TP4.items()}}


@pytest.mark.parametrize("world_size, case", list(TRAINING), ids=[f"world{w}-{c}" for w, c in TRAINING])
def test_lora_training_matches_plain_peft(request, world_size, case):
    model_type, tp, kwargs = TRAINING[world_size, case]
    request.getfixturevalue(f"ranks{world_size}").run(lora_cases.check_training, model_type, tp, **kwargs)


def test_lora_dropout_masks_match_plain_peft_tp2(ranks2):
    ranks2.run(lora_cases.check_dropout_masks, 2)


@pytest.mark.parametrize("as_stages", [False, True], ids=["model", "stages"])
def test_inject_lora_tp2(ranks2, tmp_path, as_stages):
    ranks2.run(lora_cases.check_inject_lora, 2, str(tmp_path), as_stages=as_stages)


def test_peft_format_round_trips_and_merge(ranks2, tmp_path):
    ranks2.run(lora_io_cases.check_round_trips, str(tmp_path))


@pytest.mark.parametrize("pp", [1, 2], ids=["tp2", "pp2"])
def test_parallelize_with_lora_config_saves_a_peft_adapter(ranks2, tmp_path, pp):
    ranks2.run(lora_io_cases.check_parallelize_lora_config_save_pretrained, str(tmp_path), pp)


def test_lora_bad_input_is_a_clear_error(ranks2, tmp_path):
    ranks2.run(lora_io_cases.check_bad_input, str(tmp_path))


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_lora_inits_match_plain_peft_or_are_refused(ranks2, tmp_path, layout):
    ranks2.run(lora_cases.check_inits_match_plain_peft, layout, str(tmp_path))


def test_lora_zero1_tp2_dp2(ranks4):
    ranks4.run(lora_cases.check_zero1, 2)


def test_lora_pipeline_tp2_pp2(ranks4, tmp_path):
    ranks4.run(lora_cases.check_pipeline, 2, 2, str(tmp_path))


def test_peft_dispatch_contract():
    """The peft internals nxd_hf.lora.dispatch wraps: fails when peft changes them under us."""
    from peft import PeftModel
    from peft import peft_model as peft_model_module
    from peft.tuners.lora.model import LoraModel
    from peft.utils.other import ModulesToSaveWrapper

    from nxd_hf.lora import dispatch

    dispatch.register_with_peft()
    dispatch.register_with_peft()  # idempotent: wrapped once
    assert dispatch.is_registered()
    create = inspect.getattr_static(LoraModel, "_create_new_module")
    assert isinstance(create, staticmethod) and not hasattr(create.__func__.__wrapped__, "_nxd_hf")
    assert list(inspect.signature(create.__func__.__wrapped__).parameters)[:3] == ["lora_config", "adapter_name", "target"]
    assert "self._create_new_module(lora_config, adapter_name, target" in inspect.getsource(LoraModel._create_and_replace)
    save = inspect.getsource(PeftModel.save_pretrained.__wrapped__)
    assert "get_peft_model_state_dict(" in save and 'state_dict=kwargs.get("state_dict", None)' in save
    assert "is_main_process" in inspect.signature(PeftModel.save_pretrained.__wrapped__).parameters
    assert "set_peft_model_state_dict(" in inspect.getsource(PeftModel.load_adapter)
    assert peft_model_module.set_peft_model_state_dict.__wrapped__.__module__ == "peft.utils.save_and_load"
    assert "copy.deepcopy(self.original_module)" in inspect.getsource(ModulesToSaveWrapper.update.__wrapped__)
    from peft.tuners import tuners_utils

    assert "_maybe_include_all_linear_layers(peft_config, model)" in inspect.getsource(tuners_utils.BaseTuner.inject_adapter)
    update = inspect.signature(peft.tuners.lora.layer.LoraLayer.update_layer).parameters
    assert list(update)[:5] == ["self", "adapter_name", "r", "lora_alpha", "config"]


def test_declared_peft_and_transformers_ranges_hold():
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    requirements = {Requirement(r).name: Requirement(r) for r in project["dependencies"]}
    assert requirements["peft"].specifier.contains(peft.__version__)
    assert requirements["transformers"].specifier.contains(transformers.__version__)
    assert requirements["peft"].specifier and "<" in str(requirements["peft"].specifier)


def test_nxd_lora_config_converts_to_peft():
    from nxd_hf.lora import to_peft_config
    from nxd_hf.modules.lora import LoraConfig

    config = to_peft_config(LoraConfig(enable_lora=True, lora_rank=8, lora_alpha=16, lora_dropout=0.1, bias="all",
                                       target_modules=["q_proj"], use_rslora=True, init_lora_weights="gaussian"))
    assert (config.r, config.lora_alpha, config.lora_dropout, config.bias) == (8, 16, 0.1, "all")
    assert config.target_modules == {"q_proj"} and config.use_rslora and config.init_lora_weights == "gaussian"
    assert to_peft_config(LoraConfig(enable_lora=True)).init_lora_weights is True
    with pytest.raises(ValueError, match="lora_rank"):
        LoraConfig(lora_rank=0)
    with pytest.raises(ValueError, match="merge_lora"):
        LoraConfig(merge_lora=True)
    with pytest.raises(ValueError, match="init_lora_weights"):
        LoraConfig(init_lora_weights="pissa")


def test_save_pretrained_on_one_rank_raises(tmp_path):
    """Its own spawn: the failed monitored barrier leaves the process group unusable, and rank 1
    exiting is what ends rank 0's wait."""
    run_distributed(lora_io_cases.check_save_on_one_rank_raises, 2, str(tmp_path))
