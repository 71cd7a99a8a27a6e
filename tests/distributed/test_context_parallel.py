"""Context parallelism (nxd_hf.context) against one process: the attention functions against
SDPA on the whole sequence (outputs and q/k/v gradients), and parallelized HF models against
the plain model on the same weights and batch (loss, every gathered gradient, AdamW steps)."""

import pytest
import torch
import torch.nn.functional as F

import nxd_hf
from nxd_hf import parallel_state
from nxd_hf.context.attention import register
from nxd_hf.context.ring import RingAttention
from nxd_hf.context.split import ContextBatch, documents, local_index, split_sequence
from nxd_hf.context.ulysses import all_to_all_attention

from support import hf_parity

TOL = dict(rtol=1e-4, atol=1e-5)


# -- the attention functions


def _reference_mask(seq_len, doc, key_valid):
    index = torch.arange(seq_len)
    mask = (index[:, None] >= index[None, :])[None]
    if doc is not None:
        mask = mask & (doc[:, :, None] == doc[:, None, :])
    if key_valid is not None:
        mask = mask & key_valid[:, None, :]
    return mask


def _inputs(heads, kv_heads, seq_len, masking):
    torch.manual_seed(0)
    b, d = 2, 8
    q = torch.randn(b, heads, seq_len, d)
    k, v = torch.randn(b, kv_heads, seq_len, d), torch.randn(b, kv_heads, seq_len, d)
    weight = torch.randn(b, heads, seq_len, d)
    doc = key_valid = None
    if masking == "packed":  # row 0: documents of 5, 7 and the rest; row 1: one document
        positions = torch.stack([torch.cat([torch.arange(5), torch.arange(7), torch.arange(seq_len - 12)]),
                                 torch.arange(seq_len)])
        doc = documents(positions)
    elif masking == "padding":  # left padding of 3 tokens in row 0
        key_valid = torch.ones(b, seq_len, dtype=torch.bool)
        key_valid[0, :3] = False
    mask = _reference_mask(seq_len, doc, key_valid)
    sees = mask.any(-1)  # queries that see no key (padding) are left out of the comparison
    weight = weight * sees[:, None, :, None]
    return (q, k, v, weight), doc, key_valid, mask | ~sees[..., None], sees


def check_attention(kind, cp, heads, kv_heads, masking, seq_len=24):
    parallel_state.initialize_model_parallel(context_parallel_size=cp)
    (q, k, v, weight), doc, key_valid, ref_mask, sees = _inputs(heads, kv_heads, seq_len, masking)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    rep = heads // kv_heads
    ref_out = F.scaled_dot_product_attention(ref[0], ref[1].repeat_interleave(rep, 1), ref[2].repeat_interleave(rep, 1),
                                             attn_mask=ref_mask[:, None], scale=0.3)
    (ref_out * weight).sum().backward()

    rank = parallel_state.get_context_parallel_rank()
    batch = ContextBatch(seq_len=seq_len, num_tokens=seq_len, cp_rank=rank, cp_size=cp, doc=doc, key_valid=key_valid)
    local = [split_sequence(t, rank, cp, dim=2).requires_grad_() for t in (q, k, v)]
    group = parallel_state.get_context_parallel_group()
    if kind == "ring":
        out = RingAttention.apply(*local, batch, 0.3, group)
    else:
        out = all_to_all_attention(*local, batch, 0.3, group)
    (out * split_sequence(weight, rank, cp, dim=2)).sum().backward()

    seen = split_sequence(sees, rank, cp, dim=1)[:, None, :, None]
    torch.testing.assert_close(out * seen, split_sequence(ref_out, rank, cp, dim=2) * seen, **TOL)
    for name, mine, theirs in zip("qkv", local, ref):
        torch.testing.assert_close(mine.grad, split_sequence(theirs.grad, rank, cp, dim=2), **TOL,
                                   msg=lambda m: f"d{name}: {m}")


def check_comm_bytes(kind, cp, heads=4, kv_heads=2, seq_len=32, d=8):
    """Attention's bytes per rank against the formulas (fp32, b=2, local s = seq_len / cp):
    ring, forward (cp-1) K/V hops, backward (cp-1) K/V and cp dK/dV hops; all-to-all, forward
    Q, K, V and the output once each, backward their gradients once each."""
    from nxd_hf.backend import count_comm

    parallel_state.initialize_model_parallel(context_parallel_size=cp)
    (q, k, v, weight), doc, key_valid, _, _ = _inputs(heads, kv_heads, seq_len, "causal")
    rank = parallel_state.get_context_parallel_rank()
    batch = ContextBatch(seq_len=seq_len, num_tokens=seq_len, cp_rank=rank, cp_size=cp)
    local = [split_sequence(t, rank, cp, dim=2).requires_grad_() for t in (q, k, v)]
    group = parallel_state.get_context_parallel_group()
    with count_comm() as records:
        if kind == "ring":
            out = RingAttention.apply(*local, batch, 0.3, group)
        else:
            out = all_to_all_attention(*local, batch, 0.3, group)
        (out * split_sequence(weight, rank, cp, dim=2)).sum().backward()
    kv_bytes = 2 * local[1].numel() * 4  # K and V of this rank
    q_bytes = local[0].numel() * 4
    if kind == "ring":
        want = (cp - 1) * kv_bytes + (cp - 1) * kv_bytes + cp * kv_bytes
    else:
        want = 2 * (2 * q_bytes + kv_bytes)
    got = sum(r.payload_bytes for r in records)
    assert got == want, (kind, cp, got, want)
    return got / want


@pytest.mark.parametrize("kind", ["ring", "all_to_all"])
def test_attention_comm_bytes_match_formula(ranks2, kind):
    assert ranks2.run(check_comm_bytes, kind, 2) == [1.0, 1.0]


def test_context_groups_nearest_to_tp():
    from nxd_hf.parallel_sizes import ParallelSizes
    from nxd_hf.parallel_state import rank_lists

    lists = rank_lists(ParallelSizes.for_world(8, tp=2, cp=2))
    assert lists["context"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert lists["data"] == [[0, 2, 4, 6], [1, 3, 5, 7]]  # gradients are averaged over dp x cp
    with pytest.raises(ValueError, match="context_parallel_size"):
        rank_lists(ParallelSizes.for_world(6, tp=2, cp=2))


def test_load_balanced_split_holds_both_ends():
    assert local_index(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert local_index(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert sorted(torch.cat([local_index(16, r, 4) for r in range(4)]).tolist()) == list(range(16))


def test_documents_of_packed_rows():
    two = torch.cat([torch.arange(3), torch.arange(2)]).expand(2, 5)  # two documents in every row
    assert documents(two).tolist() == [[0, 0, 0, 1, 1]] * 2
    assert documents(torch.arange(5).expand(2, 5)) is None


@pytest.mark.parametrize("kind", ["ring", "all_to_all"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 4), (2, 1)])
@pytest.mark.parametrize("masking", ["causal", "packed", "padding"])
def test_attention_matches_sdpa_cp2(ranks2, kind, heads, kv_heads, masking):
    ranks2.run(check_attention, kind, 2, heads, kv_heads, masking)


def test_ring_attention_any_head_count_cp2(ranks2):
    ranks2.run(check_attention, "ring", 2, 3, 3, "causal")


def check_tiled_ring(masking):
    from nxd_hf.context import ring

    tile, ring.TILE = ring.TILE, 4  # blocks of 6 tokens: tiles of 4 and 2, some fully masked
    try:
        check_attention("ring", 2, 4, 2, masking)
    finally:
        ring.TILE = tile


def test_ring_attention_query_tiles_cp2(ranks2):
    ranks2.run(check_tiled_ring, "packed")
    ranks2.run(check_tiled_ring, "padding")


# -- parallelized HF models


def _adamw(params):
    # Adam turns the rounding of a near-zero gradient into a step of ~lr; eps bounds that
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-4, weight_decay=0.1)


def check_model(model_type, cp, tp, kind, *, masking="causal", seq_len=22, steps=3, sp=False, sharding=None,
                **overrides):
    reference, model = hf_parity.build_pair(model_type, **overrides)
    nxd_hf.parallelize(model, tensor_parallel_size=tp, context_parallel_size=cp, context_parallel_attention=kind,
                       sequence_parallel=sp, data_parallel_sharding=sharding)
    ids, labels = hf_parity.batch(b=2, s=seq_len)
    inputs = dict(input_ids=ids, labels=labels)
    if masking == "padding":  # left padding in row 0: HF's positions stay 0..S-1 in training
        mask = torch.ones_like(ids)
        mask[0, :4] = 0
        labels = labels.clone()
        labels[0, :4] = -100
        inputs = dict(input_ids=ids, labels=labels, attention_mask=mask)
    elif masking == "packed":
        positions = torch.cat([torch.arange(9), torch.arange(seq_len - 9)]).expand(2, seq_len)
        # without a cache: HF reads packed documents from the positions only then (with one it
        # attends across them, and so does the CP model)
        inputs = dict(input_ids=ids, labels=labels, position_ids=positions, use_cache=False)
    ref_opt, opt = _adamw(reference.parameters()), _adamw(model.parameters())
    ref_params = dict(reference.named_parameters())
    for step in range(steps):
        ref_loss = reference(**inputs).loss
        ref_loss.backward()
        loss = model(**inputs).loss
        loss.backward()
        torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m: f"step {step} loss: {m}")
        if step == 0:
            for name, param in model.named_parameters():
                torch.testing.assert_close(_full(param, param.grad), ref_params[name].grad, **TOL,
                                           msg=lambda m: f"step {step} {name}: {m}")
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    for name, param in model.named_parameters():
        torch.testing.assert_close(_full(param), ref_params[name].detach(), **TOL, msg=lambda m: f"{name}: {m}")
    reference.eval(), model.eval()
    with torch.no_grad():  # evaluation: the whole sequence's logits, in order, on every CP rank
        inputs.pop("labels")
        want, got = reference(**inputs).logits, model(**inputs).logits
    if masking == "padding":  # padding queries see nothing: their outputs are arbitrary
        want, got = want[inputs["attention_mask"].bool()], got[inputs["attention_mask"].bool()]
    torch.testing.assert_close(got, want, **TOL)


def _full(param, tensor=None):
    """The logical tensor (``param``'s, or e.g. its grad): gathered over FSDP's DP shards and TP."""
    from nxd_hf.fsdp import logical_tensor

    return logical_tensor(param, (param if tensor is None else tensor).detach())


@pytest.mark.parametrize("kind", ["ring", "all_to_all"])
def test_llama_cp2_matches_one_process(ranks2, kind):
    ranks2.run(check_model, "llama", 2, 1, kind, num_attention_heads=4)


@pytest.mark.parametrize("sharding", ["zero3", "zero2"])
def test_llama_cp2_fsdp_matches_one_process(ranks2, sharding):
    """FSDP2 over the data-parallel group, which holds the CP ranks (their gradients are partial
    sums scaled as for a mean over dp, as without FSDP)."""
    ranks2.run(check_model, "llama", 2, 1, "ring", sharding=sharding, num_attention_heads=4)


@pytest.mark.parametrize("kind", ["ring", "all_to_all"])
@pytest.mark.parametrize("masking", ["padding", "packed"])
def test_llama_cp2_masks_match_one_process(ranks2, masking, kind):
    ranks2.run(check_model, "llama", 2, 1, kind, masking=masking, steps=1, num_attention_heads=4)


def test_qwen2_cp2_matches_one_process(ranks2):
    ranks2.run(check_model, "qwen2", 2, 1, "all_to_all", num_attention_heads=4, steps=2)


def check_moe(model_type, kind):
    from support import moe

    reference, model = moe.build_pair(model_type, output_router_logits=False)
    nxd_hf.parallelize(model, context_parallel_size=2, context_parallel_attention=kind)
    ids, labels = hf_parity.batch(b=2, s=20)
    ref_loss = reference(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, **TOL)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(hf_parity.gathered_grad(param), ref_params[name].grad, **TOL,
                                   msg=lambda m: f"{name}: {m}")


def test_mixtral_cp2_matches_one_process(ranks2):
    ranks2.run(check_moe, "mixtral", "ring")


# -- refusals


def check_refusal(kind, overrides, match, **parallel):
    _, model = hf_parity.build_pair("llama", **overrides)
    with pytest.raises(ValueError, match=match):
        nxd_hf.parallelize(model, context_parallel_attention=kind, **parallel)


def test_all_to_all_refuses_heads_not_divisible(ranks2):
    ranks2.run(check_refusal, "all_to_all", dict(num_attention_heads=3, num_key_value_heads=1), "not divisible",
               context_parallel_size=2)


def test_context_parallel_refuses_bad_input(ranks2):
    ranks2.run(check_refusal, "sideways", {}, "context_parallel_attention must be", context_parallel_size=2)
    # pp x cp is world 4 at least: a world of 2 cannot hold it
    ranks2.run(check_refusal, "ring", {}, "context_parallel_size", context_parallel_size=2, pipeline_parallel_size=2)


def check_different_batches_refused():
    _, model = hf_parity.build_pair("llama")
    nxd_hf.parallelize(model, context_parallel_size=2)
    ids, labels = hf_parity.batch(seed=1 + parallel_state.get_context_parallel_rank(), b=2, s=8)
    with pytest.raises(ValueError, match="got different batches"):
        model(input_ids=ids, labels=labels)


def test_cp_ranks_given_different_batches_refused(ranks2):
    ranks2.run(check_different_batches_refused)


def test_registered_in_attention_interface():
    from transformers import AttentionInterface

    register()
    assert {"nxd_cp_ring", "nxd_cp_all_to_all"} <= set(AttentionInterface._global_mapping)


# -- generation: unsplit on every CP rank


def check_generate(kind):
    from transformers import DynamicCache

    reference, model = hf_parity.build_pair("llama", num_attention_heads=4)
    nxd_hf.parallelize(model, context_parallel_size=2, context_parallel_attention=kind)
    ids, labels = hf_parity.batch(seed=4, b=2, s=7)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding, as generation pads
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    reference.eval(), model.eval()
    want = reference.generate(input_ids=ids, attention_mask=mask, **settings)
    got = model.generate(input_ids=ids, attention_mask=mask, **settings)
    assert torch.equal(got, want), (got, want)
    with torch.no_grad():  # the model has its context-parallel attention back
        torch.testing.assert_close(model(input_ids=ids, labels=labels).loss,
                                   reference(input_ids=ids, labels=labels).loss, **TOL)
        with pytest.raises(ValueError, match="model.generate"):
            model(input_ids=ids, cache=DynamicCache(config=model.config))


@pytest.mark.parametrize("kind", ["ring", "all_to_all"])
def test_generate_cp2_matches_hf(ranks2, kind):
    ranks2.run(check_generate, kind)


# -- NxDTrainer: the user splits nothing


def _dataset(n=12, s=14, seed=3):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(0, hf_parity.VOCAB, (s,), generator=g)
        labels = ids.clone()
        labels[: i % 4] = -100  # a different number of ignored tokens per sample
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def check_trainer(kind, steps=4, both=None, **layout):
    """NxDTrainer at cp=2 against Trainer in one process; ``both``: arguments of both trainers."""
    import tempfile

    import transformers

    import test_nxd_trainer
    from nxd_hf.parallel_layers.sharding import full_tensor

    common = dict(max_steps=steps, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], seed=7,
                  max_grad_norm=0.5, disable_tqdm=True, weight_decay=0.1, warmup_steps=1, adam_epsilon=1e-4,
                  **(both or {}))
    reference, model = hf_parity.build_pair("llama", num_attention_heads=4)
    from nxd_hf import backend

    replicas = backend.world_size() // (2 * layout.get("tensor_parallel_size", 1))
    with tempfile.TemporaryDirectory() as out_dir:
        ref_args = test_nxd_trainer.one_process_reference_args(
            output_dir=f"{out_dir}/ref", per_device_train_batch_size=4 * replicas, **common)
        ref = transformers.Trainer(reference, ref_args, train_dataset=_dataset())
        ref.train()
        args = nxd_hf.NxDTrainingArguments(output_dir=f"{out_dir}/nxd", per_device_train_batch_size=4,
                                           context_parallel_size=2, context_parallel_attention=kind, **common,
                                           **layout)
        ours = nxd_hf.NxDTrainer(model, args, train_dataset=_dataset())
        ours.train()
        held_out = _dataset(n=4, seed=9)
        want, got = ref.predict(held_out), ours.predict(held_out)
        evaluated = ours.evaluate(held_out), ref.evaluate(held_out)
    assert evaluated[0]["eval_loss"] == pytest.approx(evaluated[1]["eval_loss"], rel=1e-4)
    torch.testing.assert_close(torch.as_tensor(got.predictions), torch.as_tensor(want.predictions), **TOL)
    assert got.metrics["test_loss"] == pytest.approx(want.metrics["test_loss"], rel=1e-4)
    for key in ("loss", "grad_norm"):
        got = [h[key] for h in ours.state.log_history if key in h]
        want = [h[key] for h in ref.state.log_history if key in h]
        assert len(got) == len(want) == steps, (key, got, want)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL, msg=lambda m: f"{key}: {m}")
    ref_params = dict(ref.model.named_parameters())
    for name, param in ours.nxd_model.named_parameters():
        torch.testing.assert_close(full_tensor(param), ref_params[name].detach(), **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["ring", "all_to_all"])
def test_nxd_trainer_cp2_matches_trainer(ranks2, kind):
    ranks2.run(check_trainer, kind)


def test_nxd_trainer_cp2_zero1_recompute_label_smoothing_matches_trainer(ranks2):
    ranks2.run(check_trainer, "ring", steps=3, both=dict(label_smoothing_factor=0.1), zero_1=True,
               gradient_checkpointing=True)


# -- LoRA


def check_lora(kind, steps=3):
    import copy

    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    reference, model = hf_parity.build_pair("llama", num_attention_heads=4)
    model = nxd_hf.parallelize(model, context_parallel_size=2, context_parallel_attention=kind)
    torch.manual_seed(7)
    ref_peft = peft.get_peft_model(reference, copy.deepcopy(config))
    torch.manual_seed(7)
    par_peft = peft.get_peft_model(model, copy.deepcopy(config))
    ref_opt = _adamw([p for p in ref_peft.parameters() if p.requires_grad])
    opt = _adamw([p for p in par_peft.parameters() if p.requires_grad])
    for step in range(steps):
        ids, labels = hf_parity.batch(seed=20 + step, b=2, s=20)
        ref_loss = ref_peft(input_ids=ids, labels=labels).loss
        ref_loss.backward()
        loss = par_peft(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m: f"step {step} loss: {m}")
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    ref = dict(ref_peft.named_parameters())
    trainable = [(n, p) for n, p in par_peft.named_parameters() if p.requires_grad]
    assert trainable
    for name, param in trainable:
        torch.testing.assert_close(_full(param), ref[name].detach(), **TOL, msg=lambda m: f"{name}: {m}")


def test_lora_cp2_matches_peft(ranks2):
    ranks2.run(check_lora, "ring")


# -- world 4 (last: one pool lives at a time, so the world-2 cases above share one)


@pytest.mark.parametrize("kind", ["ring", "all_to_all"])
def test_attention_matches_sdpa_cp4(ranks4, kind):
    ranks4.run(check_attention, kind, 4, 4, 4, "packed", seq_len=32)
    ranks4.run(check_attention, kind, 4, 8, 4, "padding", seq_len=32)


def test_llama_tp2_cp2_matches_one_process(ranks4):
    ranks4.run(check_model, "llama", 2, 2, "ring", steps=2)
    ranks4.run(check_model, "llama", 2, 2, "ring", steps=1, sp=True)
    ranks4.run(check_model, "llama", 2, 2, "all_to_all", num_attention_heads=8, num_key_value_heads=2, steps=1)


def test_llama_dp4_cp2_zero3_matches_one_process(ranks4):
    """Two replicas of two CP ranks, ZeRO-3 over all four (the same batch on both replicas)."""
    ranks4.run(check_model, "llama", 2, 1, "all_to_all", sharding="zero3", num_attention_heads=4, steps=2)


def test_llama_cp4_matches_one_process(ranks4):
    ranks4.run(check_model, "llama", 4, 1, "ring", steps=2, seq_len=30)
    ranks4.run(check_model, "llama", 4, 1, "all_to_all", steps=1, seq_len=30, num_attention_heads=4,
               num_key_value_heads=4)


def test_nxd_trainer_dp2_cp2_matches_trainer(ranks4):
    ranks4.run(check_trainer, "ring", steps=2)
