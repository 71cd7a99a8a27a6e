"""HF's load-balancing (aux) loss of the global batch when data-parallel replicas run HF's
forward on their own rows (pipeline_parallel_size = 1, dp > 1; expert parallelism is dp carved).

HF's causal-LM forward adds ``coef * aux`` of the rows it sees; on one replica that is the loss of
its rows, not of the global batch (a product of batch means: ``nxd_hf.moe.aux_loss``). A forward
hook on the causal LM replaces it, with no extra forward: the replica's partial sums ``(T, P, R)``
of every routed layer are summed over the data-parallel group (the three sums of the global
batch), which gives the global ``aux``; the replica's term becomes

    aux_global (value, no gradient) + dp * (S - S.detach()),   S = sum_e w_e * P_e(this replica)

with ``w = gradient_weights`` of the global sums: its gradient is ``dp`` times HF's gradient of
the global aux for this replica's router logits, which the data-parallel mean of the gradients
(sum over replicas / dp) turns into HF's exact gradient. ``output.loss`` gets
``coef * (term - aux_local)``: HF's own ``coef * aux_local`` then receives a gradient of exactly
zero (``+coef - coef``), and ``output.aux_loss`` is the term. The logged DP mean of the loss is
the single-process loss.

Only training forwards (train mode, gradients on) are changed, so evaluation and ``generate()`` run
no collective here (NxDTrainer evaluates the whole set on every rank: its rows are the global
batch). Each replica first checks that its partial sums give HF's own aux value back; where they
do not on any replica (an architecture with another formula), every rank keeps HF's, with a warning.

Definition under gradient accumulation: each forward's aux loss is the one of that forward's
global batch (every replica's rows of that micro-step), as ``transformers.Trainer`` computes on
one process with the global batch, where each accumulation micro-batch adds its own
``coef * aux`` (not divided by the accumulation steps when the model takes ``num_items_in_batch``,
as MoE causal LMs do).
"""

import warnings

import torch
from torch import nn

from nxd_hf import parallel_state
from nxd_hf.moe import aux_loss as aux


def install_global_aux_loss(model: nn.Module, token_mask=None) -> bool:
    """Make ``model``'s (an HF MoE causal LM's) aux loss the global batch's over the data-parallel
    group (module docstring), whenever a forward computes one (``output_router_logits`` in the
    config or the call). True when installed: the model is an MoE causal LM and dp > 1."""
    if parallel_state.get_data_parallel_size() == 1 or not all(
            hasattr(model, name) for name in ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")):
        return False
    model.register_forward_hook(_GlobalAuxLoss(model.num_experts, model.num_experts_per_tok, token_mask),
                                with_kwargs=True)
    return True


class _GlobalAuxLoss:
    """The forward hook (see the module docstring)."""

    def __init__(self, num_experts: int, top_k: int, token_mask=None):
        self.num_experts, self.top_k = num_experts, top_k
        # context parallelism: each rank routes a part of every sequence, and its forward got no
        # attention mask; token_mask(n) gives the tokens to count (evaluation included: the
        # forward already runs collectives over the CP group)
        self.token_mask = token_mask
        self.warned = False

    def __call__(self, module, args, kwargs, output):
        if not (module.training and torch.is_grad_enabled()) and self.token_mask is None:
            return None  # evaluation, generate(): no collective
        local = getattr(output, "aux_loss", None) if not isinstance(output, tuple) else None
        logits = getattr(output, "router_logits", None) if not isinstance(output, tuple) else None
        if not isinstance(local, torch.Tensor) or not isinstance(logits, tuple) or not logits:
            if isinstance(output, tuple):
                self._warn("a MoE model returning a tuple (return_dict=False) keeps HF's aux loss of each "
                           "data-parallel replica's rows: return a ModelOutput for the global batch's")
            return None
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        logits = [layer.reshape(-1, layer.shape[-1]) for layer in logits]
        counted = mask if self.token_mask is None else self.token_mask(logits[0].shape[0])
        stats = self._global_statistics(logits, mask, local, counted)
        if stats is None:
            return None
        weights = aux.gradient_weights(stats, self.num_experts, coef=1.0)
        surrogate = torch.stack([aux.surrogate_loss(layer, weights, counted).to(local.device)
                                 for layer in logits]).sum()
        dp = parallel_state.get_data_parallel_size()
        gradient_only = dp * (surrogate - surrogate.detach())
        term = aux.aux_loss(stats, self.num_experts).to(local.dtype) + gradient_only.to(local.dtype)
        if output.loss is not None:
            output.loss = output.loss + module.router_aux_loss_coef * (term - local).to(output.loss.device)
        output.aux_loss = term
        return output

    def _statistics(self, logits: list[torch.Tensor], mask, device) -> torch.Tensor:
        stats = aux.empty_statistics(self.num_experts, device)
        for layer in logits:
            stats += aux.router_statistics(layer, num_experts=self.num_experts, top_k=self.top_k, mask=mask).to(device)
        return stats

    def _global_statistics(self, logits: list[torch.Tensor], mask, local: torch.Tensor,
                           counted) -> torch.Tensor | None:
        """The partial sums of the ``counted`` tokens summed over the data group, or None (every
        rank alike) when on some replica the sums of HF's ``mask`` do not give HF's own aux loss
        back (an architecture with another formula)."""
        stats = self._statistics(logits, mask, local.device)
        mine = aux.aux_loss(stats, self.num_experts)
        differs = ~torch.isclose(mine, local.detach().float().to(mine.device), rtol=1e-3, atol=1e-6)
        if counted is not mask:
            stats = self._statistics(logits, counted, local.device)
        stats = aux.reduce_statistics(torch.cat([stats, differs.float().reshape(1)]),
                                      [parallel_state.get_data_parallel_group()])
        if stats[-1] > 0:
            self._warn("this model's aux loss is not HF's load_balancing_loss_func of its router logits: it stays "
                       "each data-parallel replica's (not the global batch's)")
            return None
        return stats[:-1]

    def _warn(self, message: str) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(message, stacklevel=3)
