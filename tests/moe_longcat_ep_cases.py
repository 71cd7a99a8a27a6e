"""Expert parallelism for LongCat-Flash (issue 24): routed experts split over the expert group,
identity ("zero") experts kept on the token's own rank, exact against the unparallelized HF model.
Run by tests/distributed/test_moe_longcat_ep.py at ep=2 (world 2) and tp2 x ep2 (world 4)."""

import os

import torch
import transformers

import nxd_hf
from moe_cases import TOL, VOCAB, _logits, backward_and_step, batch, eval_logits_match, saved_as_transformers
from moe_tp_ep_cases import ADAMW
from nxd_hf import parallel_state, parity

# 4 routed experts (2 per rank at ep=2) and 2 identity experts, top-2: random routing sends some
# assignments to identity experts (counted by the cases below, so a test cannot pass without them).
LONGCAT = dict(hidden_size=32, num_layers=1, num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
               ffn_hidden_size=32, expert_ffn_hidden_size=16, n_routed_experts=4, zero_expert_num=2, moe_topk=2,
               q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, head_dim=8, v_head_dim=8,
               routed_scaling_factor=2.0, tie_word_embeddings=False)


def build_pair(seed: int = 0):
    return parity.build_pair(transformers.LongcatFlashConfig(**LONGCAT), transformers.LongcatFlashForCausalLM,
                             seed=seed)


def _identity_hits(model) -> list[int]:
    """A forward hook counting, per call, the assignments routed to identity experts."""
    hits = []

    def hook(module, _inputs, output):
        hits.append(int((output[2] >= module.n_routed_experts - (module.config_zero or 0)).sum()))
    for module in model.modules():
        if type(module).__name__ == "LongcatFlashTopkRouter":
            module.config_zero = LONGCAT["zero_expert_num"]
            module.register_forward_hook(hook)
    return hits


def training_matches_hf(tp: int, ep: int, steps: int = 3) -> dict:
    """``steps`` AdamW steps at tp x ep (dp = world / tp; each replica its own rows) equal HF's on the
    concatenated batches: the DP-mean loss, every gathered gradient, then the eval logits."""
    parallel_state.destroy_model_parallel()
    reference, model = build_pair()
    hits = _identity_hits(reference)
    nxd_hf.parallelize(model, tensor_parallel_size=tp, expert_parallel_size=ep)
    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    experts = {n: p for n, p in model.named_parameters() if getattr(p, "expert_parallel", False)}
    assert sorted(n.rsplit(".", 1)[1] for n in experts) == ["down_proj", "gate_up_proj"], list(experts)
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for step in range(steps):
        batches = [batch(seed=10 * step + r + 1) for r in range(dp)]
        ids, mask, labels = (torch.cat(parts) for parts in zip(*batches))
        ref_out = reference(input_ids=ids, attention_mask=mask, labels=labels)
        ids, mask, labels = batches[dp_rank]
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        label = f"longcat_flash tp={tp} ep={ep} step {step}"
        mean = out.loss.detach().clone()
        torch.distributed.all_reduce(mean, group=parallel_state.get_data_parallel_group())
        torch.testing.assert_close(mean / dp, ref_out.loss.detach(), **TOL, msg=lambda m: f"{label} loss: {m}")
        backward_and_step(model, reference, ref_out.loss, out.loss, ref_opt, opt, label)
    eval_logits_match(model, reference)
    shapes = {n.rsplit(".", 1)[1]: tuple(p.shape) for n, p in experts.items()}
    return {"identity_hits": sum(hits), "shapes": shapes, "ep_rank": parallel_state.get_expert_parallel_rank()}


def _steps(model, optimizer, steps: range) -> list[float]:
    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    losses = []
    for step in steps:
        ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(500 + step)).chunk(dp)[dp_rank]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean, group=parallel_state.get_data_parallel_group())
        losses.append(float(mean) / dp)
    return losses


def _build(tp: int, ep: int):
    parallel_state.destroy_model_parallel()
    _, model = build_pair()
    nxd_hf.parallelize(model, tensor_parallel_size=tp, expert_parallel_size=ep)
    return model, torch.optim.AdamW(model.parameters(), **ADAMW)


def checkpoint_reshards(path: str, save: tuple[int, int], loads: list[tuple[int, int]]) -> None:
    """2 AdamW steps at ``save`` (tp, ep), save_checkpoint, a 3rd step; each (tp, ep) of ``loads``
    loads it: model and AdamW state gathered equal exactly, one more step equals the uninterrupted run."""
    from moe_ep_cases import assert_same_states
    from nxd_hf.checkpoint import full_optimizer_state

    model, opt = _build(*save)
    _steps(model, opt, range(2))
    nxd_hf.save_checkpoint(path, tag="step2", model=model, optimizer=opt)
    saved = nxd_hf.full_state_dict(model), full_optimizer_state(model, opt)
    uninterrupted = _steps(model, opt, range(2, 3))
    after = nxd_hf.full_state_dict(model)
    for tp, ep in loads:
        model, opt = _build(tp, ep)
        nxd_hf.load_checkpoint(path, tag="step2", model=model, optimizer=opt)
        assert_same_states(saved, (nxd_hf.full_state_dict(model), full_optimizer_state(model, opt)), f"tp{tp} ep{ep}")
        torch.testing.assert_close(torch.tensor(_steps(model, opt, range(2, 3))), torch.tensor(uninterrupted), **TOL)
        final = nxd_hf.full_state_dict(model)
        for name in after:
            torch.testing.assert_close(final[name], after[name], **TOL, msg=lambda m: f"tp{tp} ep{ep} {name}: {m}")


def pretrained_round_trip(tmp: str, tp: int, ep: int) -> None:
    """transformers' save_pretrained -> nxd_hf.from_pretrained at tp x ep: same logits; save_pretrained
    and save_checkpoint + consolidate write transformers' names, loading in plain transformers."""
    reference, _ = build_pair()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(4))
    expected = _logits(reference, ids)
    hf_dir = os.path.join(tmp, "hf")
    if torch.distributed.get_rank() == 0:
        reference.save_pretrained(hf_dir)
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    model = nxd_hf.from_pretrained(hf_dir, tensor_parallel_size=tp, expert_parallel_size=ep, dtype=torch.float32)
    assert any(getattr(p, "expert_parallel", False) for p in model.parameters())
    torch.testing.assert_close(_logits(model, ids), expected, **TOL)
    saved_as_transformers(model, tmp, ids, expected)
