"""The last stage's loss for a model whose HF loss takes one pooled logit row per sequence
(``ForSequenceClassificationLoss``: sequence, image, audio and video classification): the
traced graph ends in those pooled logits ``[b, num_labels]``, which are replicated over TP.

HF's loss is a mean over the rows it is given (cross-entropy, MSE or BCE as ``problem_type``
says); a microbatch's share of the step is that mean times its rows divided by the step's
normalizer (rows over all microbatches, DP replicas and accumulated calls, divided by the DP
size since DP gradients are averaged), so the gradients equal those of the model's loss on one
batch holding the step, as ``transformers.Trainer`` averages it. Rows an evaluation batch was
padded with (every label -100) are left out."""

import torch
from transformers.loss.loss_utils import LOSS_MAPPING, ForSequenceClassificationLoss

from nxd_hf import backend, parallel_state

IGNORE_INDEX = -100


def takes_pooled_logits(hf_model) -> bool:
    """Whether ``hf_model.loss_function`` is HF's pooled (sequence-classification) loss."""
    return LOSS_MAPPING.get(getattr(hf_model, "loss_type", None)) is ForSequenceClassificationLoss


def valid_rows(labels: torch.Tensor) -> torch.Tensor:
    """[b] bool: the rows that are not padding (a padded row's labels are all -100)."""
    return labels.reshape(labels.shape[0], -1).ne(IGNORE_INDEX).any(-1)


def rows_over_data_parallel(labels: torch.Tensor) -> torch.Tensor:
    """This call's valid rows summed over the DP replicas (fp32)."""
    count = valid_rows(labels).sum().to(torch.float32)
    return backend.all_reduce(count, parallel_state.get_data_parallel_group())


def row_normalizer(labels: torch.Tensor, num_rows_in_step=None) -> torch.Tensor:
    """What this rank divides its summed row losses by: the step's rows (``num_rows_in_step``
    when given, else this call's over DP) divided by the DP size."""
    count = rows_over_data_parallel(labels) if num_rows_in_step is None else num_rows_in_step
    count = torch.as_tensor(count, dtype=torch.float32, device=labels.device)
    return count / parallel_state.get_data_parallel_size()


def pooled_loss_share(hf_model, pooled_logits: torch.Tensor, labels: torch.Tensor, normalizer) -> torch.Tensor:
    """A microbatch's share of the step's loss: HF's loss on its valid rows, weighted by them."""
    valid = valid_rows(labels)
    if not bool(valid.any()):
        return pooled_logits.sum() * 0.0  # a microbatch of padding rows: no loss, no gradient
    loss = hf_model.loss_function(labels=labels[valid], pooled_logits=pooled_logits[valid], config=hf_model.config)
    return loss * valid.sum().to(loss.dtype) / normalizer
