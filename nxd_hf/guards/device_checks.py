"""Range checks that run on every step at no host cost: the vocab-parallel embedding's ids and
the vocab-parallel loss's labels.

Under tensor parallelism an id >= the vocabulary matches no rank's embedding rows and a label >=
the vocabulary none of the loss's logit columns: both give a finite, wrong result where the
unsharded model raises IndexError. Checking their range on the host would wait for the device
every step; ``torch._assert_async`` queues the check on the device instead (a failed one
stops the CUDA context, with ``message`` in the device-side assert). On the CPU the check is
synchronous anyway, so it raises the ValueError itself. Every rank of a tensor-parallel group
holds the same ids and labels, so every rank fails at the same point, before the layer's
collective.
"""

import torch

from nxd_hf import backend

DEVICES = ("cpu", "cuda")
"""Where the check runs; elsewhere (XLA: it would cut the lazy graph) the first-step input check
of ``nxd_hf.guards.input_check`` is the only one."""


def assert_on_device(ok: torch.Tensor, message: str) -> None:
    """Raise ``ValueError(message)`` (CPU) or fail a device-side assert (CUDA) unless ``ok``
    (a bool tensor of one element) holds."""
    if ok.device.type not in DEVICES or backend._is_abstract(ok):  # fake/meta values (tracing) hold nothing to check
        return
    if ok.device.type == "cpu" and not torch.compiler.is_compiling():
        if not bool(ok):
            raise ValueError(message)
        return
    torch._assert_async(ok, message)


def check_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Every token id is in ``[0, vocab_size)``."""
    if input_ids.numel() == 0 or input_ids.is_floating_point():
        return
    low, high = torch.aminmax(input_ids)
    ok = (low >= 0) & (high < vocab_size)
    assert_on_device(ok, f"bad inputs (nxd_hf's every-step check): input_ids hold an id outside [0, {vocab_size}) "
                     "(config.vocab_size): use the model's own tokenizer, or resize the embeddings "
                     "(model.resize_token_embeddings) before nxd_hf.parallelize")


def check_labels(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Every label is a token id in ``[0, vocab_size)`` or ``ignore_index``."""
    if labels.numel() == 0:
        return
    ok = ((labels >= 0) & (labels < vocab_size) | (labels == ignore_index)).all()
    assert_on_device(ok, f"bad inputs (nxd_hf's every-step check): labels hold a value that is neither a token id in "
                     f"[0, {vocab_size}) nor {ignore_index} (ignored, as in Hugging Face losses)")
