"""LoRA through peft on parallel models (nxd_hf.lora): five AdamW steps equal plain peft on the
unsharded model, PEFT-format round trips, merge, bad input, and the peft internals we rely on."""

import copy
import inspect
import json
import os

import peft
import pytest
import torch
import transformers
from safetensors import safe_open

import nxd_hf
from nxd_hf import backend, parallel_state
from nxd_hf.lora import io
from nxd_hf.parallel_layers.sharding import local_shard
from nxd_hf.testing import run_distributed
from support import hf_parity
from support.lora import (
    ALL_LLAMA, check_training, eval_logits, logical, lora_config, LR, peft_pair, SEED, STEPS, TOL,
    train_and_compare,
)
from support.paths import REPO


def check_dropout_masks(tp: int) -> None:
    """lora_dropout > 0: the column layers' masks (replicated input) are identical on every TP
    rank, and the whole run equals plain peft (the row layers draw the full mask's slices)."""
    masks = []

    def record(module, args, output):
        if module.training:
            masks.append(output != 0)

    config = lora_config(target_modules=ALL_LLAMA, lora_dropout=0.3)
    ref_peft, par_peft = peft_pair("llama", tp, config, sp=True)
    par_peft.get_submodule("base_model.model.model.layers.0.self_attn.q_proj.lora_dropout.default").register_forward_hook(record)
    train_and_compare(ref_peft, par_peft, f"llama tp={tp} dropout=0.3 sp")
    assert len(masks) == STEPS and 0.5 < float(torch.stack(masks).float().mean()) < 0.9
    group = parallel_state.get_tensor_model_parallel_group()
    stacked = torch.stack(masks).to(torch.uint8)
    gathered = backend.all_gather(stacked.unsqueeze(0), 0, group)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "dropout masks differ across TP ranks"


def check_zero1(tp: int) -> None:
    """ZeRO-1 over the adapters only (tp x dp=2) with active clipping: equal to plain peft with
    clip_grad_norm_ + AdamW; the optimizer state is 12 bytes per adapter element / dp."""
    from nxd_hf.optim import NeuronZero1Optimizer

    max_norm = 0.02
    ref_peft, par_peft = peft_pair("llama", tp, lora_config(target_modules=ALL_LLAMA), dp=2)
    adapters = [p for p in par_peft.parameters() if p.requires_grad]
    optimizer = NeuronZero1Optimizer(adapters, torch.optim.AdamW, lr=LR, max_norm=max_norm,
                                     model=par_peft.base_model.model)
    train_and_compare(ref_peft, par_peft, f"llama tp={tp} dp=2 zero1", dp=2, optimizer=optimizer, max_norm=max_norm)
    local_numel = sum(p.numel() for p in adapters)
    assert optimizer.optimizer_state_bytes() == 3 * 4 * -(-local_numel // 2)


def check_inject_lora(tp: int, tmp_dir: str, *, as_stages: bool) -> None:
    """``inject_lora`` with NxD's LoraConfig (default target_modules: peft's table) on the whole
    parallel model or on a list of stage-like submodules, against peft's inject_adapter_in_model."""
    from nxd_hf.lora import inject_lora
    from nxd_hf.modules.lora import LoraConfig as NxDLoraConfig

    targets = "all-linear" if as_stages else None  # None: peft's table (q_proj, v_proj for llama)
    config = NxDLoraConfig(enable_lora=True, lora_rank=4, lora_alpha=8, lora_dropout=0.0, lora_verbose=False,
                           target_modules=targets)
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair("llama")
    nxd_hf.parallelize(model, tensor_parallel_size=tp)
    torch.manual_seed(SEED)
    peft.inject_adapter_in_model(nxd_hf.lora.to_peft_config(config), reference)
    torch.manual_seed(SEED)
    if as_stages:  # stage-like pieces covering the model; those without targets (embedding, head) are frozen
        stages = [model.model.embed_tokens, model.model.layers[0], model.model.layers[1], model.model.norm, model.lm_head]
        inject_lora(stages, config, model_type="llama")
    else:
        inject_lora(model, config)
    adapted = {n.split(".")[-4] for n, p in model.named_parameters() if p.requires_grad}
    assert adapted == ({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} if as_stages
                       else {"q_proj", "v_proj"}), adapted
    train_and_compare(reference, model, f"inject_lora tp={tp} stages={as_stages}")
    directory = f"{tmp_dir}/injected_{as_stages}"
    nxd_hf.lora.save_adapter(model, directory)
    check_saved_adapter_loads_in_plain_peft(directory, reference)


def check_saved_adapter_loads_in_plain_peft(directory: str, reference, model_type="llama", **overrides) -> None:
    """The adapter in ``directory``, loaded by plain peft into the unsharded base model, gives the
    logits of ``reference`` (an HF model with the same adapters injected by peft)."""
    ids, _ = hf_parity.batch(seed=99)
    base, _ = hf_parity.build_pair(model_type, **overrides)
    loaded = peft.PeftModel.from_pretrained(base, directory)
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(eval_logits(loaded, ids), reference(input_ids=ids).logits, **TOL)
    reference.train()


def check_pipeline(tp: int, pp: int, tmp_dir: str) -> None:
    """inject_lora on this rank's pipeline stages (the LoRA slot of parallelize with pp > 1):
    five AdamW steps of run_train equal peft's inject_adapter_in_model on the whole model. The
    adapters start from the reference's (each stage only draws its own layers' adapters)."""
    from nxd_hf.lora import inject_lora

    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair("llama", num_hidden_layers=4)
    pp_model = nxd_hf.parallelize(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, num_microbatches=2,
                                  broadcast_and_average_loss=True)
    config = lora_config(target_modules="all-linear", init_lora_weights="gaussian")  # resolved per stage
    peft.inject_adapter_in_model(copy.deepcopy(config), reference)
    inject_lora(list(pp_model.stages.values()), copy.deepcopy(config), model_type="llama")
    ref_params = dict(reference.named_parameters())
    adapters = [(n, p) for n, p in pp_model.local_named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in n for n, _ in adapters)
    with torch.no_grad():
        for name, param in ref_params.items():
            if "lora_" in name:  # every adapter (B too) set the same on every rank
                param.copy_(0.1 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
        for name, param in adapters:
            full = ref_params[name]
            param.copy_(local_shard(param, full))
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR)
    opt = torch.optim.AdamW([p for _, p in adapters], lr=LR)
    for step in range(STEPS):
        ids, labels = hf_parity.batch(seed=20 + step, b=4)
        ref_loss = reference(input_ids=ids, labels=labels).loss
        ref_loss.backward()
        loss = pp_model.run_train(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL, msg=lambda m: f"pp={pp} step {step}: {m}")
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    for name, param in adapters:
        torch.testing.assert_close(logical(param), ref_params[name].detach(), **TOL, msg=lambda m: f"pp {name}: {m}")
    directory = f"{tmp_dir}/pp_adapter"
    nxd_hf.lora.save_adapter(pp_model, directory)  # every stage's adapters, one file
    check_saved_adapter_loads_in_plain_peft(directory, reference, num_hidden_layers=4)


RANDOM_INITS = (True, "gaussian", False)  # drawn from the default generator; the others are refused
REFUSED_INITS = ("olora", "pissa", "pissa_niter_4", "corda", "loftq", "eva", "orthogonal")


def _pipeline_init_matches(config, tmp_dir: str, what: str) -> None:
    """parallelize(pp=2, lora_config=...) from the seed plain peft's get_peft_model starts from: every
    stage's adapters equal plain peft's (no copying), three run_train steps too, and the saved adapter."""
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair("llama", num_hidden_layers=4)
    torch.manual_seed(SEED)
    ref_peft = peft.get_peft_model(reference, copy.deepcopy(config))
    after_plain = torch.get_rng_state()
    torch.manual_seed(SEED)
    pp_model = nxd_hf.parallelize(model, pipeline_parallel_size=2, num_microbatches=2, lora_config=copy.deepcopy(config),
                                  broadcast_and_average_loss=True)
    assert torch.equal(torch.get_rng_state(), after_plain), f"{what}: the generator is not where plain peft leaves it"
    ref_params = {n.removeprefix("base_model.model."): p for n, p in ref_peft.named_parameters()}
    adapters = [(n, p) for n, p in pp_model.local_named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in n for n, _ in adapters)
    ref_opt = torch.optim.AdamW([p for p in ref_peft.parameters() if p.requires_grad], lr=LR)
    opt = torch.optim.AdamW([p for _, p in adapters], lr=LR)
    for step in range(4):
        for name, param in adapters:
            torch.testing.assert_close(param, ref_params[name].detach(), **TOL, msg=lambda m: f"{what} {step} {name}: {m}")
        if step == 3:
            break
        ids, labels = hf_parity.batch(seed=20 + step, b=4)
        ref_loss = ref_peft(input_ids=ids, labels=labels).loss
        ref_loss.backward()
        loss = pp_model.run_train(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL, msg=lambda m: f"{what} step {step}: {m}")
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    nxd_hf.lora.save_adapter(pp_model, f"{tmp_dir}/{what}")
    check_saved_adapter_loads_in_plain_peft(f"{tmp_dir}/{what}", ref_peft, num_hidden_layers=4)


def check_inits_match_plain_peft(layout: str, tmp_dir: str) -> None:
    """Each init peft draws at random equals plain peft from the same seed at tp=2, pp=2 or dp=2:
    the adapters at the start and after training, and the saved adapter in plain peft; every other
    init is a ValueError naming it at setup."""
    for init in RANDOM_INITS:
        config = lora_config(target_modules=ALL_LLAMA, init_lora_weights=init)
        what = f"{layout}_init_{init}"
        if layout == "pp2":
            _pipeline_init_matches(config, tmp_dir, what)
            continue
        tp, dp = (2, 1) if layout == "tp2" else (1, 2)
        ref_peft, par_peft = peft_pair("llama", tp, config, dp=dp)
        train_and_compare(ref_peft, par_peft, what, dp=dp)
        par_peft.save_pretrained(f"{tmp_dir}/{what}")
        check_saved_adapter_loads_in_plain_peft(f"{tmp_dir}/{what}", ref_peft)
    for init in REFUSED_INITS:
        parallel_state.destroy_model_parallel()
        _, model = hf_parity.build_pair("llama")
        sizes = {"tp2": dict(tensor_parallel_size=2), "dp2": {},
                 "pp2": dict(pipeline_parallel_size=2, num_microbatches=2)}[layout]
        config = lora_config(target_modules=ALL_LLAMA)
        config.init_lora_weights = init  # set after __post_init__, which wants loftq's scipy, eva's and corda's configs
        with pytest.raises(ValueError, match=f"init_lora_weights='{init}' is not supported.*init_lora_weights=True"):
            nxd_hf.parallelize(model, lora_config=config, **sizes)



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
    config = lora_config(target_modules=ALL_LLAMA, modules_to_save=["lm_head"])
    ref_peft, par_peft = peft_pair("llama", 2, config)
    train_and_compare(ref_peft, par_peft, "llama tp=2 modules_to_save=lm_head")
    ids, _ = hf_parity.batch(seed=99)
    ref_logits = eval_logits(ref_peft, ids)
    torch.testing.assert_close(eval_logits(par_peft, ids), ref_logits, **TOL)
    rank = backend.rank()
    par_dir, plain_dir = os.path.join(tmp_dir, "parallel"), os.path.join(tmp_dir, f"plain{rank}")
    par_peft.save_pretrained(par_dir)
    ref_peft.save_pretrained(plain_dir)
    check_files_match_plain_peft(par_dir, plain_dir)

    plain_base, _ = hf_parity.build_pair("llama")
    loaded = peft.PeftModel.from_pretrained(plain_base, par_dir)
    torch.testing.assert_close(eval_logits(loaded, ids), ref_logits, **TOL)

    par_loaded = peft.PeftModel.from_pretrained(_fresh_parallel(), plain_dir)
    torch.testing.assert_close(eval_logits(par_loaded, ids), ref_logits, **TOL)
    with par_loaded.disable_adapter(), ref_peft.disable_adapter():
        base_logits = eval_logits(ref_peft, ids)
        torch.testing.assert_close(eval_logits(par_loaded, ids), base_logits, **TOL)
    assert not torch.allclose(base_logits, ref_logits, **TOL), "the trained adapter must change the logits"
    par_loaded.print_trainable_parameters()
    par_loaded.load_adapter(par_dir, adapter_name="second")  # a second adapter into the existing LoRA layers
    par_loaded.set_adapter("second")
    torch.testing.assert_close(eval_logits(par_loaded, ids), ref_logits, **TOL)
    par_loaded.delete_adapter("second")
    par_loaded.set_adapter("default")

    merged = par_loaded.merge_and_unload()
    ref_merged = ref_peft.merge_and_unload()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    merged_ref_params = dict(ref_merged.named_parameters())
    for name, param in merged.named_parameters():
        torch.testing.assert_close(logical(param), merged_ref_params[name].detach(), **TOL,
                                   msg=lambda m: f"merged {name}: {m}")
    merged.eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, ref_logits, **TOL)


def check_bad_input(tmp_dir: str) -> None:
    with pytest.raises(ValueError, match="nope"):
        peft.get_peft_model(_fresh_parallel(), lora_config(target_modules=["nope"]))
    with pytest.raises(ValueError, match="DoRA"):
        peft.get_peft_model(_fresh_parallel(), lora_config(target_modules=["q_proj"], use_dora=True))
    rank = backend.rank()
    gpt2_dir, wide_dir = os.path.join(tmp_dir, f"gpt2_{rank}"), os.path.join(tmp_dir, f"wide_{rank}")
    gpt2, _ = hf_parity.build_pair("gpt2")
    peft.get_peft_model(gpt2, lora_config(target_modules=["c_attn"])).save_pretrained(gpt2_dir)
    with pytest.raises(ValueError, match="c_attn"):
        peft.PeftModel.from_pretrained(_fresh_parallel(), gpt2_dir)
    wide, _ = hf_parity.build_pair("llama", intermediate_size=80)
    peft.get_peft_model(wide, lora_config(target_modules=["up_proj"])).save_pretrained(wide_dir)
    with pytest.raises(ValueError, match=r"up_proj.*shape"):
        peft.PeftModel.from_pretrained(_fresh_parallel(), wide_dir)
    _drop_one_key(wide_dir, hf_parity.build_pair("llama")[0])
    with pytest.raises(ValueError, match="missing"):
        peft.PeftModel.from_pretrained(_fresh_parallel(), wide_dir)


def _drop_one_key(directory: str, model) -> None:
    """Rewrite the adapter in ``directory`` for ``model``'s sizes with one tensor left out."""
    peft_model = peft.get_peft_model(model, lora_config(target_modules=["up_proj"]))
    peft_model.save_pretrained(directory)
    tensors, _, _ = _read_adapter(directory)
    from safetensors.torch import save_file

    save_file(dict(sorted(tensors.items())[1:]), os.path.join(directory, "adapter_model.safetensors"),
              metadata={"format": "pt"})


def check_save_on_one_rank_raises(tmp_dir: str) -> None:
    """save_pretrained called by rank 0 alone: a ValueError naming the missing rank, no hang."""
    io.SAVE_ARRIVAL_TIMEOUT_S = 3.0
    _, par_peft = peft_pair("llama", 2, lora_config(target_modules=["q_proj"]))
    if backend.rank() == 0:
        with pytest.raises(ValueError, match=r"every rank must call it.*\b1\b"):
            par_peft.save_pretrained(os.path.join(tmp_dir, "alone"))
    assert not os.path.exists(os.path.join(tmp_dir, "alone", "adapter_model.safetensors"))


def check_parallelize_lora_config_save_pretrained(tmp_dir: str, pp: int) -> None:
    """``parallelize(model, lora_config=...)`` (the README's first LoRA form): its
    ``save_pretrained`` writes the adapter as peft does, which plain peft loads onto the plain
    model with the parallel model's logits."""
    _, model = hf_parity.build_pair("llama")
    config = lora_config(target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
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
    "llama_kv_heads_fewer_than_tp_embedding_trained": ("llama", 4, dict(target_modules=ALL_LLAMA,
                                                                        modules_to_save=["embed_tokens"])),
    "qwen2_padded_heads_sequence_parallel": ("qwen2", 4, dict(sp=True, target_modules=ALL_LLAMA)),
    # fused [q; k; v] rows: padded query heads and replicated K/V heads in one layer
    "phi3_fused_qkv": ("phi3", 4, dict(target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])),
}


TRAINING = {**{(2, case): args for case, args in TRAINING_TP2.items()},
            **{(4, case): args for case, args in TRAINING_TP4.items()}}


@pytest.mark.parametrize("world_size, case", list(TRAINING), ids=[f"world{w}-{c}" for w, c in TRAINING])
def test_lora_training_matches_plain_peft(request, world_size, case):
    model_type, tp, kwargs = TRAINING[world_size, case]
    request.getfixturevalue(f"ranks{world_size}").run(check_training, model_type, tp, **kwargs)


def test_lora_dropout_masks_match_plain_peft_tp2(ranks2):
    ranks2.run(check_dropout_masks, 2)


@pytest.mark.parametrize("as_stages", [False, True], ids=["model", "stages"])
def test_inject_lora_tp2(ranks2, tmp_path, as_stages):
    ranks2.run(check_inject_lora, 2, str(tmp_path), as_stages=as_stages)


def test_peft_format_round_trips_and_merge(ranks2, tmp_path):
    ranks2.run(check_round_trips, str(tmp_path))


@pytest.mark.parametrize("pp", [1, 2], ids=["tp2", "pp2"])
def test_parallelize_with_lora_config_saves_a_peft_adapter(ranks2, tmp_path, pp):
    ranks2.run(check_parallelize_lora_config_save_pretrained, str(tmp_path), pp)


def test_lora_bad_input_is_a_clear_error(ranks2, tmp_path):
    ranks2.run(check_bad_input, str(tmp_path))


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_lora_inits_match_plain_peft_or_are_refused(ranks2, tmp_path, layout):
    ranks2.run(check_inits_match_plain_peft, layout, str(tmp_path))


def test_lora_zero1_tp2_dp2(ranks4):
    ranks4.run(check_zero1, 2)


def test_lora_pipeline_tp2_pp2(ranks4, tmp_path):
    ranks4.run(check_pipeline, 2, 2, str(tmp_path))


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

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
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
    run_distributed(check_save_on_one_rank_raises, 2, str(tmp_path))
