"""Expert parallelism for Llama 4's dense experts (every token through every expert): exact against
the unparallelized HF model."""

import os

import torch
import transformers
from support.moe import backward_and_step, batch, eval_logits_match, saved_as_transformers, TOL
from support.moe_ep import assert_same_states, expert_params
from support.moe_tp_ep import ADAMW

import nxd_hf
from nxd_hf import backend, parallel_state, parity


# 4 experts, top-2;
# intermediate sizes divisible by tp=2; a chunked-attention and a full-attention layer.
LLAMA4_TINY = dict(
    hidden_size=48, intermediate_size=32, intermediate_size_mlp=64, num_attention_heads=6, num_key_value_heads=2,
    head_dim=8, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, interleave_moe_layer_step=1,
    vocab_size=101, tie_word_embeddings=False, output_router_logits=False, attention_chunk_size=4,
    no_rope_layers=[1, 0], layer_types=["chunked_attention", "full_attention"],
)


def build_pair(**overrides):
    """(reference, copy to parallelize): identical fp32 weights, noise on every parameter."""
    config = transformers.Llama4TextConfig(**{**LLAMA4_TINY, **overrides})
    return parity.build_pair(config, transformers.Llama4ForCausalLM)


def _rank_batches(step: int, dp: int) -> list[tuple[torch.Tensor, ...]]:
    """Every data-parallel rank's (ids, mask, labels) of ``step``: different rows per rank."""
    return [batch(seed=10 * step + r + 1) for r in range(dp)]


def training_matches_hf(tp: int, ep: int, steps: int = 3) -> list[str]:
    """``steps`` AdamW steps at tp x ep (dp = world / tp) equal HF's on the concatenated batches:
    the data-parallel mean of the loss, every gathered gradient, then the eval logits. Returns
    the expert parameters' names."""
    parallel_state.destroy_model_parallel()
    reference, model = build_pair()
    nxd_hf.parallelize(model, tensor_parallel_size=tp, expert_parallel_size=ep)
    assert parallel_state.get_expert_parallel_size() == ep and parallel_state.get_tensor_model_parallel_size() == tp
    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    experts = expert_params(model)
    for name, param in experts.items():
        assert param.numel() * tp * ep == reference.get_parameter(name).numel(), name
        assert param.expert_logical_size == 4 and param.expert_shard_index.tolist() == [
            parallel_state.get_expert_parallel_rank() * 2 + i for i in range(2)], name
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for step in range(steps):
        batches = _rank_batches(step, dp)
        ids, mask, labels = (torch.cat(parts) for parts in zip(*batches))
        ref_out = reference(input_ids=ids, attention_mask=mask, labels=labels)
        ids, mask, labels = batches[dp_rank]
        with backend.count_comm() as records:
            out = model(input_ids=ids, attention_mask=mask, labels=labels)
            label = f"llama4_text tp={tp} ep={ep} step {step}"
            mean = out.loss.detach().clone()
            torch.distributed.all_reduce(mean, group=parallel_state.get_data_parallel_group())
            torch.testing.assert_close(mean / dp, ref_out.loss.detach(), **TOL, msg=lambda m: f"{label} loss: {m}")
            backward_and_step(model, reference, ref_out.loss, out.loss, ref_opt, opt, label)
        tags = [r.tag for r in records if r.op == "all_to_all"]
        for tag in ("ep_dispatch", "ep_combine", "ep_dispatch.backward", "ep_combine.backward"):
            assert tags.count(tag) == 2, (tag, tags)  # once per MoE layer
    eval_logits_match(model, reference)
    return sorted(experts)


def uneven_batches_match_hf() -> None:
    """EP ranks with different numbers of tokens (3 rows vs 1, the last batch of an epoch): the
    gathered gradients still equal HF's on the whole batch (sum-of-losses objective)."""
    parallel_state.destroy_model_parallel()
    reference, model = build_pair()
    nxd_hf.parallelize(model, expert_parallel_size=2)
    ids, labels = parity.make_batch(101, batch_size=4, seq_len=8, seed=5)
    device = backend.default_device()
    ids, labels = ids.to(device), labels.to(device)
    rows = slice(0, 3) if parallel_state.get_data_parallel_rank() == 0 else slice(3, 4)

    def summed(m, i, lab):
        logits = m(input_ids=i).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), lab.flatten(), reduction="sum")

    summed(reference, ids, labels).backward()
    (summed(model, ids[rows], labels[rows]) * parallel_state.get_data_parallel_size()).backward()
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(parity.gathered_grad(param), ref_params[name].grad, **TOL, msg=lambda m: f"{name}: {m}")


def checkpoint_ep2_to_ep1(path: str) -> None:
    """2 AdamW steps at ep=2, save_checkpoint (experts stored as 2 parts), load at ep=1 (dp=2):
    the gathered model and optimizer states are equal, the next step equals the uninterrupted one;
    consolidate / save_pretrained write what plain transformers loads with the same logits."""
    from nxd_hf.checkpoint import full_optimizer_state

    def build(ep):
        parallel_state.destroy_model_parallel()
        reference, model = build_pair()
        nxd_hf.parallelize(model, expert_parallel_size=ep)
        return reference, model, torch.optim.AdamW(model.parameters(), **ADAMW)

    def train(model, opt, start, steps):
        dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
        for step in range(start, start + steps):
            ids, mask, labels = _rank_batches(step, dp)[dp_rank]
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad()

    reference, model, opt = build(2)
    train(model, opt, 0, 2)
    nxd_hf.save_checkpoint(path, tag="step2", model=model, optimizer=opt)
    saved = nxd_hf.full_state_dict(model), full_optimizer_state(model, opt)
    train(model, opt, 2, 1)
    after = nxd_hf.full_state_dict(model)
    _, model, opt = build(1)
    nxd_hf.load_checkpoint(path, tag="step2", model=model, optimizer=opt)
    assert_same_states(saved, (nxd_hf.full_state_dict(model), full_optimizer_state(model, opt)), "ep2->ep1")
    train(model, opt, 2, 1)
    final = nxd_hf.full_state_dict(model)
    for name in after:
        torch.testing.assert_close(final[name], after[name], **TOL, msg=lambda m: f"{name}: {m}")
    # the ep=2 weights after 2 steps, written as transformers writes them
    parallel_state.destroy_model_parallel()
    _, model, _ = build(2)
    nxd_hf.load_checkpoint(path, tag="step2", model=model)
    reference.load_state_dict(saved[0])
    hf_dir = os.path.join(path, "hf")
    if torch.distributed.get_rank() == 0:
        reference.save_pretrained(hf_dir)
    torch.distributed.barrier()
    ids = batch(seed=4)[0]
    reference.eval()
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
    saved_as_transformers(model, path, ids, expected)


def from_pretrained_reads_local_experts(path: str, tp: int, ep: int) -> None:
    """transformers' save_pretrained (Llama 4 keeps its experts fused) -> nxd_hf.from_pretrained at
    tp x ep: the logits equal HF's, splitting the experts over EP reads exactly the bytes it saves,
    and a rank reads exactly what it holds but its vocabulary padding (at tp=2 the vocabulary of 101
    is padded to 102: the last TP rank's embedding and LM head hold a row of zeros in no file)."""
    parallel_state.destroy_model_parallel()
    reference, _ = build_pair()
    reference.eval()
    if torch.distributed.get_rank() == 0:
        reference.save_pretrained(path)
    torch.distributed.barrier()
    ids = batch(seed=7)[0]
    read, held, padding = {}, {}, {}
    for size in (1, ep):
        parallel_state.destroy_model_parallel()
        model = nxd_hf.from_pretrained(path, tensor_parallel_size=tp, expert_parallel_size=size, dtype=torch.float32)
        assert len(expert_params(model)) == (4 if size > 1 else 0)
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, **TOL)
        read[size], padding[size] = model.nxd.load_report.bytes_read, model.nxd.load_report.bytes_padding
        held[size] = sum(p.numel() * p.element_size() for p in model.parameters())
        padded_rows = {n: p for n, p in model.named_parameters() if (getattr(p, "shard_index", None) is not None
                                                                     and bool((p.shard_index < 0).any()))}
        for name, param in padded_rows.items():  # held, not read: zeros
            assert not param.index_select(param.partition_dim, (param.shard_index < 0).nonzero().flatten()).any(), name
        assert padding[size] == sum(int((p.shard_index < 0).sum()) * p.numel() // p.shape[p.partition_dim]
                                    * p.element_size() for p in padded_rows.values()), (size, padding, sorted(padded_rows))
    assert held[ep] < held[1] and read[1] - read[ep] == held[1] - held[ep], (read, held)
    assert read[ep] + padding[ep] == held[ep], (read, padding, held)
    assert (padding[ep] > 0) == (tp == 2 and parallel_state.get_tensor_model_parallel_rank() == 1), padding


def zero1_matches_hf(ep: int) -> None:
    """ZeRO-1 (AdamW, clipping acting every step) at ``ep`` (dp = world): the experts' state sharded
    over expert_data; losses, grad norms and parameters over 3 steps equal HF + AdamW + clipping."""
    from support.moe_zero1 import LR, MAX_NORM, zero1_backward, assert_step_matches, param_groups
    from nxd_hf.optim import NeuronZero1Optimizer
    from nxd_hf.parallel_layers.sharding import is_expert_parallel

    parallel_state.destroy_model_parallel()
    reference, model = build_pair()
    nxd_hf.parallelize(model, expert_parallel_size=ep)
    optimizer = NeuronZero1Optimizer(param_groups(model), torch.optim.AdamW, lr=LR, max_norm=MAX_NORM)
    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    edp = parallel_state.get_expert_data_parallel_size()
    assert any(is_expert_parallel(fg.params[0]) and fg.dp_size == edp for fg in optimizer.flat_groups)
    ref_opt = torch.optim.AdamW(param_groups(reference), lr=LR)
    ref_params = dict(reference.named_parameters())
    for step in range(3):
        batches = _rank_batches(step, dp)
        ids, mask, labels = (torch.cat(parts) for parts in zip(*batches))
        ref_loss = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad()
        ids, mask, labels = batches[dp_rank]
        loss = zero1_backward(model(input_ids=ids, attention_mask=mask, labels=labels).loss)
        optimizer.step()
        optimizer.zero_grad()
        assert_step_matches(model, optimizer, ref_params, loss, ref_loss, ref_norm, step)


def pipeline_ep_matches_hf(steps: int = 2) -> int:
    """pp=2 x ep=2 (world 4, dp=2), 2 microbatches, left-padded rows: every run_train loss, every
    gathered gradient and the parameters after ``steps`` AdamW steps equal HF's on the whole batch.
    Returns how many expert-group exchanges ran (they pair up across the group)."""
    from support.moe_pp_ep import check_exchanges_pair_up, compare_grads, padded_batch, parallelize_pp_ep
    from support.moe_pp import replica_rows
    from nxd_hf.parallel_layers.sharding import full_tensor

    parallel_state.destroy_model_parallel()
    reference, model = build_pair(num_hidden_layers=4, no_rope_layers=[1, 0, 1, 0],
                                  layer_types=["chunked_attention", "full_attention"] * 2)
    model = parallelize_pp_ep(model, num_microbatches=2)
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    exchanges = 0
    for step in range(steps):
        ids, mask, labels = padded_batch(seed=100 * step)
        want = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
        want.backward()
        with backend.count_comm() as records:
            ids_r, mask_r, labels_r = replica_rows(ids, mask, labels)
            loss = model.run_train(input_ids=ids_r, attention_mask=mask_r, labels=labels_r)
        exchanges += check_exchanges_pair_up(records)
        torch.testing.assert_close(loss, want.detach(), **TOL, msg=lambda m: f"step {step} loss: {m}")
        compare_grads(model, reference, f"llama4_text pp2 ep2 step {step}")
        for optimizer in (ref_opt, opt):
            optimizer.step()
            optimizer.zero_grad()
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(full_tensor(param), ref_params[name].detach(), **TOL, msg=lambda m: f"{name}: {m}")
    return exchanges


def test_llama4_ep2_world2_matches_hf(ranks2):
    names = ranks2.run(training_matches_hf, 1, 2)[0]
    assert len(names) == 4 and all("experts" in n for n in names), names


def test_llama4_tp2_ep2_world4_matches_hf(ranks4):
    names = ranks4.run(training_matches_hf, 2, 2)[0]
    assert len(names) == 4, names


def test_llama4_ep2_dp4_matches_hf(ranks4):
    ranks4.run(training_matches_hf, 1, 2)


def test_llama4_ep2_uneven_batches_match_hf(ranks2):
    ranks2.run(uneven_batches_match_hf)


def test_llama4_checkpoint_ep2_to_ep1_and_transformers(ranks2, tmp_path):
    ranks2.run(checkpoint_ep2_to_ep1, str(tmp_path / "ckpt"))


def test_llama4_from_pretrained_ep2_reads_local_experts(ranks2, tmp_path):
    ranks2.run(from_pretrained_reads_local_experts, str(tmp_path / "hf"), 1, 2)


def test_llama4_from_pretrained_tp2_ep2_reads_local_experts(ranks4, tmp_path):
    ranks4.run(from_pretrained_reads_local_experts, str(tmp_path / "hf"), 2, 2)


def test_llama4_zero1_ep2_world2_matches_hf(ranks2):
    ranks2.run(zero1_matches_hf, 2)


def test_llama4_zero1_ep2_dp4_matches_hf(ranks4):
    ranks4.run(zero1_matches_hf, 2)


def test_llama4_pp2_ep2_world4_matches_hf(ranks4):
    assert ranks4.run(pipeline_ep_matches_hf)[0] > 0
