"""LoRA case bodies run on gloo ranks by tests/test_lora.py: a parallel peft model against plain
peft on the unsharded model built from the same weights (tests/hf_parity.py's tiny configs)."""

import copy

import peft
import pytest
import torch

import hf_parity
import nxd_hf
from nxd_hf import backend, parallel_state
from nxd_hf.parallel_layers.sharding import full_tensor, local_shard

TOL = hf_parity.TOL
STEPS = 5
LR = 1e-3  # tests/test_hf_training.py: Adam turns rounding of near-zero gradients into ~lr steps
SEED = 7
ALL_LLAMA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_config(**kwargs) -> peft.LoraConfig:
    return peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, **kwargs})


def logical(param: torch.Tensor) -> torch.Tensor:
    full = full_tensor(param)
    return full.t() if getattr(param, "hf_transposed", False) else full


def peft_pair(model_type: str, tp: int, config: peft.LoraConfig, *, sp=False, task_model_cls=None, dp=1, **overrides):
    """(plain peft model, parallel peft model) with equal base weights, same seed for the adapters."""
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair(model_type, task_model_cls=task_model_cls, **overrides)
    model = nxd_hf.parallelize(model, tensor_parallel_size=tp, sequence_parallel=sp)
    assert parallel_state.get_data_parallel_size() == dp
    torch.manual_seed(SEED)
    ref_peft = peft.get_peft_model(reference, copy.deepcopy(config))
    torch.manual_seed(SEED)
    par_peft = peft.get_peft_model(model, copy.deepcopy(config))
    return ref_peft, par_peft


def assert_adapters_equal(par_peft, ref_peft, what: str) -> None:
    ref = dict(ref_peft.named_parameters())
    trainable = [(n, p) for n, p in par_peft.named_parameters() if p.requires_grad]
    assert trainable and {n for n, _ in trainable} == {n for n, p in ref.items() if p.requires_grad}
    for name, param in trainable:
        torch.testing.assert_close(logical(param), ref[name].detach(), **TOL, msg=lambda m: f"{what} {name}: {m}")


def _loss(model, ids, labels, task: str):
    if task == "cls":
        mask = torch.ones_like(ids)
        mask[1, -2:] = 0
        return model(input_ids=ids, attention_mask=mask, labels=labels[:, 0] % 3).loss
    return model(input_ids=ids, labels=labels).loss


def train_and_compare(ref_peft, par_peft, what: str, *, task="lm", dp=1, s=8, optimizer=None, max_norm=None):
    """Five AdamW steps on both; losses each step and adapters after, equal. With dp > 1 each DP
    rank takes its half of the batch and the reference averages the halves' losses. With
    ``max_norm`` the reference clips its gradient norm (``optimizer``, e.g. ZeRO-1, clips its own)."""
    assert_adapters_equal(par_peft, ref_peft, f"{what} init")
    ref_opt = torch.optim.AdamW([p for p in ref_peft.parameters() if p.requires_grad], lr=LR)
    opt = optimizer or torch.optim.AdamW([p for p in par_peft.parameters() if p.requires_grad], lr=LR)
    dp_rank = parallel_state.get_data_parallel_rank()
    ref_norms = []
    for step in range(STEPS):
        ids, labels = hf_parity.batch(seed=20 + step, b=2 * dp, s=s)
        torch.manual_seed(1000 + step)  # equal dropout draws (dp=1)
        ref_losses = [_loss(ref_peft, i, l, task) for i, l in zip(ids.chunk(dp), labels.chunk(dp))]
        (sum(ref_losses) / dp).backward()
        torch.manual_seed(1000 + step)
        loss = _loss(par_peft, ids.chunk(dp)[dp_rank], labels.chunk(dp)[dp_rank], task)
        loss.backward()
        torch.testing.assert_close(loss, ref_losses[dp_rank], **TOL, msg=lambda m: f"{what} step {step}: {m}")
        if max_norm is not None:
            ref_norms.append(torch.nn.utils.clip_grad_norm_([p for p in ref_peft.parameters() if p.requires_grad],
                                                            max_norm))
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    assert_adapters_equal(par_peft, ref_peft, f"{what} after {STEPS} steps")
    frozen = [n for n, p in par_peft.named_parameters() if not p.requires_grad]
    assert frozen and all(par_peft.get_parameter(n).grad is None for n in frozen), "base weights got a gradient"
    if optimizer is None:
        state_ids = {id(p) for p in opt.state}
        assert state_ids == {id(p) for p in par_peft.parameters() if p.requires_grad}, "optimizer state beyond adapters"
    assert max_norm is None or max(ref_norms) > max_norm, "clipping must be active"


def eval_logits(peft_model, ids) -> torch.Tensor:
    peft_model.eval()
    with torch.no_grad():
        logits = peft_model(input_ids=ids).logits
    peft_model.train()
    return logits


def check_training(model_type: str, tp: int, *, sp=False, dp=1, task_model_cls=None, task="lm", **config_kwargs):
    config = lora_config(**config_kwargs)
    ref_peft, par_peft = peft_pair(model_type, tp, config, sp=sp, dp=dp, task_model_cls=task_model_cls)
    what = f"{model_type} tp={tp} sp={sp} dp={dp}"
    # peft's print_trainable_parameters counts the unparallelized model (padding, K/V copies, shards)
    assert par_peft.get_nb_trainable_parameters() == ref_peft.get_nb_trainable_parameters(), what
    train_and_compare(ref_peft, par_peft, what, task=task, dp=dp)
    ids, _ = hf_parity.batch(seed=99)
    ref_logits = eval_logits(ref_peft, ids)
    torch.testing.assert_close(eval_logits(par_peft, ids), ref_logits, **TOL, msg=lambda m: f"{what} logits: {m}")
    merged = par_peft.merge_and_unload()  # into the sharded (padded, replicated, Conv1D) weights
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    merged.eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, ref_logits, **TOL, msg=lambda m: f"{what} merged: {m}")


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
