"""The fused loss: cross-entropy from the hidden states in chunks, the LM head
fused in, equal to F.cross_entropy of the full logits at tp=1 and vocab-parallel at tp=2."""

import itertools

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import nxd_hf
from nxd_hf import parallel_state
from nxd_hf.parallel_layers import softmax_kernels
from nxd_hf.parallel_layers.fused_loss import fused_linear_cross_entropy
from nxd_hf.parallel_layers.sharding import shard_from_full
from support import hf_parity

hf_parity.TINY["gemma2"] = (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(
    hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2,
    head_dim=8, query_pre_attn_scalar=8, vocab_size=hf_parity.VOCAB, sliding_window=4,
    layer_types=["sliding_attention", "full_attention"],
    final_logit_softcapping=2.0))  # low enough to bend the tiny model's logits (30 would barely touch them)


TOL = dict(rtol=1e-4, atol=1e-5)
VOCAB, HIDDEN = 11, 16  # 11: padded to 12 at tp=2


def _rows(tp: int, rank: int) -> torch.Tensor:
    per = -(-VOCAB // tp)
    rows = torch.arange(rank * per, (rank + 1) * per)
    return rows.masked_fill(rows >= VOCAB, -1)  # padding rows


def check_function(smoothing: float, reduction: str, chunk_tokens: int, kernel: str = "torch",
                   softcap: float | None = None) -> None:
    """Loss, hidden-state and weight gradients against F.cross_entropy on the full logits, with
    ignored labels and chunks that do not divide the tokens; ``softcap``: of the logits capped as
    Gemma's forward caps them (logits of about 2.5 standard deviation, capped at 3: well inside
    the tanh's curve)."""
    tp, rank = parallel_state.get_tensor_model_parallel_size(), parallel_state.get_tensor_model_parallel_rank()
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 7, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) / 2
    labels = torch.randint(0, VOCAB, (2, 7), generator=g)
    labels[0, 1] = labels[1, 6] = -100
    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_logits = F.linear(ref_h, ref_w)
    if softcap:
        ref_logits = torch.tanh(ref_logits / softcap) * softcap
    ref = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), label_smoothing=smoothing, reduction=reduction)
    (ref * 1.7).backward()
    rows = _rows(tp, rank)
    local_w = shard_from_full(weight, 0, rows).clone().requires_grad_()  # padding rows zero
    h = hidden.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h, local_w, labels, vocab_size=VOCAB, label_smoothing=smoothing,
                                      reduction=reduction, chunk_tokens=chunk_tokens, kernel=kernel, softcap=softcap)
    (loss * 1.7).backward()
    torch.testing.assert_close(loss, ref, **TOL)
    grad_h = h.grad.clone()
    torch.distributed.all_reduce(grad_h, group=parallel_state.get_tensor_model_parallel_group())  # the head's region
    torch.testing.assert_close(grad_h, ref_h.grad, **TOL)
    torch.testing.assert_close(local_w.grad, shard_from_full(ref_w.grad, 0, rows), **TOL)
    with torch.no_grad():
        torch.testing.assert_close(fused_linear_cross_entropy(hidden, local_w, labels, vocab_size=VOCAB, softcap=softcap,
                                                              label_smoothing=smoothing, reduction=reduction), ref)


def check_bf16_unbiased(kernel: str = "torch") -> None:
    """A bf16 head: the loss as plain HF's; the gradients against F.cross_entropy of the same bf16
    values upcast to fp32, to bf16 precision, and without a systematic scale (the mean's 1/12 is not a bf16 number:
    scaled in bf16 every gradient would be 0.2% off; the fitted scale must be 1 within 1e-3)."""
    tp, rank = parallel_state.get_tensor_model_parallel_size(), parallel_state.get_tensor_model_parallel_rank()
    g = torch.Generator().manual_seed(5)
    vocab, hidden_size = 50, 32
    hidden = torch.randn(2, 7, hidden_size, generator=g).bfloat16()
    weight = (torch.randn(vocab, hidden_size, generator=g) / 4).bfloat16()
    labels = torch.randint(0, vocab, (2, 7), generator=g)
    labels[0, 1] = labels[1, 6] = -100  # 12 tokens count
    ref_h, ref_w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    ref = F.cross_entropy(F.linear(ref_h, ref_w).flatten(0, 1), labels.flatten())
    ref.backward()
    rows = torch.arange(rank * vocab // tp, (rank + 1) * vocab // tp)
    local_w = weight[rows].clone().requires_grad_()
    h = hidden.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h, local_w, labels, vocab_size=vocab, chunk_tokens=5, kernel=kernel)
    loss.backward()
    assert local_w.grad.dtype == h.grad.dtype == torch.bfloat16
    # the loss: of the bf16 logits, as plain HF's (F.linear in bf16, the cross-entropy in fp32)
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(hidden, weight).float().flatten(0, 1), labels.flatten()),
                               **TOL)
    grad_h = h.grad.float()
    torch.distributed.all_reduce(grad_h, group=parallel_state.get_tensor_model_parallel_group())
    for name, got, want in (("hidden", grad_h, ref_h.grad), ("weight", local_w.grad.float(), ref_w.grad[rows])):
        # bf16 products (and the head's gradient summed over chunks in bf16): within bf16's resolution of the largest
        error, largest = float((got - want).abs().max()), float(want.abs().max())
        assert error <= 2**-7 * largest, f"{name} gradient: max error {error} of {largest}"
        if kernel == "triton":  # Triton's interpreter truncates to bf16 (a GPU rounds to nearest): checked on the GPU lane
            continue
        scale = float((got * want).sum() / (want * want).sum())
        assert abs(scale - 1) < 1e-3, f"{name} gradient scaled by {scale}"


class _NewStorages(TorchDispatchMode):
    """The sizes (numel) of the new storages ops create, apart from in-place results."""

    def __init__(self):
        super().__init__()
        self.numels: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        self.numels += [t.numel() for t in pytree.tree_leaves(out)
                        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs]
        return out


def check_no_weight_sized_temporaries(dtype: str, kernel: str = "torch") -> None:
    """Over four chunks, forward and backward allocate one buffer of the head's size (its
    gradient, accumulated in place) and no other: no per-chunk [V/tp, h] product, no fp32 copy,
    none in backward (the incoming scale is applied in place); at most two [chunk, V/tp] buffers
    per chunk (the logits, the fp32 softmax) plus, for a bf16 head, the gradient in its dtype;
    the Triton kernels one (the logits, the gradient written over them)."""
    tp = parallel_state.get_tensor_model_parallel_size()
    vocab, hidden_size, tokens, chunk = 64, 48, 20, 5  # 64 x 48: no other tensor of the head's size
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=g).to(getattr(torch, dtype)).requires_grad_()
    weight = torch.randn(vocab // tp, hidden_size, generator=g).to(getattr(torch, dtype)).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    with _NewStorages() as forward:
        loss = fused_linear_cross_entropy(hidden, weight, labels, vocab_size=vocab, chunk_tokens=chunk, kernel=kernel)
    with _NewStorages() as backward:
        (loss * 3).backward()
    assert forward.numels.count(weight.numel()) == 1, forward.numels
    assert weight.numel() not in backward.numels and hidden.numel() not in backward.numels, backward.numels
    per_chunk = 1 if kernel == "triton" else 2 + (dtype != "float32")
    assert forward.numels.count(chunk * vocab // tp) == per_chunk * tokens // chunk, forward.numels


def check_bad_label_raises_in_training() -> None:
    """At tp=1 the training path no longer runs torch's kernel (which raises on a label outside
    the vocabulary): the range check runs there too."""
    weight = torch.randn(VOCAB, HIDDEN, requires_grad=True)
    labels = torch.tensor([[1, VOCAB, 2]])
    with pytest.raises(ValueError, match="labels hold a value"):
        fused_linear_cross_entropy(torch.randn(1, 3, HIDDEN), weight, labels, vocab_size=VOCAB)


def check_compiled_kernels() -> None:
    """Under torch.compile (fullgraph: no break) the Triton kernels are opaque custom ops: the loss
    and gradients as eager."""
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(9, HIDDEN, generator=g), torch.randn(VOCAB, HIDDEN, generator=g)
    labels = torch.randint(0, VOCAB, (9,), generator=g)
    tp, rank = parallel_state.get_tensor_model_parallel_size(), parallel_state.get_tensor_model_parallel_rank()
    local_w = shard_from_full(weight, 0, _rows(tp, rank))

    def loss_of(h, w):
        return fused_linear_cross_entropy(h, w, labels, vocab_size=VOCAB, chunk_tokens=4, kernel="triton")

    results = []
    for fn in (loss_of, torch.compile(loss_of, backend="aot_eager", fullgraph=True)):
        h, w = hidden.clone().requires_grad_(), local_w.clone().requires_grad_()
        loss = fn(h, w)
        loss.backward()
        results.append((loss, h.grad, w.grad))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, **TOL)


def check_kernels_on_gpu() -> None:
    """The GPU lane: the Triton kernels ("auto" on CUDA) against F.cross_entropy at a vocabulary
    of two column blocks and an odd width, fp32 exact (also soft-capped), bf16 within its
    resolution of the fp32 reference."""
    device = torch.device("cuda", torch.cuda.current_device())
    assert softmax_kernels.usable(device, "auto")
    g = torch.Generator().manual_seed(2)
    vocab, hidden_size, tokens = 50_001, 64, 300
    hidden = torch.randn(tokens, hidden_size, generator=g).to(device)
    weight = (torch.randn(vocab, hidden_size, generator=g) / 8).to(device)
    labels = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    labels[::7] = -100
    for dtype, smoothing, softcap in ((torch.float32, 0.0, None), (torch.float32, 0.1, 1.5),
                                      (torch.bfloat16, 0.0, None)):
        ref_h, ref_w = hidden.to(dtype).float().requires_grad_(), weight.to(dtype).float().requires_grad_()
        ref_logits = F.linear(ref_h, ref_w)  # about one standard deviation: a cap of 1.5 bends them
        if softcap:
            ref_logits = torch.tanh(ref_logits / softcap) * softcap
        ref = F.cross_entropy(ref_logits, labels, label_smoothing=smoothing)
        ref.backward()
        h, w = hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()
        loss = fused_linear_cross_entropy(h, w, labels, label_smoothing=smoothing, chunk_tokens=128, softcap=softcap)
        loss.backward()
        if dtype == torch.float32:
            torch.testing.assert_close(loss, ref, **TOL)
            torch.testing.assert_close(h.grad, ref_h.grad, **TOL)
            torch.testing.assert_close(w.grad, ref_w.grad, **TOL)
            continue
        torch.testing.assert_close(loss, F.cross_entropy(F.linear(h.detach(), w.detach()).float(), labels), **TOL)
        for got, want in ((h.grad.float(), ref_h.grad), (w.grad.float(), ref_w.grad)):
            assert float((got - want).abs().max()) <= 2**-7 * float(want.abs().max())
            assert abs(float((got * want).sum() / (want * want).sum()) - 1) < 1e-3  # rounded to nearest: unbiased


def check_model(tp: int, sp: bool, num_items: bool, gather_logits: bool, model_type: str = "llama") -> None:
    """A tiny model parallelized with ``fused_loss=True`` against the plain HF model: loss (HF's
    normalization with ``num_items_in_batch``), every gathered gradient, logits when asked for.
    Cohere scales its logits after the head (``logit_scale``), Gemma 2 soft-caps them: its
    config's cap is switched off for the fused forward only."""
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair(model_type)
    softcap = getattr(model.config, "final_logit_softcapping", None)
    nxd_hf.parallelize(model, tensor_parallel_size=tp, sequence_parallel=sp, fused_loss=True,
                       gather_logits=gather_logits)
    ids, labels = hf_parity.batch()
    labels[0, 3] = -100
    kwargs = {"num_items_in_batch": torch.tensor(11)} if num_items else {}
    ref_out = reference(input_ids=ids, labels=labels, **kwargs)
    widths = []
    hook = model.lm_head.register_forward_hook(lambda module, args, output: widths.append(output.shape[-1]))
    out = model(input_ids=ids, labels=labels, **kwargs)
    hook.remove()
    # the first call hands the hidden states to the loss; with gather_logits the logits are made after
    assert widths[0] == model.config.hidden_size and len(widths) == 1 + gather_logits, f"head outputs {widths}"
    assert getattr(model.config, "final_logit_softcapping", None) == softcap
    ref_out.loss.backward()
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref_out.loss, **TOL)
    if gather_logits:
        torch.testing.assert_close(out.logits, ref_out.logits, **TOL)
    else:
        assert out.logits is None
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(hf_parity.gathered_grad(param), ref_params[name].grad, **TOL,
                                   msg=lambda m: f"tp={tp} sp={sp} {name}: {m}")
    model.eval()
    with torch.no_grad():  # eval: the head as usual
        torch.testing.assert_close(model(input_ids=ids).logits, reference.eval()(input_ids=ids).logits, **TOL)


def check_trainer(out_dir: str) -> None:
    """``NxDTrainingArguments(fused_loss=True)`` at tp=2: the head is fused, and three steps of
    NxDTrainer log the losses and reach the weights of the same run with the unfused loss."""
    results = []
    for fused in (False, True):
        parallel_state.destroy_model_parallel()
        _, model = hf_parity.build_pair("llama")
        args = nxd_hf.NxDTrainingArguments(output_dir=f"{out_dir}/{fused}", tensor_parallel_size=2, max_steps=3,
                                           per_device_train_batch_size=2, learning_rate=1e-3, report_to=[],
                                           save_strategy="no", logging_steps=1, fused_loss=fused)
        g = torch.Generator().manual_seed(3)
        data = [{"input_ids": ids, "labels": ids.clone()}
                for ids in torch.randint(0, hf_parity.VOCAB, (6, 8), generator=g)]
        trainer = nxd_hf.NxDTrainer(model, args, train_dataset=data)
        widths = []
        model.lm_head.register_forward_hook(lambda module, a, output: widths.append(output.shape[-1]))
        trainer.train()
        assert set(widths) == {model.config.hidden_size if fused else model.lm_head.weight.shape[0]}, widths
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        results.append((losses, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (plain_losses, plain), (losses, params) = results
    assert len(losses) == 3
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), **TOL)
    for name, param in params.items():
        torch.testing.assert_close(param, plain[name], **TOL, msg=lambda m: f"{name}: {m}")


def check_refusals() -> None:
    """A clear error for a model without a causal-LM head, and for a forward that transforms its
    logits after the head in a way the fused loss would get wrong (a hook stands for that code):
    a tanh, a slice, a scale with a biased head (phi); the config's soft-cap is restored after the error."""
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("bert", task_model_cls=transformers.BertForSequenceClassification)
    with pytest.raises(ValueError, match="fused_loss=True needs a causal-LM head"):
        nxd_hf.parallelize(model, tensor_parallel_size=2, fused_loss=True)
    ids, labels = hf_parity.batch()
    for model_type, transform, found in (("gemma2", torch.tanh, "TanhBackward0"),
                                         ("llama", lambda out: out.float()[..., :-1], "SliceBackward0"),
                                         ("phi", lambda out: out * 2.0, "does not commute with the head's bias")):
        parallel_state.destroy_model_parallel()
        _, model = hf_parity.build_pair(model_type)
        nxd_hf.parallelize(model, tensor_parallel_size=2, fused_loss=True)
        model.lm_head.register_forward_hook(lambda module, args, out: transform(out))
        with pytest.raises(ValueError, match=f"transforms its logits between the LM head and the loss .*{found}"):
            model(input_ids=ids, labels=labels)
        assert getattr(model.config, "final_logit_softcapping", None) == (2.0 if model_type == "gemma2" else None)


FUNCTION = [(*case, None) for case in itertools.product([1, 2], [0.0, 0.1], ["mean", "sum"], [3, 64])] + [
    (tp, smoothing, "mean", 3, 3.0) for tp in (1, 2) for smoothing in (0.0, 0.1)]


@pytest.mark.parametrize("tp, smoothing, reduction, chunk, softcap", FUNCTION,
                         ids=[f"tp{t}-smooth{s}-{r}-chunk{c}" + (f"-softcap{cap}" if cap else "")
                              for t, s, r, c, cap in FUNCTION])
def test_fused_linear_cross_entropy_equals_torch(ranks2, tp, smoothing, reduction, chunk, softcap):
    ranks2.run(check_function, smoothing, reduction, chunk, "torch", softcap, model_parallel=(tp, 1))


needs_triton = pytest.mark.skipif(not softmax_kernels.TRITON_INSTALLED,
                                  reason="Triton is not installed (`pip install -e '.[kernel-tests]'`)")
KERNELS = list(itertools.product([1, 2], [0.0, 0.1], [None, 3.0]))


@needs_triton
@pytest.mark.parametrize("tp, smoothing, softcap", KERNELS,
                         ids=[f"tp{t}-smooth{s}" + (f"-softcap{c}" if c else "") for t, s, c in KERNELS])
def test_triton_kernels_equal_torch(ranks2, tp, smoothing, softcap):
    """The Triton kernels in Triton's interpreter: chunks that do not divide the tokens, ignored
    labels, a padded vocabulary at tp=2, soft-capped logits."""
    ranks2.run(check_function, smoothing, "mean", 3, "triton", softcap, model_parallel=(tp, 1))


@needs_triton
@pytest.mark.parametrize("tp", [1, 2])
def test_triton_kernels_compile_as_custom_ops(ranks2, tp):
    ranks2.run(check_compiled_kernels, model_parallel=(tp, 1))


def test_bad_options_are_refused():
    hidden, weight, labels = torch.randn(3, HIDDEN), torch.randn(VOCAB, HIDDEN), torch.randint(0, VOCAB, (3,))
    for kwargs, message in ((dict(softcap=0.0), "softcap must be a positive number"),
                            (dict(softcap=-30.0), "softcap must be a positive number"),
                            (dict(label_smoothing=1.5), r"label_smoothing must be in \[0, 1\]"),
                            (dict(reduction="none"), "reduction must be 'mean' or 'sum'")):
        with pytest.raises(ValueError, match=message):
            fused_linear_cross_entropy(hidden, weight, labels, **kwargs)


def test_triton_kernel_refused_off_cuda(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="kernel='triton' needs .* a CUDA tensor"):
        softmax_kernels.usable(torch.device("cpu"), "triton")
    with pytest.raises(ValueError, match="kernel must be"):
        softmax_kernels.usable(torch.device("cpu"), "liger")
    assert not softmax_kernels.usable(torch.device("cpu"), "auto")


BF16 = [(1, "torch"), (2, "torch")] + [(tp, "triton") for tp in (1, 2) if softmax_kernels.TRITON_INSTALLED]


@pytest.mark.parametrize("tp, kernel", BF16, ids=[f"tp{t}-{k}" for t, k in BF16])
def test_bf16_head_gradients_unbiased(ranks2, tp, kernel):
    ranks2.run(check_bf16_unbiased, kernel, model_parallel=(tp, 1))


TEMPORARIES = [(1, "float32", "torch"), (1, "bfloat16", "torch"), (2, "bfloat16", "torch")] + [
    (tp, "bfloat16", "triton") for tp in (1, 2) if softmax_kernels.TRITON_INSTALLED]


@pytest.mark.parametrize("tp, dtype, kernel", TEMPORARIES, ids=[f"tp{t}-{d}-{k}" for t, d, k in TEMPORARIES])
def test_no_weight_sized_temporaries(ranks2, tp, dtype, kernel):
    ranks2.run(check_no_weight_sized_temporaries, dtype, kernel, model_parallel=(tp, 1))


def test_bad_label_raises_in_training_at_tp1(ranks2):
    ranks2.run(check_bad_label_raises_in_training, model_parallel=(1, 1))


MODEL = [(1, False, False, False, "llama"), (2, False, True, False, "llama"), (2, True, False, True, "llama"),
         (1, False, True, True, "llama"), (2, False, False, True, "cohere"), (1, False, False, False, "gemma2"),
         (2, False, True, True, "gemma2")]


@pytest.mark.parametrize("tp, sp, num_items, gather_logits, model_type", MODEL,
                         ids=[f"{m}-tp{t}-sp{s}-num_items{n}-gather{g}" for t, s, n, g, m in MODEL])
def test_parallelize_fused_loss_matches_hf(ranks2, tp, sp, num_items, gather_logits, model_type):
    ranks2.run(check_model, tp, sp, num_items, gather_logits, model_type)


def test_nxd_trainer_fused_loss_tp2(ranks2, tmp_path):
    ranks2.run(check_trainer, str(tmp_path))


def test_fused_loss_refused_where_it_cannot_apply(ranks2):
    ranks2.run(check_refusals)
