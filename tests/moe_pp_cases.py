"""MoE models through the pipeline: tiny configs of each routed family and cases
comparing ``parallelize(..., pipeline_parallel_size=pp)`` with the unparallelized HF model on
the same weights and data — loss (HF's token loss plus ``router_aux_loss_coef`` times the
load-balancing loss over all layers) and gradients."""

import torch
import transformers

import nxd_hf
from nxd_hf import backend, parallel_state, parity

TOL = dict(rtol=parity.RTOL, atol=parity.ATOL)
VOCAB = 101
AUX_COEF = 0.5  # large, so a wrong aux gradient shows in every router's gradient

_ATTENTION = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                  tie_word_embeddings=False, num_hidden_layers=4, max_position_embeddings=64)
# model_type -> (config class, config kwargs): 4 experts, top-2, 4 layers (2 per stage at pp=2).
TINY_MOE = {
    "mixtral": (transformers.MixtralConfig, dict(
        _ATTENTION, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(  # per-head q/k norms, top-k not renormalized
        _ATTENTION, intermediate_size=48, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
        head_dim=8, norm_topk_prob=False)),
    "olmoe": (transformers.OlmoeConfig, dict(
        _ATTENTION, intermediate_size=24, num_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, dict(  # a gated shared expert; layer 1 dense (mlp_only_layers)
        _ATTENTION, intermediate_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=40,
        num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1])),
    "deepseek_v3": (transformers.DeepseekV3Config, dict(  # MLA, first layer dense, shared expert, routed scaling
        _ATTENTION, intermediate_size=40, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.5,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8,
        rope_interleave=True, num_key_value_heads=4)),
}
WITH_AUX = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe")  # DeepSeek-V3's HF forward adds no aux loss


def tiny_config(model_type: str, *, aux: bool = True, **overrides):
    config_cls, kwargs = TINY_MOE[model_type]
    extra = dict(output_router_logits=True, router_aux_loss_coef=AUX_COEF) if aux and model_type in WITH_AUX else {}
    return config_cls(**{**kwargs, **extra, **overrides})


def build_pair(model_type: str, *, aux: bool = True, seed: int = 0, **overrides):
    """(reference on the compute device, copy to parallelize) with identical noisy weights."""
    reference, model = parity.build_pair(tiny_config(model_type, aux=aux, **overrides), seed=seed, perturb="all")
    return reference.to(backend.default_device()), model


def moe_batch(seed: int = 1, b: int = 4, s: int = 8):
    """(ids, attention mask, labels): row 1 left-padded by 3 (masked, labels ignored)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, :3] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[0, -2:] = -100
    device = backend.default_device()
    return ids.to(device), mask.to(device), labels.to(device)


def replica_rows(*tensors):
    """This data-parallel replica's rows of each tensor (consecutive blocks)."""
    dp, rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    return [t.chunk(dp)[rank] for t in tensors]


def compare_grads(model, reference) -> int:
    """Every local parameter's gradient equals the reference's (under the same name); returns
    how many were compared."""
    ref = dict(reference.named_parameters())
    count = 0
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        ref_grad = ref[name].grad if ref[name].grad is not None else torch.zeros_like(ref[name])
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        torch.testing.assert_close(grad, ref_grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
        count += 1
    assert count > 0
    return count


def pipeline_matches_hf(model_type: str, *, pp: int = 2, num_microbatches: int = 2, schedule: str = "1f1b",
                        aux: bool = True, b: int = 4, activation_checkpoint_config=None,
                        virtual_pipeline_size: int = 1) -> None:
    """One step at pp (dp = world / pp): loss and every local gradient equal HF's on the whole batch."""
    parallel_state.destroy_model_parallel()
    reference, model = build_pair(model_type, aux=aux)
    ids, mask, labels = moe_batch(b=b)
    out = reference(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    if aux and model_type in WITH_AUX:
        assert out.aux_loss is not None and out.aux_loss.item() > 0
    model = nxd_hf.parallelize(model, pipeline_parallel_size=pp, num_microbatches=num_microbatches,
                               schedule=schedule, broadcast_and_average_loss=True,
                               activation_checkpoint_config=activation_checkpoint_config,
                               virtual_pipeline_size=virtual_pipeline_size)
    assert model.router_aux is not None if aux and model_type in WITH_AUX else model.router_aux is None
    ids_r, mask_r, labels_r = replica_rows(ids, mask, labels)
    loss = model.run_train(input_ids=ids_r, attention_mask=mask_r, labels=labels_r)
    torch.testing.assert_close(loss, out.loss.detach(), **TOL)
    compare_grads(model, reference)
    eval_loss = model.run_eval(input_ids=ids_r, attention_mask=mask_r, labels=labels_r)
    with torch.no_grad():
        torch.testing.assert_close(eval_loss, reference(input_ids=ids, attention_mask=mask, labels=labels).loss, **TOL)


def accumulation_matches_hf(model_type: str, *, pp: int = 2, steps: int = 2) -> None:
    """Gradient accumulation over ``steps`` calls (no_sync, the step's token count given), as
    transformers.Trainer accumulates: each call's loss is its token loss over the step's count
    plus its own batch's aux loss; gradients add up."""
    parallel_state.destroy_model_parallel()
    reference, model = build_pair(model_type)
    batches = [moe_batch(seed=10 + i) for i in range(steps)]
    total = sum((labels[..., 1:] != -100).sum() for _, _, labels in batches).float()
    ref_losses = []
    for ids, mask, labels in batches:
        loss = reference(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=total).loss
        loss.backward()
        ref_losses.append(loss.detach())
    model = nxd_hf.parallelize(model, pipeline_parallel_size=pp, num_microbatches=2, broadcast_and_average_loss=True)
    for i, (ids, mask, labels) in enumerate(batches):
        ids, mask, labels = replica_rows(ids, mask, labels)
        if i < steps - 1:
            with model.no_sync():
                loss = model.run_train(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=total)
        else:
            loss = model.run_train(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=total)
        torch.testing.assert_close(loss, ref_losses[i], **TOL)
    compare_grads(model, reference)


# -- LoRA on MoE models (peft): attention, dense/shared MLP, and the fused experts (target_parameters)
LORA_TARGETS = {  # model_type -> (target_modules, target_parameters)
    "mixtral": (["q_proj", "v_proj", "o_proj"], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    "qwen2_moe": (["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],  # shared expert and dense layer
                  ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    # peft maps DeepSeek-V3's per-expert names of transformers 4 (gate/up/down_proj) to the fused experts too
    "deepseek_v3": (["q_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], []),
}


def moe_lora_config(model_type: str, *, experts: bool = True):
    import peft

    modules, parameters = LORA_TARGETS[model_type]
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=modules,
                           target_parameters=parameters if experts else None)


def lora_dp_matches_peft(model_type: str, *, experts: bool = True) -> None:
    """get_peft_model(parallelize(model)) at tp=1, dp=world: five AdamW steps equal plain peft."""
    import copy

    import lora_cases
    import peft

    parallel_state.destroy_model_parallel()
    reference, model = build_pair(model_type, aux=False)
    model = nxd_hf.parallelize(model)
    dp = parallel_state.get_data_parallel_size()
    config = moe_lora_config(model_type, experts=experts)
    torch.manual_seed(7)
    ref_peft = peft.get_peft_model(reference, copy.deepcopy(config))
    torch.manual_seed(7)
    par_peft = peft.get_peft_model(model, copy.deepcopy(config))
    names = [n for n, p in par_peft.named_parameters() if p.requires_grad]
    assert not experts or any("experts" in n for n in names), "no adapter on the experts"
    lora_cases.train_and_compare(ref_peft, par_peft, f"{model_type} moe lora dp={dp}", dp=dp)


def lora_pipeline_matches_peft(model_type: str, tmp_dir: str, *, pp: int = 2, steps: int = 3) -> None:
    """parallelize(..., pipeline_parallel_size=pp, lora_config=...) with the aux loss on: ``steps``
    AdamW steps of run_train equal plain peft's get_peft_model on the whole model (the adapters
    start from the reference's: each stage draws only its own); the adapter saved from the
    stages opens in plain peft on the unparallelized model with the same logits."""
    import copy

    import lora_cases
    import peft

    parallel_state.destroy_model_parallel()
    reference, model = build_pair(model_type)
    config = moe_lora_config(model_type)
    ref_peft = peft.get_peft_model(reference, copy.deepcopy(config))
    pp_model = nxd_hf.parallelize(model, pipeline_parallel_size=pp, num_microbatches=2, lora_config=copy.deepcopy(config),
                                  broadcast_and_average_loss=True)
    ref_params = {n.removeprefix("base_model.model."): p for n, p in ref_peft.named_parameters()}
    adapters = [(n, p) for n, p in pp_model.local_named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in n for n, _ in adapters)
    extra = {n for n, _ in adapters} - {n for n, p in ref_params.items() if p.requires_grad}
    assert not extra, f"adapters plain peft does not have: {sorted(extra)[:4]}"
    with torch.no_grad():
        for name, param in ref_params.items():
            if "lora_" in name:  # B too, so that every adapter has a gradient from the first step
                param.copy_(0.1 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
        for name, param in adapters:
            param.copy_(ref_params[name])
    ref_opt = torch.optim.AdamW([p for p in ref_peft.parameters() if p.requires_grad], lr=lora_cases.LR)
    opt = torch.optim.AdamW([p for _, p in adapters], lr=lora_cases.LR)
    for step in range(steps):
        ids, mask, labels = moe_batch(seed=20 + step)
        ref_loss = ref_peft(input_ids=ids, attention_mask=mask, labels=labels).loss
        ref_loss.backward()
        ids_r, mask_r, labels_r = replica_rows(ids, mask, labels)
        loss = pp_model.run_train(input_ids=ids_r, attention_mask=mask_r, labels=labels_r)
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL, msg=lambda m: f"step {step}: {m}")
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    for name, param in adapters:
        torch.testing.assert_close(param, ref_params[name].detach(), **TOL, msg=lambda m, n=name: f"{n}: {m}")
    directory = f"{tmp_dir}/{model_type}_pp_adapter"
    nxd_hf.lora.save_adapter(pp_model, directory)  # every stage's adapters, one file
    base, _ = build_pair(model_type)
    loaded = peft.PeftModel.from_pretrained(base, directory)
    ids, mask, _ = moe_batch(seed=99)
    ref_peft.eval(), loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).logits,
                                   ref_peft(input_ids=ids, attention_mask=mask).logits, **TOL)


# -- NxDTrainer with a MoE model at pp=2 (aux loss on) against transformers.Trainer
TRAINER_COMMON = dict(max_steps=4, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], seed=7,
                      max_grad_norm=0.5, disable_tqdm=True, weight_decay=0.1, warmup_steps=1)


def trainer_dataset(n=32, s=8, seed=3):
    """Rows with an attention mask (a few left-padded rows) and labels ignoring the padding."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (s,), generator=g)
        mask = torch.ones(s, dtype=torch.long)
        mask[: i % 3] = 0
        labels = ids.clone()
        labels[mask == 0] = -100
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


def trainer_matches_hf(model_type: str, out_dir: str, *, accumulate: int = 2, pp: int = 2, lora: bool = False) -> None:
    """NxDTrainer at pp (M=2, gradient accumulation; the rest of the world data parallel) logs the
    losses and grad norms of transformers.Trainer on the whole model, with HF's aux loss in them,
    and ends with its weights. ``lora``: ``peft_config`` (the experts included) on both."""
    import peft

    parallel_state.destroy_model_parallel()
    reference, model = build_pair(model_type)  # the aux loss of the global batch at pp=1 too (moe.replica_aux)
    if lora:
        torch.manual_seed(11)  # the same adapter initialization on both sides
        reference = peft.get_peft_model(reference, moe_lora_config(model_type))
    data = trainer_dataset()
    dp = backend.world_size() // pp
    ref_args = transformers.TrainingArguments(output_dir=f"{out_dir}/ref", per_device_train_batch_size=4 * dp,
                                              gradient_accumulation_steps=accumulate, **TRAINER_COMMON)
    ref = transformers.Trainer(reference, ref_args, train_dataset=data)
    ref.train()
    layout = dict(pipeline_parallel_size=pp, num_microbatches=2) if pp > 1 else {}
    args = nxd_hf.NxDTrainingArguments(output_dir=f"{out_dir}/nxd", per_device_train_batch_size=4,
                                       gradient_accumulation_steps=accumulate, **layout, **TRAINER_COMMON)
    torch.manual_seed(11)
    ours = nxd_hf.NxDTrainer(model, args, train_dataset=data, peft_config=moe_lora_config(model_type) if lora else None)
    ours.train()
    for key in ("loss", "grad_norm"):
        got = [h[key] for h in ours.state.log_history if key in h]
        want = [h[key] for h in ref.state.log_history if key in h]
        assert len(got) == len(want) == TRAINER_COMMON["max_steps"], (key, got, want)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL, msg=lambda m, k=key: f"{k}: {m}")
    ref_params = {n.removeprefix("base_model.model."): p for n, p in ref.model.named_parameters()}
    for name, param in ours.nxd_model.named_parameters():
        torch.testing.assert_close(param, ref_params[name].detach(), **TOL, msg=lambda m, n=name: f"{n}: {m}")
        assert param.requires_grad == ref_params[name].requires_grad, name


def trainer_eval_matches_hf(model_type: str, out_dir: str) -> None:
    """NxDTrainer.evaluate at pp=2 (M=2) equals transformers.Trainer.evaluate: eval batches of 3, 3
    and 1 left-padded rows, each padded to a multiple of 2 microbatches; the added rows count in
    neither the token loss nor HF's aux loss. ``model_type`` "llama": the dense model of hf_parity."""
    import hf_parity
    import pytest

    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair("llama") if model_type == "llama" else build_pair(model_type)
    common = dict(per_device_eval_batch_size=3, report_to=[], disable_tqdm=True)
    data = trainer_dataset(n=7)
    want = transformers.Trainer(reference, transformers.TrainingArguments(output_dir=f"{out_dir}/ref", **common),
                                eval_dataset=data).evaluate()
    args = nxd_hf.NxDTrainingArguments(output_dir=f"{out_dir}/nxd", pipeline_parallel_size=2, num_microbatches=2,
                                       **common)
    ours = nxd_hf.NxDTrainer(model, args, eval_dataset=data)
    got = ours.evaluate()
    ids, mask, labels = moe_batch()
    with pytest.raises(ValueError, match="padded_rows=1 rows must have labels -100"):  # every rank, no hang
        ours.nxd_model.run_eval(input_ids=ids, attention_mask=mask, labels=labels, padded_rows=1)
    # exact for the MoE models here; the padded rows counted in the aux loss were off by 8e-5 (mixtral), 3e-4 (qwen3)
    torch.testing.assert_close(torch.tensor(got["eval_loss"]), torch.tensor(want["eval_loss"]), rtol=1e-5, atol=0)


def random_router_refused_at_pp2() -> None:
    """A router drawing random numbers in training (PhiMoE's sparsemixer; a router jitter) cannot
    route as one process does across stages: a ValueError on every rank naming it, not a wrong run."""
    import pytest

    from bench.architectures.run import tiny_config
    from nxd_hf.parity.cases import run_case

    case = run_case(tiny_config("phimoe"), tensor_parallel_size=1, pipeline_parallel_size=2)
    assert case.status == "refused" and "sparsemixer" in case.message and "pipeline_parallel_size=2" in case.message, \
        (case.status, case.message)
    _, model = build_pair("mixtral", router_jitter_noise=0.1)
    with pytest.raises(ValueError, match="jitter_noise=0.1 multiplies by random noise; each pipeline stage"):
        nxd_hf.parallelize(model, pipeline_parallel_size=2)
    _, model = build_pair("mixtral")  # no jitter: runs
    nxd_hf.parallelize(model, pipeline_parallel_size=2)
