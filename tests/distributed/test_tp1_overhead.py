"""Nothing for nothing at tp=1: one forward + backward of a parallelized tiny
llama on one rank dispatches no cast, copy or other aten op beyond the plain HF model's, a whole
training step (clipping and AdamW included) one cast more, and it adds no gradient hook, no
per-module hook and next to no Python work."""

import collections
import cProfile
import pstats

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import nxd_hf
from nxd_hf import parallel_state
from nxd_hf.testing import run_distributed
from support import hf_parity


COPIES = ("aten.to", "aten._to_copy", "aten.copy_", "aten.clone", "aten.contiguous")


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count_ops(model, ids, labels) -> collections.Counter:
    with OpCounter() as counter:
        model(input_ids=ids, labels=labels).loss.backward()
    return counter.counts


def tp1_op_counts(dtype: str = "float32", lora: bool = False) -> tuple[dict, dict]:
    """(plain HF counts, parallelized tp=1 counts) of one forward + backward, warm (second call)."""
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair("llama", attention_bias=False, mlp_bias=False)
    reference, model = reference.to(getattr(torch, dtype)), model.to(getattr(torch, dtype))
    nxd_hf.parallelize(model, tensor_parallel_size=1, check_inputs=False)
    if lora:
        import peft

        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
        reference, model = peft.get_peft_model(reference, config), peft.get_peft_model(model, config)
    ids, labels = hf_parity.batch()
    result = []
    for m in (reference, model):
        count_ops(m, ids, labels)
        m.zero_grad(set_to_none=True)
        result.append(dict(count_ops(m, ids, labels)))
    return tuple(result)


VIEWS = ("aten.view", "aten._unsafe_view")  # the same reshape, named by who asked (flatten vs view)


def check_no_extra_work() -> None:
    """At tp=1 (one rank) nxd_hf's layers, loss and gradient path dispatch no aten op that the
    plain model does not: per op no more calls (the view kinds counted together), fp32, bf16 and
    bf16 with LoRA (fp32 adapters)."""
    for dtype, lora in (("float32", False), ("bfloat16", False), ("bfloat16", True)):
        plain, par = tp1_op_counts(dtype, lora)
        extra = {op: (plain.get(op, 0), n) for op, n in par.items() if op not in VIEWS and n > plain.get(op, 0)}
        assert not extra, f"{dtype} lora={lora}: ops beyond plain HF (plain, nxd_hf): {extra}"
        views = sum(par.get(op, 0) for op in VIEWS), sum(plain.get(op, 0) for op in VIEWS)
        assert views[0] == views[1], f"{dtype} lora={lora}: views {views}"


def _python_calls(step) -> int:
    profile = cProfile.Profile()
    profile.runcall(step)
    return sum(v[1] for v in pstats.Stats(profile).stats.values())


def _train_step(model, clip):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    ids, labels = hf_parity.batch()

    def step():
        model(input_ids=ids, labels=labels).loss.backward()
        clip(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def check_no_host_work_per_parameter() -> None:
    """As on a GPU (no heap trims): no tensor hook on any parameter and no forward hook below the
    model but its head's, the weights after two steps equal plain HF's, and a step makes at most
    1.2x plain HF's Python calls (here 1,985 against 1,880; 3,119 = 1.66x when every forward walked
    the parameters, hooked each gradient and clipping looked up five attributes per parameter).
    An extra reduction added later hooks the gradients again."""
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair("llama", attention_bias=False, mlp_bias=False)
    nxd_hf.parallelize(model, tensor_parallel_size=1)
    model.nxd.grad_reduction.release_host_memory = False
    steps = [_train_step(reference, torch.nn.utils.clip_grad_norm_),
             _train_step(model, nxd_hf.parallel_layers.clip_grad_norm)]
    for step in steps:
        step()
    calls = [_python_calls(step) for step in steps]
    hooked = [name for name, p in model.named_parameters() if p._backward_hooks]
    assert not hooked, f"gradient hooks at tp=1: {hooked}"
    with_hooks = [name for name, m in model.named_modules()
                  if name not in ("", "lm_head") and (m._forward_pre_hooks or m._forward_hooks)]
    assert not with_hooks, f"forward hooks at tp=1: {with_hooks}"
    assert calls[1] <= 1.2 * calls[0], f"Python calls per step: plain HF {calls[0]}, nxd_hf {calls[1]}"
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, ref_params[name], **hf_parity.TOL, msg=lambda m: f"{name}: {m}")
    reduced = []
    model.nxd.grad_reduction.add_reduction(lambda: reduced.append(1))
    steps[1]()
    assert reduced == [1] and all(p._backward_hooks for p in model.parameters())


def check_whole_step_ops() -> None:
    """A whole bf16 step (forward, backward, clipping at 1.0, AdamW) of nxd_hf at tp=1 against
    plain HF with torch's clip_grad_norm_: per op no more calls, but one cast (the clipping
    coefficient, computed from an fp32 norm, to the bf16 gradients' dtype)."""
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair("llama", attention_bias=False, mlp_bias=False)
    reference, model = reference.to(torch.bfloat16), model.to(torch.bfloat16)
    nxd_hf.parallelize(model, tensor_parallel_size=1, check_inputs=False)
    model.nxd.grad_reduction.release_host_memory = False
    counts = []
    for step in (_train_step(reference, torch.nn.utils.clip_grad_norm_),
                 _train_step(model, nxd_hf.parallel_layers.clip_grad_norm)):
        step()
        with OpCounter() as counter:
            step()
        counts.append(counter.counts)
    plain, par = counts
    allowed = {"aten._to_copy": 1}
    extra = {op: (plain.get(op, 0), n) for op, n in par.items()
             if op not in VIEWS and n > plain.get(op, 0) + allowed.get(op, 0)}
    assert not extra, f"a whole step: ops beyond plain HF (plain, nxd_hf): {extra}"


def check_tp1() -> None:
    check_no_extra_work()
    check_whole_step_ops()
    check_no_host_work_per_parameter()


def test_tp1_dispatches_no_more_ops_than_plain_hf():
    run_distributed(check_tp1, 1)  # one rank: tp=1 and dp=1, as one GPU
