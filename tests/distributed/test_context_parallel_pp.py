"""Context parallelism composed with pipeline and expert parallelism, Qwen3 and the MoE
load-balancing loss, against the one-process HF model on the same weights and batch (loss,
every gathered gradient, AdamW steps with clipping)."""

import pytest
import torch

import nxd_hf
from nxd_hf.parallel_layers.grads import clip_grad_norm

from support import hf_parity

TOL = dict(rtol=1e-4, atol=1e-5)
MAX_NORM = 0.5  # below the first steps' norms: clipping scales every step


def _adamw(params):
    # Adam turns the rounding of a near-zero gradient into a step of ~lr; eps bounds that
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-4, weight_decay=0.1)


def _full(param):
    from nxd_hf.parallel_layers.sharding import full_tensor

    return full_tensor(param, param.detach())


def _check_grads(named_params, reference, label):
    ref_params = dict(reference.named_parameters())
    for name, param in named_params:
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        torch.testing.assert_close(hf_parity.gathered_grad(param, grad), ref_params[name].grad, **TOL,
                                   msg=lambda m: f"{label} {name}: {m}")


# -- world 2: Qwen3 (per-head q/k norms before rotary)


@pytest.mark.parametrize("kind", ["ring", "all_to_all"])
def test_qwen3_cp2_matches_one_process(ranks2, kind):
    from test_context_parallel import check_model

    ranks2.run(check_model, "qwen3", 2, 1, kind, num_attention_heads=4, steps=2)


# -- world 2: the MoE load-balancing loss over the whole sequence


def check_moe_aux(model_type, kind, *, steps=2, seq_len=18, masking="padding", expert_parallel_size=1):
    """Loss (token loss + coef x aux), every gradient and AdamW steps; 18 tokens: the CP split pads
    to 20, and those pad tokens (routed like any other) must stay out of the aux loss. With more
    than one replica (dp x cp), each takes its rows of the batch; the aux loss is the whole batch's."""
    from support import moe
    from nxd_hf import backend, parallel_state

    reference, model = moe.build_pair(model_type)
    assert model.config.output_router_logits
    model = nxd_hf.parallelize(model, context_parallel_size=2, context_parallel_attention=kind,
                               expert_parallel_size=expert_parallel_size)
    replicas, replica = parallel_state.get_data_parallel_replicas(), parallel_state.get_data_parallel_replica_rank()
    if expert_parallel_size > 1:  # each rank holds its share of the experts
        experts = dict(model.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"]
        assert experts.shape[0] == model.config.num_local_experts // expert_parallel_size, experts.shape
    ref_opt, opt = _adamw(reference.parameters()), _adamw(model.parameters())
    for step in range(steps):
        ids, labels = hf_parity.batch(seed=30 + step, b=2 * replicas, s=seq_len)
        inputs = dict(input_ids=ids, labels=labels)
        if masking == "padding":  # HF's aux loss leaves padding tokens out
            mask = torch.ones_like(ids)
            mask[1, :5] = 0
            labels[1, :5] = -100
            inputs["attention_mask"] = mask
        want = reference(**inputs)
        want.loss.backward()
        mine = {k: v.chunk(replicas)[replica] for k, v in inputs.items()}
        # the gradients' DP mean is the whole batch's when each replica divides by its share of the tokens
        tokens = (labels[:, 1:] != -100).sum()
        got = model(**mine, num_items_in_batch=tokens / replicas)
        got.loss.backward()
        torch.testing.assert_close(got.aux_loss, want.aux_loss.detach(), **TOL, msg=lambda m: f"step {step} aux: {m}")
        loss = backend.all_reduce(got.loss.detach().clone(), parallel_state.get_data_parallel_group())
        loss = loss / parallel_state.get_data_parallel_size()
        torch.testing.assert_close(loss, want.loss.detach(), **TOL, msg=lambda m: f"step {step} loss: {m}")
        _check_grads(model.named_parameters(), reference, f"step {step}")
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    if replicas == 1:
        reference.eval(), model.eval()
        with torch.no_grad():  # evaluation: the whole sequence's aux loss too
            want, got = reference(**inputs), model(**inputs)
        torch.testing.assert_close(got.loss, want.loss, **TOL)


@pytest.mark.parametrize("model_type, kind", [("mixtral", "ring"), ("qwen3_moe", "all_to_all")])
def test_moe_router_loss_cp2_matches_one_process(ranks2, model_type, kind):
    ranks2.run(check_moe_aux, model_type, kind)


def test_moe_router_loss_cp2_no_mask(ranks2):
    ranks2.run(check_moe_aux, "mixtral", "ring", steps=1, masking="causal")


# -- world 4 (last: one pool lives at a time, so the world-2 cases above share one): pipeline x context


def check_pipeline(kind, *, steps=3, seq_len=22, microbatches=2, masking="causal", **pp_kwargs):
    reference, model = hf_parity.build_pair("llama", num_attention_heads=4, num_hidden_layers=4)
    pp_model = nxd_hf.parallelize(model, pipeline_parallel_size=2, context_parallel_size=2,
                                  context_parallel_attention=kind, num_microbatches=microbatches,
                                  broadcast_and_average_loss=True, **pp_kwargs)
    ref_opt, opt = _adamw(reference.parameters()), _adamw(list(pp_model.local_parameters()))
    for step in range(steps):
        ids, labels = hf_parity.batch(seed=10 + step, b=4, s=seq_len)
        labels[1, :5] = -100  # ignored tokens spread unevenly over microbatches and CP chunks
        inputs = dict(input_ids=ids, labels=labels)
        if masking == "padding":
            mask = torch.ones_like(ids)
            mask[0, :4] = 0
            labels[0, :4] = -100
            inputs["attention_mask"] = mask
        elif masking == "packed":
            inputs["position_ids"] = torch.cat([torch.arange(9), torch.arange(seq_len - 9)]).expand(4, seq_len)
        ref_loss = reference(**inputs).loss
        ref_loss.backward()
        loss = pp_model.run_train(**inputs)
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL, msg=lambda m: f"step {step} loss: {m}")
        _check_grads(pp_model.local_named_parameters(), reference, f"step {step}")
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        norm = clip_grad_norm(list(pp_model.local_parameters()), MAX_NORM)
        torch.testing.assert_close(norm, ref_norm, **TOL)
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    ref_params = dict(reference.named_parameters())
    for name, param in pp_model.local_named_parameters():
        torch.testing.assert_close(_full(param), ref_params[name].detach(), **TOL, msg=lambda m: f"{name}: {m}")
    ids, labels = hf_parity.batch(seed=3, b=4, s=seq_len)
    with torch.no_grad():
        want = reference(input_ids=ids, labels=labels)
    loss, logits = pp_model.run_eval(input_ids=ids, labels=labels, return_logits=True)
    torch.testing.assert_close(loss, want.loss, **TOL)
    torch.testing.assert_close(logits, want.logits, **TOL)


@pytest.mark.parametrize("kind", ["ring", "all_to_all"])
def test_llama_pp2_cp2_matches_one_process(ranks4, kind):
    ranks4.run(check_pipeline, kind, steps=3 if kind == "ring" else 2)


def test_llama_pp2_cp2_recompute_matches_one_process(ranks4):
    ranks4.run(check_pipeline, "ring", steps=1, activation_checkpoint_config="full")


@pytest.mark.parametrize("masking", ["padding", "packed"])
def test_llama_pp2_cp2_masks_one_microbatch(ranks4, masking):
    ranks4.run(check_pipeline, "ring", masking=masking, steps=1, microbatches=1, schedule="gpipe")


def check_pipeline_moe(model_type, *, steps=2, seq_len=10, microbatches=2, padding=False, **pp_kwargs):
    """The router loss across stages and CP ranks: 10 tokens, padded to 12 by the CP split (pad
    tokens stay out of the aux loss), and with ``padding`` a padding mask as well."""
    from support import moe_pp

    reference, model = moe_pp.build_pair(model_type)
    pp_model = nxd_hf.parallelize(model, pipeline_parallel_size=2, context_parallel_size=2,
                                  num_microbatches=microbatches, broadcast_and_average_loss=True, **pp_kwargs)
    ref_opt, opt = _adamw(reference.parameters()), _adamw(list(pp_model.local_parameters()))
    for step in range(steps):
        ids, labels = hf_parity.batch(seed=40 + step, b=4, s=seq_len)
        mask = torch.ones_like(ids)
        if padding:
            mask[1, :3] = 0
            labels[1, :3] = -100
        ref_loss = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
        ref_loss.backward()
        loss = pp_model.run_train(input_ids=ids, attention_mask=mask, labels=labels)
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL, msg=lambda m: f"step {step} loss: {m}")
        _check_grads(pp_model.local_named_parameters(), reference, f"step {step}")
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()


def test_moe_pp2_cp2_router_loss_matches_one_process(ranks4):
    ranks4.run(check_pipeline_moe, "mixtral")
    ranks4.run(check_pipeline_moe, "qwen3_moe", steps=1, microbatches=1, padding=True, schedule="gpipe")


def check_pipeline_masks_refused():
    _, model = hf_parity.build_pair("llama", num_attention_heads=4, num_hidden_layers=4)
    pp_model = nxd_hf.parallelize(model, pipeline_parallel_size=2, context_parallel_size=2, num_microbatches=2)
    ids, labels = hf_parity.batch(b=4, s=12)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with pytest.raises(ValueError, match="num_microbatches=1"):
        pp_model.run_train(input_ids=ids, attention_mask=mask, labels=labels)


def check_pipeline_batches_refused():
    from nxd_hf import parallel_state

    _, model = hf_parity.build_pair("llama", num_attention_heads=4, num_hidden_layers=4)
    pp_model = nxd_hf.parallelize(model, pipeline_parallel_size=2, context_parallel_size=2, num_microbatches=2)
    ids, labels = hf_parity.batch(seed=1 + parallel_state.get_context_parallel_rank(), b=4, s=12)
    with pytest.raises(ValueError, match="got different batches"):
        pp_model.run_train(input_ids=ids, labels=labels)


def check_pipeline_model_refused():
    import transformers

    from nxd_hf import parallel_state
    from nxd_hf.pipeline.model import NxDPPModel

    _, model = hf_parity.build_pair("llama", num_attention_heads=4, num_hidden_layers=4)
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2, context_parallel_size=2)
    with pytest.raises(ValueError, match="needs a Hugging Face model parallelized by"):
        NxDPPModel(model, num_microbatches=2)  # not through parallelize: nothing splits the sequence
    _, model = hf_parity.build_pair("llama", num_attention_heads=4, num_hidden_layers=4,
                                    task_model_cls=transformers.LlamaForSequenceClassification, num_labels=3)
    with pytest.raises(ValueError, match="not sequence classification"):
        nxd_hf.parallelize(model, pipeline_parallel_size=2, context_parallel_size=2, num_microbatches=2)


def test_pp2_cp2_refuses_bad_input(ranks4):
    ranks4.run(check_pipeline_masks_refused)
    ranks4.run(check_pipeline_batches_refused)
    ranks4.run(check_pipeline_model_refused)


# -- world 4: expert x context parallelism


def test_moe_ep2_cp2_matches_one_process(ranks4):
    """World 4: two replicas of cp = 2, their experts split over ep = 2."""
    ranks4.run(check_moe_aux, "mixtral", "ring", expert_parallel_size=2)
