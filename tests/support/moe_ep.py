"""Tiny Mixtral- and Qwen3-MoE-shaped models for expert parallelism, their batches per rank, and
the cases several MoE test files run (NxDTrainer against transformers.Trainer, checkpoints
resharded across EP layouts)."""

import torch
import transformers

from nxd_hf import backend, parity


VOCAB = 101

# model_type -> (config class, causal-LM class, config kwargs): 4 or 8 experts, top-2, no jitter.
MOE_TINY = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB, tie_word_embeddings=False,
        router_jitter_noise=0.0, output_router_logits=False)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], vocab_size=VOCAB, tie_word_embeddings=False,
        output_router_logits=False)),
}


def config(model_type: str, **overrides):
    config_cls, _, kwargs = MOE_TINY[model_type]
    return config_cls(**{**kwargs, **overrides})


def build_pair(model_type: str, seed: int = 0, **overrides):
    """(reference, copy to parallelize) with identical fp32 weights (random norm weights)."""
    return parity.build_pair(config(model_type, **overrides), MOE_TINY[model_type][1], seed=seed, perturb="all")


def batch(seed: int = 1, b: int = 2, s: int = 8):
    ids, labels = parity.make_batch(VOCAB, batch_size=b, seq_len=s, seed=seed)
    device = backend.default_device()
    return ids.to(device), labels.to(device)


# The load-balancing loss is a product of batch means, so a data-parallel mean of it is not the
# loss of the whole batch; the configs above leave it off (its exactness across DP: test_moe_aux.py).
TOL = dict(rtol=1e-4, atol=1e-5)


def rank_batch(step: int, dp_rank: int):
    """This data-parallel rank's batch of ``step`` (2 rows; each rank the same number of labels)."""
    return batch(seed=100 * step + dp_rank)


def global_batch(step: int, dp: int):
    """Every rank's batch of ``step``, concatenated in DP-rank order (what the reference trains on)."""
    parts = [rank_batch(step, r) for r in range(dp)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def expert_params(model) -> dict:
    return {n: p for n, p in model.named_parameters() if getattr(p, "expert_parallel", False)}


def _train_steps(model, optimizer, start: int, steps: int, dp: int, dp_rank: int) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        ids, labels = rank_batch(step, dp_rank)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(float(mean) / dp)
    return losses


def _check_expert_parts(directory: str, ep: int) -> None:
    """The fused experts are stored as ``ep`` parts along the expert dim, one per expert-parallel rank."""
    import json
    import os

    with open(os.path.join(directory, "index.json")) as f:
        entries = json.load(f)["tensors"]["model"]
    entry = next(v for k, v in entries.items() if k.startswith("model.layers.0.") and k.endswith("experts.gate_up_proj"))
    parts = sorted((p["dim"], p["start"], p["stop"]) for p in entry["parts"])
    experts = entry["shape"][0]
    expected = [(0, r * experts // ep, (r + 1) * experts // ep) for r in range(ep)] if ep > 1 else [(None, 0, 0)]
    assert parts == expected, parts


def check_checkpoint_reshard(model_type: str, path: str, save_ep: int, load_ep: int, save_zero1: bool = False,
                             load_zero1: bool = False, optimizer_files: bool = False) -> None:
    """Train 2 AdamW steps at ``save_ep`` (DP = world), save_checkpoint, rebuild at ``load_ep``,
    load_checkpoint, one more step: equal to 3 uninterrupted steps; the gathered model and
    optimizer state equal at every point. ``*_zero1``: NeuronZero1Optimizer instead of AdamW;
    ``optimizer_files``: its ``save/load_sharded_state_dict`` (parameters included) instead."""
    import nxd_hf
    from nxd_hf import parallel_state
    from nxd_hf.checkpoint import full_optimizer_state
    from nxd_hf.optim import NeuronZero1Optimizer

    def build(ep, zero1=save_zero1):
        parallel_state.destroy_model_parallel()
        _, model = build_pair(model_type)
        nxd_hf.parallelize(model, expert_parallel_size=ep)
        if zero1:
            return model, NeuronZero1Optimizer(model.parameters(), torch.optim.AdamW, grad_clipping=False, lr=1e-2)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = build(save_ep)
    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    first = _train_steps(model, opt, 0, 2, dp, dp_rank)
    if optimizer_files:
        opt.save_sharded_state_dict(path)
    else:
        nxd_hf.save_checkpoint(path, tag="step2", model=model, optimizer=opt)
        _check_expert_parts(f"{path}/step2", save_ep)
    saved = nxd_hf.full_state_dict(model), full_optimizer_state(model, opt)
    uninterrupted = _train_steps(model, opt, 2, 1, dp, dp_rank)
    after = nxd_hf.full_state_dict(model)
    model, opt = build(load_ep, load_zero1)
    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    if optimizer_files:
        opt.load_sharded_state_dict(path)
    else:
        nxd_hf.load_checkpoint(path, tag="step2", model=model, optimizer=opt)
    assert_same_states(saved, (nxd_hf.full_state_dict(model), full_optimizer_state(model, opt)))
    resumed = _train_steps(model, opt, 2, 1, dp, dp_rank)
    assert len(first) == 2
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(uninterrupted), **TOL)
    final = nxd_hf.full_state_dict(model)
    for name in after:
        torch.testing.assert_close(final[name], after[name], **TOL, msg=lambda m: f"{name}: {m}")


def assert_same_states(saved: tuple[dict, ...], loaded: tuple[dict, ...], what: str = "") -> None:
    """Gathered (model, optimizer) states equal exactly, under the same names."""
    for a, b in zip(saved, loaded):
        assert set(a) == set(b), set(a) ^ set(b)
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=lambda m: f"{what} {name}: {m}")


def _dataset(n=24, s=8, seed=3):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (s,), generator=g)
        labels = ids.clone()
        labels[: i % 4] = -100  # a different number of ignored tokens per sample
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def check_trainer_matches(model_type: str, out_dir: str, ep: int, accumulate: int = 1, zero_1: bool = False,
                          aux_loss: bool = False, tp: int = 1) -> None:
    """NxDTrainer at ``ep`` (and ``tp``; DP = world / tp) logs the losses and grad norms of
    transformers.Trainer on the single-process model (AdamW, weight decay, clipping, warmup) and
    ends with its parameters. ``zero_1``: NxDTrainer with ZeRO-1; ``aux_loss``: both models add the
    load-balancing loss."""
    import transformers

    import nxd_hf
    from nxd_hf import parallel_state
    from nxd_hf.parallel_layers.sharding import full_tensor

    parallel_state.destroy_model_parallel()
    aux = dict(output_router_logits=True, router_aux_loss_coef=0.5) if aux_loss else {}  # large: errors show
    reference, model = build_pair(model_type, **aux)
    common = dict(max_steps=4, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], seed=7,
                  max_grad_norm=0.5, disable_tqdm=True, weight_decay=0.1, warmup_steps=1,
                  gradient_accumulation_steps=accumulate)
    dp = torch.distributed.get_world_size() // tp
    data = _dataset()
    ref = transformers.Trainer(reference, transformers.TrainingArguments(
        output_dir=f"{out_dir}/ref", per_device_train_batch_size=2 * dp, **common), train_dataset=data)
    ref.train()
    args = nxd_hf.NxDTrainingArguments(output_dir=f"{out_dir}/nxd", per_device_train_batch_size=2,
                                       expert_parallel_size=ep, zero_1=zero_1, tensor_parallel_size=tp, **common)
    ours = nxd_hf.NxDTrainer(model, args, train_dataset=data)
    ours.train()
    assert parallel_state.get_expert_parallel_size() == ep and parallel_state.get_tensor_model_parallel_size() == tp
    from nxd_hf.optim import NeuronZero1Optimizer
    assert isinstance(getattr(ours.optimizer, "optimizer", ours.optimizer), NeuronZero1Optimizer) == zero_1
    for key in ("loss", "grad_norm"):
        got = [h[key] for h in ours.state.log_history if key in h]
        want = [h[key] for h in ref.state.log_history if key in h]
        assert len(got) == len(want) == 4, (key, got, want)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL, msg=lambda m: f"{key}: {m}")
    assert ours.state.total_flos == ref.state.total_flos > 0  # every expert counted once, as on one process
    ref_params = dict(ref.model.named_parameters())
    for name, param in ours.nxd_model.named_parameters():
        torch.testing.assert_close(full_tensor(param), ref_params[name].detach(), **TOL, msg=lambda m: f"{name}: {m}")
