"""Small real modules for the nnScaler API (``tests/distributed/test_nnscaler_core.py``): an
LLM-like stack of attention + MLP blocks in plain torch, the document's End2EndMLP, an HF model
inside a plain module, and the parity cases run on the rank pool."""

import torch
import torch.nn.functional as F
from torch import nn

TOL = dict(rtol=1e-4, atol=1e-5)


class Attention(nn.Module):
    def __init__(self, d_model=16, n_heads=4, n_kv_heads=2):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d_model // n_heads
        self.q = nn.Linear(d_model, n_heads * self.head_dim)
        self.k = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)  # a key bias has a zero gradient
        self.v = nn.Linear(d_model, n_kv_heads * self.head_dim)
        self.o = nn.Linear(n_heads * self.head_dim, d_model)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


class ManualAttention(nn.Module):
    """matmul -> scale -> causal mask -> softmax -> matmul, and a dropout only in training."""

    def __init__(self, d_model=16, n_heads=4):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.qkv_q, self.qkv_v = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.qkv_k = nn.Linear(d_model, d_model, bias=False)  # a key bias has a zero gradient (AdamW would amplify noise)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q = self.qkv_q(x).view(b, s, self.n_heads, -1).permute(0, 2, 1, 3)
        k = self.qkv_k(x).view(b, s, self.n_heads, -1).permute(0, 2, 1, 3)
        v = self.qkv_v(x).view(b, s, self.n_heads, -1).permute(0, 2, 1, 3)
        scores = torch.matmul(q, k.transpose(-2, -1)) / self.head_dim ** 0.5
        mask = x.new_ones(s, s, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        probs = F.softmax(scores, dim=-1)
        if self.training:
            probs = probs * 1.0
        out = torch.matmul(probs, v).transpose(1, 2).contiguous().view(b, s, d)
        return self.proj(out)


class MLP(nn.Module):
    def __init__(self, d_model=16, hidden=32):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d_model, hidden), nn.Linear(d_model, hidden), nn.Linear(hidden, d_model)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, d_model=16, manual=False):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = ManualAttention(d_model) if manual else Attention(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class LLM(nn.Module):
    """Embedding, blocks, norm, head: the document's ``LLM``; ``forward(x)`` gives logits."""

    def __init__(self, vocab=32, d_model=16, layers=2):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(Block(d_model, manual=i % 2 == 1) for i in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


class End2EndLLM(LLM):
    """The LLM with its loss: ``forward(data)`` -> (loss, logits)."""

    def forward(self, data):
        logits = super().forward(data["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), data["labels"].flatten())
        return loss, logits


class End2EndMLP(nn.Module):
    """The document's Example 3."""

    def __init__(self):
        torch.manual_seed(0)
        super().__init__()
        self.layers = torch.nn.ModuleList([])
        for _ in range(8):
            self.layers.append(nn.Linear(16, 16, bias=False))
        self.loss_fn = nn.BCELoss()

    def forward(self, data):
        x = data["data"]
        for layer in self.layers:
            x = layer(x)
        x = torch.sigmoid(x)
        return self.loss_fn(x, data["target"])


# -- parity cases (run on every rank of a pool) ------------------------------------------------

import copy  # noqa: E402

from nxd_hf import parallel_state  # noqa: E402
from nxd_hf.nnscaler import ComputeConfig, Plan, non_parallel_module_reducer, parallelize  # noqa: E402
from nxd_hf.parallel_layers.sharding import full_tensor, is_sharded  # noqa: E402


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
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
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
    opt = NeuronZero1Optimizer(pm.parameters(), torch.optim.AdamW, lr=1e-2, grad_clipping=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
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
    assert seen[0] == "pre" and seen[-1] == "post" and len(seen) == 2 * steps * len(reducer.params)


class Branchy(nn.Module):
    """``self.training`` changes the computation (nnScaler's limited support: one graph per mode)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = F.gelu(self.up(x))
        if self.training:
            h = h * 0.5
        return self.down(h)


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
    replicated = parallelize(Branchy(), {"x": x.float()}, "dp", ComputeConfig(1, 2), gen_savedir=tmp)
    plain = Branchy()
    plain.load_state_dict(replicated.state_dict())
    for training in (True, False):  # the module's own forward, in the ParallelModule's mode
        replicated.train(training), plain.train(training)
        torch.testing.assert_close(replicated(x.float()), plain(x.float()), **TOL)


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
    parallelize(module, {"x": x}, "tp", ComputeConfig(2, 2), gen_savedir=tmp)
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


# -- the reference document's samples (tests/distributed/test_reference_samples.py) -------------

def sample_parallelize_module_class(tmp):
    """Line 19 (Example 1): ``parallelize(LLM, {'x': llm_sample_input}, pas_policy, compute_config)``
    gives a class; its instance infers like the plain LLM."""
    llm_sample_input = torch.randint(0, 32, (2, 8))
    pas_policy = "tp"
    compute_config = ComputeConfig(plan_ngpus=2, runtime_ngpus=2, use_zero=False)
    ParallelizedLLM = parallelize(LLM, {"x": llm_sample_input}, pas_policy, compute_config, gen_savedir=tmp)
    model, ref = ParallelizedLLM(), LLM()

    def infer(model, x):
        model.eval()
        with torch.inference_mode():
            return model(x)

    torch.testing.assert_close(infer(model, llm_sample_input), infer(ref, llm_sample_input), **TOL)


class HeavyModule(MLP):
    pass


class SubmoduleLLM(nn.Module):
    """Line 49 (Example 2): ``__init__`` parallelizes a submodule; the rest stays plain."""

    def __init__(self, tmp=None):
        super().__init__()
        torch.manual_seed(1)
        self.embed, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)
        heavy = HeavyModule()
        if tmp is not None:
            heavy_module_sample_input = torch.randn(2, 8, 16)
            compute_config = ComputeConfig(plan_ngpus=2, runtime_ngpus=2, use_zero=False)
            heavy = parallelize(heavy, {"x": heavy_module_sample_input}, "tp", compute_config, gen_savedir=tmp)
        self.heavy_module = heavy

    def forward(self, x):
        return self.head(self.heavy_module(self.embed(x)))


def sample_parallelize_submodule(tmp):
    model, ref = SubmoduleLLM(tmp), SubmoduleLLM()
    x, y = _tokens(5)
    loss, ref_loss = _lm_loss(model(x), y), _lm_loss(ref(x), y)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    loss.backward(), ref_loss.backward()
    non_parallel_module_reducer(model).sync_grads()
    _compare(model, ref)


def sample_end2end_pipelined(tmp):
    """Line 116 (Example 3): the End2EndMLP with dict samples, pipelined, train_step/infer_step."""
    end2end_matches(tmp, "mlp", "pp", 2, 2, steps=2)


def sample_parallelize_signature(tmp):
    """Line 243: ``parallelize``'s parameters, in order, with the document's defaults."""
    import inspect

    params = inspect.signature(parallelize).parameters
    assert list(params) == ["module_or_module_class", "dummy_forward_args", "pas_policy", "compute_config",
                            "gen_savedir", "reuse", "instance_name", "load_module", "module_dtype", "module_fn",
                            "init_module_params", "broadcast_strategy"]
    defaults = {k: p.default for k, p in params.items() if p.default is not p.empty}
    assert str(defaults.pop("reuse")).lower().endswith("match")
    assert defaults == {"gen_savedir": "./.nnscaler", "instance_name": None, "load_module": True,
                        "module_dtype": None, "module_fn": None, "init_module_params": True,
                        "broadcast_strategy": "none"}


def sample_init_params(tmp):
    """Line 381: ``ParallelModule.__init__(init_params=True)``."""
    training_flag_and_class_path(tmp)


def sample_train_step(tmp):
    """Lines 391 and 415: ``train_step(samples, is_dummy_batch, scale_fn)`` and ``infer_step``."""
    import inspect

    from nxd_hf.nnscaler import ParallelModule

    assert list(inspect.signature(ParallelModule.train_step).parameters) == [
        "self", "samples", "is_dummy_batch", "scale_fn"]
    assert list(inspect.signature(ParallelModule.infer_step).parameters) == ["self", "samples"]
    end2end_matches(tmp, "mlp", "tp", 2, 2, steps=3)


def sample_distributed_sampler(tmp):
    """Line 505: the sampler over units (``rank // plan_ngpus`` of ``runtime // plan`` replicas)
    feeds the ranks of a unit the same batch: nxd_hf's data-parallel rank is that unit index."""
    import torch.distributed as dist

    compute_config = ComputeConfig(2, 4)
    parallelize(Branchy(), {"x": torch.randn(2, 8)}, "tp", compute_config, gen_savedir=tmp)
    dataset = list(range(16))
    sampler = torch.utils.data.DistributedSampler(
        dataset=dataset, num_replicas=compute_config.runtime_ngpus // compute_config.plan_ngpus,
        rank=dist.get_rank() // compute_config.plan_ngpus, shuffle=False)
    assert dist.get_rank() // compute_config.plan_ngpus == parallel_state.get_data_parallel_rank()
    mine = list(sampler)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    tp_peers = parallel_state.get_tensor_model_parallel_group(as_list=True)
    for group in tp_peers:
        assert all(everyone[r] == everyone[group[0]] for r in group)
    assert everyone[0] != everyone[2]
