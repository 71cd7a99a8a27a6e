"""Gemma 3n (text): HF's plan (derived as for any architecture) plus exact activation sparsity.

Gemma 3n's MLP keeps, in its first layers, only the activations above ``mean + z * std`` of the
intermediate units (``_gaussian_topk``). Column-parallel, each rank holds a shard of those
units, so per-shard statistics would differ from the model's: the mean and the mean square are
summed over TP here (all-reduce forward, and backward, since every rank's cutoff depends on
every shard). The embedding is Gemma's scaled one, kept by ``nxd_hf.tp.custom_modules``."""

import dataclasses

import torch
import transformers
from torch import nn

from nxd_hf.parallel_layers import mappings
from nxd_hf.tp.derive import patch_from_hf_plan
from nxd_hf.tp.registry import register_patch


def _sum_over_tp(x: torch.Tensor) -> torch.Tensor:
    """Sum over TP; all-reduce forward and backward (each rank's result feeds its own outputs)."""
    return mappings.reduce_from_tensor_model_parallel_region(mappings.copy_to_tensor_model_parallel_region(x))


def _gaussian_topk(mlp: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """HF's ``Gemma3nTextMLP._gaussian_topk`` with statistics over all intermediate units."""
    target = torch.tensor(mlp.activation_sparsity, dtype=torch.float32, device=inputs.device)
    std_multiplier = torch.distributions.normal.Normal(0, 1).icdf(target).type(inputs.dtype)
    n = mlp.intermediate_size  # logical: padded units (zeros) are not counted
    mean = _sum_over_tp(inputs.sum(-1, keepdim=True)) / n
    mean_square = _sum_over_tp(inputs.square().sum(-1, keepdim=True)) / n
    std = (mean_square - mean.square()).clamp_min(0).sqrt()
    return nn.functional.relu(inputs - (mean + std * std_multiplier))


def exact_activation_sparsity(model: nn.Module) -> None:
    for module in model.modules():
        if type(module).__name__ == "Gemma3nTextMLP" and module.activation_sparsity > 0.0:
            module._gaussian_topk = _gaussian_topk.__get__(module)


_HF_PLAN = transformers.Gemma3nTextConfig.base_model_tp_plan
# No sequence parallelism: AltUp stacks the hidden states [altup, b, s, h] between decoder
# layers, where the sequence split expects [b, s, h].
PATCH = register_patch(dataclasses.replace(
    patch_from_hf_plan("gemma3n_text", _HF_PLAN), after_swap=exact_activation_sparsity, sequence_parallel=False))
