"""Checkpoints of experts sharded over TP and EP at once, shared by test_moe_tp_ep.py and
test_moe_longcat_ep.py: save_checkpoint at tp2 x ep2 resharded to other layouts with one more step
equal to the uninterrupted run, from_pretrained reading only the local experts' local rows of
transformers' per-expert files, save_pretrained and consolidate loading in plain transformers."""

import json
import os

import torch
from support.moe import eval_logits_of, build_pair, saved_as_transformers, TOL, VOCAB
from support.moe_ep import assert_same_states
from support.moe_tp_ep import ADAMW

import nxd_hf
from nxd_hf import parallel_state
from nxd_hf.checkpoint import full_optimizer_state


def _global_batch(step: int, rows: int = 4, seq: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Every label counts, so each data-parallel split of the rows has the global mean as its mean."""
    ids = torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(500 + step))
    return ids, ids.clone()


def _steps(model, optimizer, steps: range) -> list[float]:
    """AdamW steps on this data-parallel rank's rows of each global batch; the global mean losses."""
    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    losses = []
    for step in steps:
        ids, labels = (t.chunk(dp)[dp_rank] for t in _global_batch(step))
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean, group=parallel_state.get_data_parallel_group())
        losses.append(float(mean) / dp)
    return losses


def _build(model_type: str, tp: int, ep: int, zero_1: bool):
    from nxd_hf.optim import NeuronZero1Optimizer

    parallel_state.destroy_model_parallel()
    _, model = build_pair(model_type, output_router_logits=False)
    nxd_hf.parallelize(model, tensor_parallel_size=tp, expert_parallel_size=ep)
    if zero_1:
        return model, NeuronZero1Optimizer(model.parameters(), torch.optim.AdamW, grad_clipping=False, **ADAMW)
    return model, torch.optim.AdamW(model.parameters(), **ADAMW)


def _boxes(directory: str) -> list:
    """The parts of the first MoE layer's fused gate_up_proj: ((experts), (dim, rows)) per part."""
    with open(os.path.join(directory, "index.json")) as f:
        entries = json.load(f)["tensors"]["model"]
    entry = entries[min(k for k in entries if k.endswith("experts.gate_up_proj"))]
    return sorted(((p["start"], p["stop"]), tuple(p.get("inner") or ())) for p in entry["parts"])


def checkpoint_reshards(model_type: str, path: str, save_layout: tuple[int, int],
                        load_layouts: list[tuple[int, int]], zero_1: bool = False) -> list:
    """2 AdamW steps at ``save_layout`` (tp, ep), save_checkpoint, a 3rd step (uninterrupted); then
    for each (tp, ep) of ``load_layouts`` a fresh model loads it: weights and optimizer state
    gathered equal exactly, and one more step equals the uninterrupted one. Returns the saved parts
    of one experts tensor. ``zero_1``: NeuronZero1Optimizer and its save/load_sharded_state_dict."""
    model, opt = _build(model_type, *save_layout, zero_1)
    _steps(model, opt, range(2))
    if zero_1:
        opt.save_sharded_state_dict(path)
    else:
        nxd_hf.save_checkpoint(path, tag="step2", model=model, optimizer=opt)
    saved = nxd_hf.full_state_dict(model), full_optimizer_state(model, opt)
    uninterrupted = _steps(model, opt, range(2, 3))
    after = nxd_hf.full_state_dict(model)
    for tp, ep in load_layouts:
        model, opt = _build(model_type, tp, ep, zero_1)
        if zero_1:
            opt.load_sharded_state_dict(path)
        else:
            nxd_hf.load_checkpoint(path, tag="step2", model=model, optimizer=opt)
        assert_same_states(saved, (nxd_hf.full_state_dict(model), full_optimizer_state(model, opt)), f"tp{tp} ep{ep}")
        resumed = _steps(model, opt, range(2, 3))
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(uninterrupted), **TOL)
        final = nxd_hf.full_state_dict(model)
        for name in after:
            torch.testing.assert_close(final[name], after[name], **TOL, msg=lambda m: f"tp{tp} ep{ep} {name}: {m}")
    return [] if zero_1 else _boxes(f"{path}/step2")


def _real_bytes(param: torch.Tensor) -> int:
    """The bytes of ``param``'s real rows (not the zero padding of a vocab split unevenly over TP)."""
    size = param.numel() * param.element_size()
    if getattr(param, "tensor_model_parallel", False):
        size = size * int((param.shard_index >= 0).sum()) // len(param.shard_index)
    return size


def pretrained_round_trip_at_tp2_ep2(model_type: str, tmp: str) -> dict:
    """transformers' save_pretrained -> nxd_hf.from_pretrained at tp2 x ep2: same logits, each rank
    reads exactly its own bytes (its experts' TP rows); save_pretrained and save_checkpoint +
    consolidate write transformers' names, which plain transformers loads with the same logits."""
    reference, _ = build_pair(model_type)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(4))
    expected = eval_logits_of(reference, ids)
    hf_dir = os.path.join(tmp, "hf")
    if torch.distributed.get_rank() == 0:
        reference.save_pretrained(hf_dir)
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    model = nxd_hf.from_pretrained(hf_dir, tensor_parallel_size=2, expert_parallel_size=2, dtype=torch.float32)
    both = [n for n, p in model.named_parameters()
            if getattr(p, "expert_parallel", False) and getattr(p, "tensor_model_parallel", False)]
    assert both, "the experts must be sharded over TP and EP"
    torch.testing.assert_close(eval_logits_of(model, ids), expected, **TOL)
    local = sum(_real_bytes(p) for p in model.parameters()) + sum(  # and persistent buffers (DeepSeek's score bias)
        b.numel() * b.element_size() for m in model.modules() for n, b in m._buffers.items()
        if b is not None and n not in m._non_persistent_buffers_set)
    read = model.nxd.load_report.bytes_read
    saved_as_transformers(model, tmp, ids, expected)
    whole = sum(p.numel() * p.element_size() for p in reference.parameters())
    return {"bytes_read": read, "local_bytes": local, "whole_bytes": whole}
