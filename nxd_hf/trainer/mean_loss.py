"""Models whose forward computes its loss itself, as a mean over its labels, instead of through
``self.loss_function`` (BERT's masked-LM and classification heads call ``CrossEntropyLoss()``
inline; so do most encoders' heads). Such a loss ignores ``num_items_in_batch``: under data
parallelism each replica's is the mean over its own labels, and the replicas' plain average
differs from the mean over the whole batch whenever they hold different numbers of labels (an
MLM collator masks a different number of tokens in every row). Each replica's loss is weighted
by its share of the labels (``label_weight``), so that the average is the whole batch's mean, the
loss the model computes on one process."""

import inspect

import torch
from torch import nn

from nxd_hf import backend, parallel_state


def computes_own_mean_loss(model: nn.Module) -> bool:
    """Whether ``model``'s forward computes its loss without ``self.loss_function`` (through which
    a Hugging Face model takes ``num_items_in_batch``)."""
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):  # no source to read: take the Hugging Face contract
        return False
    return "loss_function" not in source


def label_weight(labels: torch.Tensor, *, filler: bool = False, total=None, ignore_index: int = -100) -> torch.Tensor:
    """The factor that turns this replica's mean over its labels (those not ``ignore_index``)
    into its share of the mean over ``total`` labels — by default this call's labels over every
    replica (collective over the data-parallel group) — averaged over the replicas. ``filler``:
    the replica's rows only stand in for none (``nxd_hf.trainer.batches.FILLER_ROWS``)."""
    count = (labels != ignore_index).sum().to(torch.float32) * (0.0 if filler else 1.0)
    if total is None:
        total = count.clone()
        backend.all_reduce(total, parallel_state.get_data_parallel_group())
        total = total / parallel_state.get_context_parallel_size()  # its cp ranks count a replica's rows
    total = torch.as_tensor(total, dtype=torch.float32, device=labels.device).clamp(min=1)
    return count * parallel_state.get_data_parallel_replicas() / total
