"""nnScaler API parity pieces shared by test_nnscaler_core.py and test_nnscaler_samples.py: the
document's End2End examples against the unparallelized module, token batches, the comparison of
logical (gathered) parameters and gradients."""

import torch
import torch.nn.functional as F
from torch import nn

from nxd_hf import parallel_state
from nxd_hf.nnscaler import ComputeConfig, EXTRA_STATE_KEY, parallelize
from nxd_hf.parallel_layers.sharding import full_tensor, is_sharded
from support.nnscaler_models import Branchy, End2EndLLM, End2EndMLP, TOL


def compare_logical(pm, ref, *, grads=True):
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


def token_batch(seed, batch=2, seq=8, vocab=32):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g)


def lm_loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def check_logical(pm, ref):
    """The checkpoint package's logical coordinates of this rank's tensors are the original
    module's names and whole shapes (what merged/deduped state dicts are built on)."""
    from nxd_hf.checkpoint.logical import logical_tensors

    found = {lt.name: lt.shape for lt in logical_tensors(pm)}
    want = {name: tuple(t.shape) for name, t in ref.state_dict().items()}
    assert found and all(want[name] == shape for name, shape in found.items()), (found, want)
    if pm.nxd.pp_size == 1:
        assert set(found) == set(want)


def _e2e_samples(kind, step, n=2):
    if kind == "mlp":
        g = torch.Generator().manual_seed(step)
        return [{"data": torch.randn(4, 16, generator=g), "target": torch.rand(4, 16, generator=g)} for _ in range(n)]
    return [dict(zip(("input_ids", "labels"), token_batch(100 * step + i))) for i in range(n)]


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
        compare_logical(pm, ref)
        opt.step(), ref_opt.step()
    compare_logical(pm, ref, grads=False)
    check_logical(pm, ref)
    pm.eval()
    losses = pm.infer_step(_e2e_samples(kind, 9))
    with torch.no_grad():
        for loss, sample in zip(losses, _e2e_samples(kind, 9)):
            out = ref(sample)
            torch.testing.assert_close(loss, out[0] if isinstance(out, tuple) else out, **TOL)


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
