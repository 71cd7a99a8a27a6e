"""Parity of one parallel layout against the unparallelized model: the loss and every gradient
(gathered over TP) of a model built from ``config``, inside already-started ranks.

``run_case`` never lets a failure on some ranks hang the others: every rank reports how its
setup went and all agree (one small all-gather over the world) before the first collective
that could block, and again after forward and backward (except after a pipeline step that
failed: it closed the process groups, so every rank raises its error instead). The outcome is one of
"pass", "refused" (``parallelize`` raised a ValueError: the architecture or layout is not
supported, with its message), "wrong" (ran, but the loss or a gradient is off) and "crash"
(any other exception).
"""

import copy
import dataclasses
import traceback

import torch
import transformers

from nxd_hf import backend, parallel_state
from nxd_hf.parallel_layers.sharding import full_tensor
from nxd_hf.parallelize import parallelize

RTOL, ATOL = 1e-4, 1e-5
VOCAB_SEED, WEIGHT_SEED = 1, 0


@dataclasses.dataclass(kw_only=True)
class CaseResult:
    """The agreed outcome of one layout, the same on every rank."""

    status: str
    """"pass", "refused", "wrong" or "crash"."""
    message: str = ""
    """The refusal or exception (first failing rank), or the worst mismatch."""
    max_loss_diff: float | None = None
    """|loss - reference loss| (None when it did not run)."""
    max_grad_diff: float | None = None
    """Largest |grad - reference grad| over all parameters."""


def causal_lm_class(config):
    """The causal-LM class transformers' auto mapping gives ``config``."""
    return transformers.AutoModelForCausalLM._model_mapping[type(config)]


def _noise_everywhere(reference, g: torch.Generator) -> None:
    """Small noise on every parameter, so zero-initialized ones (gates, norm offsets, biases)
    carry real gradients."""
    for p in reference.parameters():
        p.add_(0.05 * torch.randn(p.shape, generator=g))


def _random_norms(reference, g: torch.Generator) -> None:
    """Norm weights 1 + noise, so norm gradients are not trivially symmetric (BERT's "LayerNorm" too)."""
    for name, p in reference.named_parameters():
        if "norm" in name.lower() or "ln" in name:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))


PERTURBATIONS = {"all": _noise_everywhere, "norms": _random_norms}


def build_pair(config, model_cls=None, *, seed: int = WEIGHT_SEED, perturb: str = "all"):
    """(reference, copy to parallelize) with identical fp32 weights, perturbed as
    ``PERTURBATIONS[perturb]`` says ("all": small noise on every parameter; "norms": random
    norm weights)."""
    model_cls = model_cls or causal_lm_class(config)
    torch.manual_seed(seed)
    reference = model_cls(config).float()
    with torch.no_grad():
        PERTURBATIONS[perturb](reference, torch.Generator().manual_seed(seed + 1))
    reference.train()
    return reference, copy.deepcopy(reference)


def make_batch(vocab_size: int, *, batch_size: int = 2, seq_len: int = 8, seed: int = VOCAB_SEED):
    """(input_ids, labels) of random tokens; labels ignore (-100) the first 3 tokens of row 0
    and the last 2 of row 1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[1, -2:] = -100
    return ids, labels


def gathered_grad(param, grad: torch.Tensor | None = None) -> torch.Tensor:
    """The full gradient of ``param`` in the HF layout (Conv1D weights ``[in, out]``), from this
    rank's shard ``grad`` (default ``param.grad``)."""
    grad = param.grad if grad is None else grad
    full = full_tensor(param, grad)
    return full.t() if getattr(param, "hf_transposed", False) else full


_agreement_group = None


def _agree(status: str, message: str) -> tuple[str, str]:
    """The first non-"pass" (status, message) over all ranks; every rank gets the same. Runs on
    its own group, so it never pairs with a collective a failed peer left waiting elsewhere."""
    global _agreement_group
    if _agreement_group is None:
        _agreement_group = backend.new_host_group("check_parity agreement")
    everyone = backend.all_gather_object((status, message), _agreement_group)
    return next(((s, m) for s, m in everyone if s != "pass"), ("pass", ""))


def _failure(exc: BaseException, *, setup: bool) -> tuple[str, str]:
    """A ValueError that nxd_hf raises while setting up is a refusal; anything else a crash."""
    where = traceback.extract_tb(exc.__traceback__)[-1].filename if exc.__traceback__ else ""
    if setup and isinstance(exc, ValueError) and ("/nxd_hf/" in where):
        return "refused", str(exc)
    tail = "".join(traceback.format_exception(exc)[-3:])
    return "crash", f"{type(exc).__name__}: {exc}\n{tail}"[:2000]


def _compare(model_params, reference, loss, ref_loss) -> CaseResult:
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    loss_diff = (loss.detach() - ref_loss.detach()).abs().item()
    worst, worst_name, wrong = 0.0, "", []
    for name, param in model_params:
        ref_grad = ref_params[name].grad
        ref_grad = torch.zeros_like(ref_params[name]) if ref_grad is None else ref_grad
        grad = gathered_grad(param, param.grad if param.grad is not None else torch.zeros_like(param))
        diff = (grad - ref_grad).abs().max().item() if grad.shape == ref_grad.shape else float("inf")
        if diff > worst:
            worst, worst_name = diff, name
        if not torch.allclose(grad, ref_grad, rtol=RTOL, atol=ATOL) if grad.shape == ref_grad.shape else True:
            wrong.append(name)
    loss_ok = torch.allclose(loss.detach(), ref_loss.detach(), rtol=RTOL, atol=ATOL)
    status = "pass" if loss_ok and not wrong else "wrong"
    message = "" if status == "pass" else (
        f"loss diff {loss_diff:.2e}; {len(wrong)} gradients off (worst {worst_name}: {worst:.2e}); e.g. {wrong[:4]}")
    return CaseResult(status=status, message=message, max_loss_diff=loss_diff, max_grad_diff=worst)


def run_case(config, *, tensor_parallel_size: int, pipeline_parallel_size: int = 1, sequence_parallel: bool = False,
             model_cls=None, expert_parallel_size: int = 1, fused_loss: bool = False) -> CaseResult:
    """Build ``config``'s model, parallelize a copy on this layout and compare (see module doc).
    Every rank of the world calls it with the same arguments. With ``expert_parallel_size`` > 1
    the world is tp x pp x ep: the ep data-parallel ranks all train on the same batch (their
    tokens still reach the experts by all-to-all), so the mean gradient is the reference's.
    ``fused_loss``: parallelized with ``fused_loss=True`` (the loss from the hidden states)."""
    parallel_state.destroy_model_parallel()
    reference, model = build_pair(config, model_cls)
    pp = pipeline_parallel_size
    ids, labels = make_batch(config.get_text_config().vocab_size, batch_size=4 if pp > 1 else 2)
    device = backend.default_device()  # where parallelize puts the copy (a GPU under nccl)
    reference, ids, labels = reference.to(device), ids.to(device), labels.to(device)
    status, message = "pass", ""
    try:
        kwargs = dict(num_microbatches=2, broadcast_and_average_loss=True) if pp > 1 else {}
        if expert_parallel_size > 1:
            kwargs["expert_parallel_size"] = expert_parallel_size
        if fused_loss:
            kwargs["fused_loss"] = True
        model = parallelize(model, tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pp,
                            sequence_parallel=sequence_parallel, **kwargs)
    except Exception as exc:  # noqa: BLE001  classified; the other ranks must hear of it
        status, message = _failure(exc, setup=True)
    status, message = _agree(status, message)
    if status != "pass":
        return CaseResult(status=status, message=message)
    torch.manual_seed(WEIGHT_SEED)  # the same draws for routers that sample in training (PhiMoE's sparsemixer)
    ref_loss = reference(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    loss = None
    try:
        torch.manual_seed(WEIGHT_SEED)
        loss = _train_step(model, ids, labels, pp)
    except Exception as exc:  # noqa: BLE001
        if backend.groups_aborted():
            # a failed pipeline step closed the process groups (nxd_hf.pipeline.failure): no agreement
            # can run, and a peer blocked on this rank is freed only by its exit. Every rank raises.
            raise
        status, message = _failure(exc, setup=False)
    status, message = _agree(status, message)
    if status != "pass":
        return CaseResult(status=status, message=message)
    params = model.local_named_parameters() if pp > 1 else model.named_parameters()
    result = _compare(list(params), reference, loss, ref_loss)
    status, message = _agree(result.status, result.message)
    return dataclasses.replace(result, status=status, message=message)


def _train_step(model, ids, labels, pp: int) -> torch.Tensor:
    dp_size = parallel_state.get_data_parallel_size()
    if dp_size > parallel_state.get_expert_parallel_size():
        raise ValueError(f"parity runs without data parallelism: use tp x pp (x ep) = world size, got dp={dp_size}")
    if pp > 1:
        return model.run_train(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss
