"""MoE models through the pipeline: tiny configs of each routed family, their batches, LoRA
targets, and NxDTrainer against transformers.Trainer at pp=2 — shared by the MoE pipeline, aux-loss,
TP x EP and PP x EP tests."""

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


def trainer_matches_hf(model_type: str, out_dir: str, *, accumulate: int = 2, pp: int = 2, lora: bool = False,
                       fsdp: str = "", ep: int = 1, steps: int = TRAINER_COMMON["max_steps"]) -> None:
    """NxDTrainer at pp (M=2, gradient accumulation; the rest of the world data parallel) logs the
    losses and grad norms of transformers.Trainer on the whole model, with HF's aux loss in them,
    and ends with its weights. ``lora``: ``peft_config`` (the experts included) on both. ``fsdp``:
    NxDTrainingArguments' (ZeRO-2/3 over the DP ranks); ``ep``: expert_parallel_size; ``steps``: max_steps."""
    import peft

    from nxd_hf.fsdp import is_dp_sharded, logical_tensor

    parallel_state.destroy_model_parallel()
    reference, model = build_pair(model_type)  # the aux loss of the global batch at pp=1 too (moe.replica_aux)
    if lora:
        torch.manual_seed(11)  # the same adapter initialization on both sides
        reference = peft.get_peft_model(reference, moe_lora_config(model_type))
    data = trainer_dataset()
    dp = backend.world_size() // pp
    common = {**TRAINER_COMMON, "max_steps": steps}
    ref_args = transformers.TrainingArguments(output_dir=f"{out_dir}/ref", per_device_train_batch_size=4 * dp,
                                              gradient_accumulation_steps=accumulate, **common)
    ref = transformers.Trainer(reference, ref_args, train_dataset=data)
    ref.train()
    layout = dict(pipeline_parallel_size=pp, num_microbatches=2) if pp > 1 else {}
    layout.update(dict(fsdp=fsdp) if fsdp else {}, **(dict(expert_parallel_size=ep) if ep > 1 else {}))
    args = nxd_hf.NxDTrainingArguments(output_dir=f"{out_dir}/nxd", per_device_train_batch_size=4,
                                       gradient_accumulation_steps=accumulate, **layout, **common)
    torch.manual_seed(11)
    ours = nxd_hf.NxDTrainer(model, args, train_dataset=data, peft_config=moe_lora_config(model_type) if lora else None)
    ours.train()
    for key in ("loss", "grad_norm"):
        got = [h[key] for h in ours.state.log_history if key in h]
        want = [h[key] for h in ref.state.log_history if key in h]
        assert len(got) == len(want) == steps, (key, got, want)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL, msg=lambda m, k=key: f"{k}: {m}")
    ref_params = {n.removeprefix("base_model.model."): p for n, p in ref.model.named_parameters()}
    assert all(is_dp_sharded(p) == bool(fsdp) for p in ours.nxd_model.parameters())
    for name, param in ours.nxd_model.named_parameters():
        torch.testing.assert_close(logical_tensor(param), ref_params[name].detach(), **TOL,
                                   msg=lambda m, n=name: f"{n}: {m}")
        assert param.requires_grad == ref_params[name].requires_grad, name
