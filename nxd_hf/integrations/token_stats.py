"""Per-token statistics of the next-token distribution from vocab-parallel logits, without
gathering them: what TRL's fused LM head computes on a whole vocabulary
(``trl.trainer.utils.FusedCausalLMOutput``), here on ``[..., V/tp]`` shards with a few small
all-reduces over the tensor-parallel group. Equal to the single-process values at any tp."""

import torch

from nxd_hf import backend, parallel_state
from nxd_hf.parallel_layers.loss_functions import parallel_cross_entropy
from nxd_hf.parallel_layers.mappings import reduce_from_tensor_model_parallel_region

FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def token_stats(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, outputs=FIELDS,
                ignore_index: int = -100) -> dict:
    """``logits [..., V/tp]`` (this rank's vocabulary columns) and unsharded ``labels [...]``:
    a dict of the fields in ``outputs`` plus ``label_mask``, each ``[...]`` and zero (False) at
    ignored labels. ``log_probs`` and ``entropy`` carry gradients; the others do not."""
    mask = labels != ignore_index
    stats = {"label_mask": mask,
             "log_probs": -parallel_cross_entropy(logits, labels, ignore_index=ignore_index, vocab_size=vocab_size)}
    wanted = set(outputs) - {"log_probs"}
    if not wanted:
        return stats
    group = parallel_state.get_tensor_model_parallel_group()
    local_vocab = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * local_vocab
    columns = torch.arange(start, start + local_vocab, device=logits.device)
    real = columns < vocab_size  # padded vocabulary columns on the last ranks do not exist
    z = logits.float().masked_fill(~real, float("-inf"))
    with torch.no_grad():
        z_max = z.amax(-1)
        backend.all_reduce(z_max, group, op="max")
    shifted = z - z_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(-1))
    if "entropy" in wanted:  # H = log S - sum_v e_v (z_v - max) / S, with S = sum_v e_v
        expected = reduce_from_tensor_model_parallel_region((exp * shifted.masked_fill(~real, 0.0)).sum(-1))
        stats["entropy"] = (sum_exp.log() - expected / sum_exp).masked_fill(~mask, 0.0)
    with torch.no_grad():
        if "log_sum_sq_probs" in wanted:
            squares = (2 * shifted).exp().sum(-1)
            backend.all_reduce(squares, group)
            stats["log_sum_sq_probs"] = (squares.log() - 2 * sum_exp.log()).masked_fill(~mask, 0.0)
        if "mean_logits" in wanted:
            total = z.masked_fill(~real, 0.0).sum(-1)
            backend.all_reduce(total, group)
            stats["mean_logits"] = (total / vocab_size).masked_fill(~mask, 0.0)
        if "is_top1" in wanted:
            stats["is_top1"] = _is_top1(z, z_max, labels, mask, columns, group)
    return stats


def _is_top1(z, z_max, labels, mask, columns, group) -> torch.Tensor:
    """Whether the label is the argmax (the first maximum, as ``torch.argmax`` and TRL count)."""
    owned = (columns == labels.unsqueeze(-1)) & mask.unsqueeze(-1)
    target = z.masked_fill(~owned, float("-inf")).amax(-1)
    before = z.masked_fill(columns >= labels.unsqueeze(-1), float("-inf")).amax(-1)
    both = torch.stack([target, before])
    backend.all_reduce(both, group, op="max")
    target, before = both
    return (target >= z_max) & (target > before) & mask
