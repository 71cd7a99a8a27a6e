"""Tensor x expert parallelism training against the unparallelized HF model (experts split over EP,
each expert's intermediate dim over TP), shared by the TP x EP, LongCat and Llama 4 tests."""

import torch
from support.moe import backward_and_step, batch, build_pair, eval_logits_match, TOL

import nxd_hf
from nxd_hf import parallel_state


# Adam divides each update by its gradient's magnitude (plus eps): summing the batch in
# data-parallel parts rounds gradients differently from one process (tp=2 x dp=2 without EP, plain
# DDP too), and for entries with tiny gradients the default eps turns that rounding into steps of up
# to lr that the next steps' gradients and the logits show at ~1e-4. eps=1e-3 keeps the update a
# smooth function of the gradient; every gradient is still compared at every step.
ADAMW = dict(lr=1e-2, eps=1e-3)


def _rank_batches(step: int, dp: int) -> list[tuple[torch.Tensor, ...]]:
    """Every data-parallel rank's (ids, mask, labels) of ``step``: different rows per rank."""
    return [batch(seed=10 * step + r + 1) for r in range(dp)]


def sharded_over_tp_and_ep(model) -> list[str]:
    return [n for n, p in model.named_parameters()
            if getattr(p, "expert_parallel", False) and getattr(p, "tensor_model_parallel", False)]


def tp_ep_training_matches_hf(model_type: str, tp: int, ep: int, sp: bool, aux: bool, steps: int = 3) -> dict:
    """``steps`` AdamW steps at tp x ep (dp = world / tp) equal HF's on the concatenated batches:
    the data-parallel mean of the loss, the aux loss of the global batch (``aux``:
    output_router_logits), every gathered gradient, then the eval logits."""
    parallel_state.destroy_model_parallel()
    reference, model = build_pair(model_type, **({} if aux else {"output_router_logits": False}))
    nxd_hf.parallelize(model, tensor_parallel_size=tp, expert_parallel_size=ep, sequence_parallel=sp)
    assert parallel_state.get_expert_parallel_size() == ep and parallel_state.get_tensor_model_parallel_size() == tp
    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    both = sharded_over_tp_and_ep(model)
    for name in both:  # the last expert block may hold more (LongCat's identity-expert slots)
        param = model.get_parameter(name)
        experts = param.expert_logical_size / len(param.expert_shard_index)
        assert param.numel() * tp * experts == reference.get_parameter(name).numel(), name
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    aux_losses = []
    for step in range(steps):
        batches = _rank_batches(step, dp)
        ids, mask, labels = (torch.cat(parts) for parts in zip(*batches))
        ref_out = reference(input_ids=ids, attention_mask=mask, labels=labels)
        ids, mask, labels = batches[dp_rank]
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        label = f"{model_type} tp={tp} ep={ep} sp={sp} aux={aux} step {step}"
        mean = out.loss.detach().clone()
        torch.distributed.all_reduce(mean, group=parallel_state.get_data_parallel_group())
        torch.testing.assert_close(mean / dp, ref_out.loss.detach(), **TOL, msg=lambda m: f"{label} loss: {m}")
        if aux and getattr(ref_out, "aux_loss", None) is not None:
            torch.testing.assert_close(out.aux_loss, ref_out.aux_loss, **TOL, msg=lambda m: f"{label} aux: {m}")
            aux_losses.append(float(ref_out.aux_loss.detach()))
        backward_and_step(model, reference, ref_out.loss, out.loss, ref_opt, opt, label)
    eval_logits_match(model, reference)
    return {"both_sharded": both, "aux_losses": aux_losses}
