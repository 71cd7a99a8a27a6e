"""The nnScaler API's parity cases, run on every rank of a pool (``tests/distributed/
test_nnscaler_core.py``): the document's examples with the modules of ``nnscaler_models``, an HF
model inside a plain module, against the unparallelized module over several optimizer steps."""

import copy
import os

import torch
import torch.nn.functional as F
from torch import nn

from nnscaler_models import LLM, TOL, Branchy, End2EndLLM, End2EndMLP
from nxd_hf import parallel_state
from nxd_hf.nnscaler import EXTRA_STATE_KEY, ComputeConfig, Plan, non_parallel_module_reducer, parallelize
from nxd_hf.parallel_layers.sharding import full_tensor, is_sharded

# Parameters are compared after AdamW steps: eps well above the gradients' rounding noise keeps the
# update linear in the gradient, so another summation order (another CPU's kernels) moves a
# parameter by about lr / eps times that noise, not by up to 2 lr as Adam's near-sign first steps can.
ADAM = dict(lr=1e-2, eps=1e-3)


def _compare(pm, ref, *, grads=True):
    """Every parameter of this rank (gathered over TP) equals the reference's, and its gradient."""
    ref_params = dict(ref.named_parameters())
    names = [n for n, _ in pm.named_parameters()]
    assert names, "no parameters on this rank"
    for name, p in pm.named_parameters():
        torch.testing.assert_close(full_tensor(p), ref_params[name].detach(), **TOL, msg=lambda m, name=name: f"{name}: {m}")
        if grads and ref_params[name].grad is None:  # unused (the HF model's embedding under inputs_embeds)
            assert p.grad is None or not p.grad.any(), name
        elif grads:
            torch.testing.assert_close(full_tensor(p, p.grad), ref_params[name].grad, **TOL, msg=lambda m, name=name: f"grad of {name}: {m}")


def _tokens(seed, batch=2, seq=8, vocab=32):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g)


def _lm_loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def llm_tp_matches(tmp, policy="tp", steps=3):
    """Example 1: the whole LLM (attention by heads, MLPs column -> row, embedding by vocab) over
    one unit of 2 ranks; losses, gradients and AdamW steps equal the plain module's; eval mode runs
    its own traced graph."""
    ref = LLM()
    x, _ = _tokens(0)
    pm = parallelize(copy.deepcopy(ref), {"x": x}, policy, ComputeConfig(2, 2), gen_savedir=tmp)
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    for step in range(steps):
        x, y = _tokens(step + 1)
        loss, ref_loss = _lm_loss(pm(x), y), _lm_loss(ref(x), y)
        torch.testing.assert_close(loss, ref_loss, **TOL)
        loss.backward()
        ref_loss.backward()
        _compare(pm, ref)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    _compare(pm, ref, grads=False)
    pm.eval(), ref.eval()
    with torch.inference_mode():
        torch.testing.assert_close(pm(x), ref(x), **TOL)
    _check_logical(pm, ref)
    return pm.plan.as_dict()


def _check_logical(pm, ref):
    """The checkpoint package's logical coordinates of this rank's tensors are the original
    module's names and whole shapes (what merged/deduped state dicts are built on)."""
    from nxd_hf.checkpoint.logical import logical_tensors

    found = {lt.name: lt.shape for lt in logical_tensors(pm)}
    want = {name: tuple(t.shape) for name, t in ref.state_dict().items()}
    assert found and all(want[name] == shape for name, shape in found.items()), (found, want)
    if pm.nxd.pp_size == 1:
        assert set(found) == set(want)


def mlp_only_policy(graph, compute_config):
    """A user policy: shard only the MLPs of the layout nxd_hf derived, replicate attention."""
    return Plan(tp_size=compute_config.plan_ngpus,
                layouts={name: lay for name, lay in graph.derived.items() if ".mlp." in name})


def custom_policy_matches(tmp):
    layouts = llm_tp_matches(tmp, policy=mlp_only_policy, steps=2)["layouts"]
    assert layouts and all(".mlp." in name for name in layouts), layouts
    bad = lambda graph, cfg: Plan(tp_size=2, layouts={"layers.0.mlp.gate": "column"})  # noqa: E731
    try:
        parallelize(LLM(), {"x": _tokens(0)[0]}, bad, ComputeConfig(2, 2), gen_savedir=tmp)
    except ValueError as e:
        assert "not exact" in str(e) and "layers.0.mlp.gate" in str(e), e
    else:
        raise AssertionError("a column without its row was accepted")


def _two_units_backward(model, ref, step):
    """Each of 2 units its own batch; the reference backpropagates the mean of the units' losses."""
    unit = parallel_state.get_data_parallel_rank()
    batches = [_tokens(10 * step + u) for u in range(2)]
    loss = _lm_loss(model(batches[unit][0]), batches[unit][1])
    ref_losses = [_lm_loss(ref(x), y) for x, y in batches]
    torch.testing.assert_close(loss, ref_losses[unit], **TOL)
    loss.backward()
    (sum(ref_losses) / 2).backward()


def llm_dp_zero_matches(tmp, steps=3):
    """dp=2 (plan_ngpus=1, runtime_ngpus=2) with use_zero: ZeRO-1 AdamW over the units; each unit
    its own batch; parameters equal the plain module trained on the mean of the units' losses."""
    from nxd_hf.optim import NeuronZero1Optimizer

    ref = LLM()
    pm = parallelize(copy.deepcopy(ref), {"x": _tokens(0)[0]}, "dp", ComputeConfig(1, 2, use_zero=True),
                     gen_savedir=tmp)
    opt = NeuronZero1Optimizer(pm.parameters(), torch.optim.AdamW, grad_clipping=False, **ADAM)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAM)
    for step in range(steps):
        _two_units_backward(pm, ref, step)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        _compare(pm, ref, grads=False)


def _e2e_samples(kind, step, n=2):
    if kind == "mlp":
        g = torch.Generator().manual_seed(step)
        return [{"data": torch.randn(4, 16, generator=g), "target": torch.rand(4, 16, generator=g)} for _ in range(n)]
    return [dict(zip(("input_ids", "labels"), _tokens(100 * step + i))) for i in range(n)]


def end2end_matches(tmp, kind="mlp", policy="pp", plan=2, runtime=2, steps=3):
    """Example 3: an end2end module (the document's End2EndMLP, or the LLM with its loss) from
    its class, pipelined (pp) or pipelined and tensor-parallel (hybrid); train_step sums the
    samples' gradients (with is_dummy_batch and scale_fn), infer_step gives the losses."""
    cls = End2EndMLP if kind == "mlp" else End2EndLLM
    ref = cls()
    first = _e2e_samples(kind, 0)[0]
    ParallelCls = parallelize(cls, {"data": first}, policy, ComputeConfig(plan, runtime, use_end2end=True),
                              gen_savedir=tmp)
    pm = ParallelCls()
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    options = [dict(), dict(is_dummy_batch=[False, True]), dict(scale_fn=lambda loss: 2 * loss)]
    for step in range(steps):
        samples, opts = _e2e_samples(kind, step + 1), options[step % len(options)]
        losses = pm.train_step(samples, **opts)
        ref_opt.zero_grad()
        ref_losses = []
        for i, sample in enumerate(samples):
            out = ref(sample)
            loss = out[0] if isinstance(out, tuple) else out
            ref_losses.append(loss.detach())
            if opts.get("is_dummy_batch", [False] * 2)[i]:
                continue
            (opts["scale_fn"](loss) if "scale_fn" in opts else loss).backward()
        dummy = opts.get("is_dummy_batch", [False] * 2)
        for i, loss in enumerate(losses):
            want = 0.0 * ref_losses[i] if dummy[i] else (2 * ref_losses[i] if "scale_fn" in opts else ref_losses[i])
            torch.testing.assert_close(loss, want, **TOL)
        _compare(pm, ref)
        opt.step(), ref_opt.step()
    _compare(pm, ref, grads=False)
    _check_logical(pm, ref)
    pm.eval()
    losses = pm.infer_step(_e2e_samples(kind, 9))
    with torch.no_grad():
        for loss, sample in zip(losses, _e2e_samples(kind, 9)):
            out = ref(sample)
            torch.testing.assert_close(loss, out[0] if isinstance(out, tuple) else out, **TOL)


class WithHFModel(nn.Module):
    """Example 2: a plain module holding an HF model parallelized on its own."""

    def __init__(self, tmp, compute_config, llama=None):
        super().__init__()
        import transformers

        torch.manual_seed(0)
        config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=4,
                                          num_key_value_heads=2, num_hidden_layers=2, vocab_size=32)
        self.pre = nn.Embedding(32, 16)
        llama = llama if llama is not None else transformers.LlamaModel(config)
        self.llama = parallelize(llama, {"inputs_embeds": torch.randn(2, 8, 16)}, "tp", compute_config,
                                 gen_savedir=tmp) if compute_config is not None else llama
        self.head = nn.Linear(16, 32)

    def forward(self, x):
        return self.head(self.llama(inputs_embeds=self.pre(x)).last_hidden_state)


def hf_pipelined_matches(tmp, steps=2):
    """An HF causal LM as an end2end module under pp=2: train_step runs its pipeline (one loss,
    the token mean over the samples) and equals the plain model on the samples' concatenation."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=32)
    ref = transformers.LlamaForCausalLM(config)
    samples = [dict(zip(("input_ids", "labels"), _tokens(i))) for i in range(2)]
    pm = parallelize(copy.deepcopy(ref), samples[0], "pp", ComputeConfig(2, 2, use_end2end=True), gen_savedir=tmp)
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(steps):
        samples = [dict(zip(("input_ids", "labels"), _tokens(10 * step + i))) for i in range(2)]
        losses = pm.train_step(samples)
        ref_loss = ref(**{k: torch.cat([s[k] for s in samples]) for k in samples[0]}).loss
        ref_loss.backward()
        assert len(losses) == 1
        torch.testing.assert_close(losses[0], ref_loss.detach(), **TOL)
        _compare(pm, ref)
        opt.step(), ref_opt.step(), ref_opt.zero_grad()


def hf_submodule_matches(tmp, steps=3):
    """Two units of tp=2: the HF model's gradients are reduced by nxd_hf, the rest's by the
    non-parallel reducer; everything equals the plain module trained on the units' mean loss."""
    ref = WithHFModel(tmp, None)
    model = WithHFModel(tmp, ComputeConfig(2, 4), llama=copy.deepcopy(ref.llama))
    model.pre.load_state_dict(ref.pre.state_dict()), model.head.load_state_dict(ref.head.state_dict())
    reducer = non_parallel_module_reducer(model)
    assert {id(p) for p in reducer.params} == {id(p) for p in (*model.pre.parameters(), *model.head.parameters())}
    seen = []  # the document's hook example: scale down before the reduction, up after it
    reducer.register_pre_hook(lambda r, grad: (seen.append("pre"), grad.div_(4)))
    reducer.register_post_hook(lambda r, grad: (seen.append("post"), grad.mul_(4)))
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(steps):
        _two_units_backward(model, ref, step)
        reducer.sync_grads()
        _compare(model, ref)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    assert any(is_sharded(p) for p in model.llama.parameters())
    # as nnScaler's: one pre and one post call per bucket and step (these parameters fill one bucket)
    assert seen[0] == "pre" and seen[-1] == "post" and len(seen) == 2 * steps


def training_flag_and_class_path(tmp):
    """A module class gives a ParallelModule class: ``init_params=True`` starts from the traced
    weights, ``module_fn``/``module_dtype`` build it; both modes of ``self.training`` match."""
    torch.manual_seed(3)
    P = parallelize(Branchy, {"x": torch.randn(2, 8, dtype=torch.float64)}, "tp", ComputeConfig(2, 2), gen_savedir=tmp,
                    module_fn=Branchy, module_dtype=torch.float64)
    assert isinstance(P, type) and issubclass(P, nn.Module)
    pm = P()
    ref = Branchy().double()
    ref.load_state_dict(P._spec.initial_state)
    assert all(p.dtype == torch.float64 for p in pm.parameters()) and is_sharded(pm.up.weight)
    x = torch.randn(3, 8, dtype=torch.float64)
    for training in (True, False):
        pm.train(training), ref.train(training)
        torch.testing.assert_close(pm(x), ref(x), **TOL)
    torch.testing.assert_close(full_tensor(pm.up.weight), ref.up.weight.detach(), **TOL)
    empty = P(init_params=False)
    assert empty.up.weight.shape == pm.up.weight.shape
    parallel_state.destroy_model_parallel()  # one layout per run: the next module is replicated (tp=1)
    replicated = parallelize(Branchy(), {"x": x.float()}, "dp", ComputeConfig(1, 2), gen_savedir=tmp,
                             instance_name="replicated")  # another plan: another instance (reuse="match")
    plain = Branchy()
    plain.load_state_dict({k: v for k, v in replicated.state_dict().items() if k != EXTRA_STATE_KEY})  # as nnScaler's
    for training in (True, False):  # the module's own forward, in the ParallelModule's mode
        replicated.train(training), plain.train(training)
        torch.testing.assert_close(replicated(x.float()), plain(x.float()), **TOL)


def refused_class_build_leaves_no_plan(tmp):
    """A module class's plan is saved once the class builds: a refused build (here parallel_state
    already at tp=1) leaves none, so the corrected rerun is not refused by reuse="match"."""
    x = torch.randn(2, 8)
    parallel_state.initialize_model_parallel(1, 1)
    P = parallelize(Branchy, {"x": x}, "tp", ComputeConfig(2, 2), gen_savedir=tmp, reuse="match")
    try:
        P()
    except ValueError as e:
        assert "the plan needs tp=2" in str(e), e
    else:
        raise AssertionError("a tp=2 plan was built on parallel_state at tp=1")
    assert not os.path.exists(os.path.join(tmp, "_", "plan.json"))
    parallelize(Branchy, {"x": x}, "dp", ComputeConfig(1, 2), gen_savedir=tmp, reuse="match")()
    assert os.path.exists(os.path.join(tmp, "_", "plan.json"))


def errors_on_every_rank(tmp):
    """A wrong runtime_ngpus, and ranks disagreeing on the config: one ValueError on every rank."""
    x = torch.randn(2, 8)
    try:
        parallelize(Branchy(), {"x": x}, "tp", ComputeConfig(2, 4), gen_savedir=tmp)
    except ValueError as e:
        assert "runtime_ngpus=4" in str(e) and "2 ranks" in str(e), e
    else:
        raise AssertionError("runtime_ngpus != world size was accepted")
    module = Branchy()
    pm = parallelize(module, {"x": x}, "tp", ComputeConfig(2, 2), gen_savedir=tmp)
    try:  # the ranks of a unit must take the same input
        pm(torch.full((2, 8), float(parallel_state_rank())))
    except ValueError as e:
        assert "bad inputs" in str(e), e
    else:
        raise AssertionError("different inputs on the ranks of a unit were accepted")
    try:
        parallelize(module, {"x": x}, "tp", ComputeConfig(2, 2), gen_savedir=tmp)
    except ValueError as e:
        assert "already parallel" in str(e), e
    else:
        raise AssertionError("a module was parallelized twice")
    config = ComputeConfig(2, 2, use_zero=parallel_state_rank() == 0)
    try:
        parallelize(Branchy(), {"x": x}, "tp", config, gen_savedir=tmp)
    except ValueError as e:
        assert "different config on different ranks" in str(e), e
    else:
        raise AssertionError("different configs on different ranks were accepted")


def parallel_state_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def init_params_false_replicas(tmp):
    """Two units, rank 1 built with ``init_params=False`` (the document's ``no_weights`` flow):
    setup does not compare the replicas' weights, which are copied from rank 0 afterwards (what
    ``broadcast_weights`` does); units built with different weights otherwise are a ValueError."""
    import torch.distributed as dist

    P = parallelize(Branchy, {"x": torch.randn(2, 8)}, "dp", ComputeConfig(1, 2), gen_savedir=tmp)
    pm = P(init_params=dist.get_rank() == 0)
    assert dist.get_rank() == 0 or not pm.up.weight.any()
    for p in pm.parameters():
        dist.broadcast(p.data, 0)
    ref = Branchy()
    ref.load_state_dict(P._spec.initial_state)
    torch.testing.assert_close(pm(torch.ones(1, 8)), ref(torch.ones(1, 8)), **TOL)
    parallel_state.destroy_model_parallel()
    torch.manual_seed(dist.get_rank())
    try:
        parallelize(Branchy(), {"x": torch.randn(2, 8)}, "dp", ComputeConfig(1, 2), gen_savedir=tmp)
    except ValueError as e:
        assert "replicas hold different weights" in str(e), e
    else:
        raise AssertionError("replicas with different weights were accepted")
