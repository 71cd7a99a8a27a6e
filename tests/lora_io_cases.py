"""PEFT-format round trips, merge and bad input on a tp=2 parallel peft model (run on gloo
ranks by tests/test_lora.py)."""

import json
import os

import peft
import pytest
import torch
from safetensors import safe_open

import hf_parity
import lora_cases
import nxd_hf
from nxd_hf import backend
from nxd_hf.lora import io

TOL = hf_parity.TOL


def _read_adapter(directory: str) -> tuple[dict, dict, dict]:
    with safe_open(os.path.join(directory, "adapter_model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    with open(os.path.join(directory, "adapter_config.json")) as f:
        config = json.load(f)
    return tensors, metadata, config


def check_files_match_plain_peft(par_dir: str, plain_dir: str) -> None:
    tensors, metadata, config = _read_adapter(par_dir)
    ref_tensors, ref_metadata, ref_config = _read_adapter(plain_dir)
    assert metadata == ref_metadata == {"format": "pt"}
    assert config == ref_config, (config, ref_config)
    assert sorted(tensors) == sorted(ref_tensors)
    for key, value in ref_tensors.items():
        torch.testing.assert_close(tensors[key], value, **TOL, msg=lambda m: f"{key}: {m}")


def _fresh_parallel(model_type: str = "llama", **overrides):
    _, model = hf_parity.build_pair(model_type, **overrides)
    return nxd_hf.parallelize(model, tensor_parallel_size=2)


def check_round_trips(tmp_dir: str) -> None:
    """Trained llama tp=2 (lm_head in modules_to_save): parallel save == plain save, loads into
    plain peft and back into a parallel model with plain peft's logits; disable_adapter and
    merge_and_unload give plain peft's logits."""
    config = lora_cases.lora_config(target_modules=lora_cases.ALL_LLAMA, modules_to_save=["lm_head"])
    ref_peft, par_peft = lora_cases.peft_pair("llama", 2, config)
    lora_cases.train_and_compare(ref_peft, par_peft, "llama tp=2 modules_to_save=lm_head")
    ids, _ = hf_parity.batch(seed=99)
    ref_logits = lora_cases.eval_logits(ref_peft, ids)
    torch.testing.assert_close(lora_cases.eval_logits(par_peft, ids), ref_logits, **TOL)
    rank = backend.rank()
    par_dir, plain_dir = os.path.join(tmp_dir, "parallel"), os.path.join(tmp_dir, f"plain{rank}")
    par_peft.save_pretrained(par_dir)
    ref_peft.save_pretrained(plain_dir)
    check_files_match_plain_peft(par_dir, plain_dir)

    plain_base, _ = hf_parity.build_pair("llama")
    loaded = peft.PeftModel.from_pretrained(plain_base, par_dir)
    torch.testing.assert_close(lora_cases.eval_logits(loaded, ids), ref_logits, **TOL)

    par_loaded = peft.PeftModel.from_pretrained(_fresh_parallel(), plain_dir)
    torch.testing.assert_close(lora_cases.eval_logits(par_loaded, ids), ref_logits, **TOL)
    with par_loaded.disable_adapter(), ref_peft.disable_adapter():
        base_logits = lora_cases.eval_logits(ref_peft, ids)
        torch.testing.assert_close(lora_cases.eval_logits(par_loaded, ids), base_logits, **TOL)
    assert not torch.allclose(base_logits, ref_logits, **TOL), "the trained adapter must change the logits"
    par_loaded.print_trainable_parameters()
    par_loaded.load_adapter(par_dir, adapter_name="second")  # a second adapter into the existing LoRA layers
    par_loaded.set_adapter("second")
    torch.testing.assert_close(lora_cases.eval_logits(par_loaded, ids), ref_logits, **TOL)
    par_loaded.delete_adapter("second")
    par_loaded.set_adapter("default")

    merged = par_loaded.merge_and_unload()
    ref_merged = ref_peft.merge_and_unload()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    merged_ref_params = dict(ref_merged.named_parameters())
    for name, param in merged.named_parameters():
        torch.testing.assert_close(lora_cases.logical(param), merged_ref_params[name].detach(), **TOL,
                                   msg=lambda m: f"merged {name}: {m}")
    merged.eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, ref_logits, **TOL)


def check_bad_input(tmp_dir: str) -> None:
    with pytest.raises(ValueError, match="nope"):
        peft.get_peft_model(_fresh_parallel(), lora_cases.lora_config(target_modules=["nope"]))
    with pytest.raises(ValueError, match="DoRA"):
        peft.get_peft_model(_fresh_parallel(), lora_cases.lora_config(target_modules=["q_proj"], use_dora=True))
    rank = backend.rank()
    gpt2_dir, wide_dir = os.path.join(tmp_dir, f"gpt2_{rank}"), os.path.join(tmp_dir, f"wide_{rank}")
    gpt2, _ = hf_parity.build_pair("gpt2")
    peft.get_peft_model(gpt2, lora_cases.lora_config(target_modules=["c_attn"])).save_pretrained(gpt2_dir)
    with pytest.raises(ValueError, match="c_attn"):
        peft.PeftModel.from_pretrained(_fresh_parallel(), gpt2_dir)
    wide, _ = hf_parity.build_pair("llama", intermediate_size=80)
    peft.get_peft_model(wide, lora_cases.lora_config(target_modules=["up_proj"])).save_pretrained(wide_dir)
    with pytest.raises(ValueError, match=r"up_proj.*shape"):
        peft.PeftModel.from_pretrained(_fresh_parallel(), wide_dir)
    _drop_one_key(wide_dir, hf_parity.build_pair("llama")[0])
    with pytest.raises(ValueError, match="missing"):
        peft.PeftModel.from_pretrained(_fresh_parallel(), wide_dir)


def _drop_one_key(directory: str, model) -> None:
    """Rewrite the adapter in ``directory`` for ``model``'s sizes with one tensor left out."""
    peft_model = peft.get_peft_model(model, lora_cases.lora_config(target_modules=["up_proj"]))
    peft_model.save_pretrained(directory)
    tensors, _, _ = _read_adapter(directory)
    from safetensors.torch import save_file

    save_file(dict(sorted(tensors.items())[1:]), os.path.join(directory, "adapter_model.safetensors"),
              metadata={"format": "pt"})


def check_save_on_one_rank_raises(tmp_dir: str) -> None:
    """save_pretrained called by rank 0 alone: a ValueError naming the missing rank, no hang."""
    io.SAVE_ARRIVAL_TIMEOUT_S = 3.0
    _, par_peft = lora_cases.peft_pair("llama", 2, lora_cases.lora_config(target_modules=["q_proj"]))
    if backend.rank() == 0:
        with pytest.raises(ValueError, match=r"every rank must call it.*\b1\b"):
            par_peft.save_pretrained(os.path.join(tmp_dir, "alone"))
    assert not os.path.exists(os.path.join(tmp_dir, "alone", "adapter_model.safetensors"))


def check_parallelize_lora_config_save_pretrained(tmp_dir: str, pp: int) -> None:
    """``parallelize(model, lora_config=...)`` (the README's first LoRA form): its
    ``save_pretrained`` writes the adapter as peft does, which plain peft loads onto the plain
    model with the parallel model's logits."""
    _, model = hf_parity.build_pair("llama")
    config = lora_cases.lora_config(target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    torch.manual_seed(5)
    tp = 2 // pp
    extra = {"num_microbatches": 2, "broadcast_and_average_loss": True} if pp > 1 else {}
    par = nxd_hf.parallelize(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, lora_config=config, **extra)
    directory = os.path.join(tmp_dir, f"form1_pp{pp}")
    par.save_pretrained(directory)
    plain_base, _ = hf_parity.build_pair("llama")
    loaded = peft.PeftModel.from_pretrained(plain_base, directory)
    ids, labels = hf_parity.batch(seed=99)
    with torch.no_grad():
        loss = (par.run_eval(input_ids=ids, labels=labels) if pp > 1
                else par.eval()(input_ids=ids, labels=labels).loss)
        want = loaded.eval()(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(loss, want, **TOL)
    with loaded.disable_adapter(), torch.no_grad():
        assert not torch.allclose(loaded(input_ids=ids, labels=labels).loss, want), "the adapter must matter"
