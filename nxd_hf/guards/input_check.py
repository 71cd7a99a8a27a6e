"""The input check: catch inputs that would train silently wrong, or hang.

Under tensor parallelism an input id >= the vocabulary size matches no rank's embedding rows
(HF raises IndexError; vocab-parallel layers would return zeros), a label >= the vocabulary
matches no rank's logits, and TP ranks given different batches compute one loss from pieces
of both (different sequence lengths end in a collective mismatch or a hang). So on the first
step of a model every rank checks id and label ranges and all-reduces a fixed-size
fingerprint of its inputs (names, shapes, dtypes and a checksum of the bytes) with the range
results over its model-parallel group (TP x PP: every rank that must see the same batch), so
every rank of the group raises the same ``ValueError`` before any layer runs. On every later
step, checks that do not wait for the device: the vocab-parallel embedding and loss check id
and label ranges on the device (``nxd_hf.guards.device_checks``), and the fingerprint goes out
asynchronously and is compared at the next step (``nxd_hf.guards.fingerprint``).

Modes: ``check_inputs=True`` (default; the host check on the first step, the device checks
and the asynchronous fingerprint on every step), ``"always"`` (the host check on every step,
for debugging) or ``False`` (none of them). The environment variable
``NXD_HF_CHECK_INPUTS`` = ``0`` / ``1`` / ``always`` overrides the argument. Not in NxD.
"""

import inspect
import os
import zlib

import torch

from nxd_hf import backend, parallel_state
from nxd_hf.guards.fingerprint import PendingFingerprints, differs_message

ENV_VAR = "NXD_HF_CHECK_INPUTS"
_ENV_MODES = {"0": "off", "false": "off", "off": "off", "1": "first", "true": "first", "first": "first",
              "always": "always"}
IGNORE_INDEX = -100


def resolve_mode(check_inputs) -> str:
    """"first", "always" or "off" from the argument and ``$NXD_HF_CHECK_INPUTS``."""
    if check_inputs not in (True, False, "always"):
        raise ValueError(f"check_inputs must be True, False or 'always', got {check_inputs!r}")
    env = os.environ.get(ENV_VAR, "").strip().lower()
    if env:
        if env not in _ENV_MODES:
            raise ValueError(f"${ENV_VAR}={env!r}: use 0 (off), 1 (the default checks) or always")
        return _ENV_MODES[env]
    return {True: "first", False: "off", "always": "always"}[check_inputs]


class InputCheck:
    """Checks a model's inputs: on the host on its first forward (every forward in mode
    "always"), by the asynchronous fingerprint on the others (none in mode "off")."""

    def __init__(self, *, vocab_size: int | None, mode: str):
        self.vocab_size, self.mode = vocab_size, mode
        self.calls = 0  # forwards of real (not traced) inputs so far: the same count on every rank
        self.pending = PendingFingerprints()

    def has_work(self) -> bool:
        """False once nothing is left to check: after the first forward's host check, where no
        other rank must see the same batch (a model-parallel group of one: one GPU)."""
        return self.mode == "always" or self.calls == 0 or (
            self.mode == "first" and backend.group_size(parallel_state.get_model_parallel_group()) > 1)

    def __call__(self, inputs: dict) -> None:
        tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        check_not_empty(tensors.get("input_ids"))
        if self.mode == "off" or any(backend.is_abstract(t) for t in tensors.values()):
            return
        on_host = self.mode == "always" or self.calls == 0
        self.calls += 1
        self.pending.check()  # the previous forward's fingerprints, long arrived
        if on_host:
            check_inputs(tensors, self.vocab_size)
        else:
            self.pending.start(tensors, lambda: _describe(tensors))


def install_input_check(model, check_inputs) -> InputCheck:
    """Check the inputs of ``model``'s forward (a pre-hook) as ``check_inputs`` says; the
    pipeline's step calls ``check_step_inputs`` instead."""
    check = InputCheck(vocab_size=getattr(model.config, "vocab_size", None), mode=resolve_mode(check_inputs))
    signature = inspect.signature(model.forward)

    def hook(module, args, kwargs):
        check_not_empty(kwargs.get("input_ids", args[0] if args else None))  # every step: shapes only
        if check.mode == "off" or not check.has_work():  # before binding the arguments: every step
            return
        try:
            named = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:  # the forward itself will say what is wrong
            return
        check({**named, **named.get("kwargs", {})})

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return check


def check_not_empty(input_ids) -> None:
    """An empty batch or sequence fails deep inside a model (a reshape of 0 elements, a
    collective of mismatched sizes): a ValueError naming it instead. Every rank of a
    tensor-parallel group gets the same batch, so each of them raises it."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() == 0 or backend.is_abstract(input_ids):
        return
    if input_ids.shape[0] == 0 or input_ids.shape[-1] == 0:
        what = "batch (no rows)" if input_ids.shape[0] == 0 else "sequence (no tokens)"
        raise ValueError(f"empty {what}: input_ids has shape {list(input_ids.shape)}. Every batch needs at least one "
                         "row of at least one token: drop empty examples from the dataset (e.g. dataset.filter(lambda "
                         "x: len(x['input_ids']) > 0)) and check the collator and the data-parallel split")


def check_step_inputs(check: InputCheck | None, inputs: dict) -> None:
    """The input check of a pipeline step (``check``: the model's, ``model.nxd.input_check``; None: none)."""
    if check is not None:
        check(inputs)


def check_inputs(tensors: dict[str, torch.Tensor], vocab_size: int | None) -> None:
    """Range checks and the fingerprint comparison, in one all-reduce over the model-parallel
    group (the ranks the forward itself needs: the check adds no collective between ranks
    that would not meet anyway, e.g. DP rank 0 evaluating alone)."""
    world = backend.world_size()
    fingerprint = _fingerprint(tensors)
    ids_low, ids_high, ids_bad = _range(tensors.get("input_ids"), vocab_size, allow_ignore=False)
    labels_low, labels_high, labels_bad = _range(tensors.get("labels"), vocab_size, allow_ignore=True)
    failing = [backend.rank() if bad else world for bad in (ids_bad, labels_bad)]
    # one MAX all-reduce: minima (of the fingerprint, the lowest failing ranks, the lowest ids) negated
    group = parallel_state.get_model_parallel_group()
    status = torch.tensor([*fingerprint, *(-v for v in fingerprint), -failing[0], -failing[1], -ids_low, ids_high,
                           -labels_low, labels_high], dtype=torch.long, device=backend.collective_device(group))
    backend.all_reduce(status, group, op="max")
    status = status.cpu()
    n = len(fingerprint)
    differs = not torch.equal(status[:n], -status[n : 2 * n])
    ids_rank, labels_rank = -int(status[2 * n]), -int(status[2 * n + 1])
    ids_low, ids_high, labels_low, labels_high = (int(v) * sign for v, sign in zip(status[2 * n + 2 :], (-1, 1, -1, 1)))
    problems = []
    if ids_rank < world:
        problems.append(
            f"input_ids on rank {ids_rank} hold ids in [{ids_low}, {ids_high}] but the vocabulary "
            f"has {vocab_size} tokens (config.vocab_size): every id must be in [0, {vocab_size}). Use the model's "
            "own tokenizer, or resize the embeddings (model.resize_token_embeddings) before nxd_hf.parallelize")
    if labels_rank < world:
        problems.append(
            f"labels on rank {labels_rank} hold values in [{labels_low}, {labels_high}]: every label must "
            f"be a token id in [0, {vocab_size}) or {IGNORE_INDEX} (ignored, as in Hugging Face losses)")
    if differs:
        problems.append(_differs_message(tensors))
    if problems:
        raise ValueError("bad inputs (nxd_hf's input check): " + "\n".join(problems))


def _range(tensor: torch.Tensor | None, vocab_size: int | None, *, allow_ignore: bool) -> tuple[int, int, bool]:
    """(lowest, highest, out of range) of an integer tensor of token ids; ignored labels skipped."""
    if tensor is None or vocab_size is None or tensor.is_floating_point() or tensor.numel() == 0:
        return 0, 0, False
    values = tensor[tensor != IGNORE_INDEX] if allow_ignore else tensor
    if values.numel() == 0:
        return 0, 0, False
    low, high = int(values.min()), int(values.max())
    return low, high, low < 0 or high >= vocab_size


def _fingerprint(tensors: dict[str, torch.Tensor]) -> list[int]:
    """Fixed size whatever the inputs (so ranks with different shapes still meet in one
    collective): a CRC of names, shapes and dtypes, and two checksums of the bytes."""
    layout = repr(sorted((name, tuple(t.shape), str(t.dtype)) for name, t in tensors.items()))
    total, weighted = 0, 0
    for name in sorted(tensors):
        data = tensors[name].detach().contiguous().reshape(-1).view(torch.uint8).long()
        weights = torch.arange(data.numel(), device=data.device) % 65521 + 1
        total += int(data.sum())
        weighted += int((data * weights).sum())
    return [zlib.crc32(layout.encode()), total, weighted]


def _describe(tensors: dict[str, torch.Tensor]) -> str:
    return ", ".join(f"{name} {list(t.shape)}" for name, t in sorted(tensors.items()))


def _differs_message(tensors: dict[str, torch.Tensor]) -> str:
    groups = parallel_state.get_model_parallel_group(as_list=True)
    return differs_message(next(ranks for ranks in groups if backend.rank() in ranks), _describe(tensors))
