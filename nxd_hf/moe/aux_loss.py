"""HF's load-balancing (aux) loss when a model's router logits are spread over pipeline stages,
microbatches or data-parallel replicas.

With ``output_router_logits`` HF's MoE causal LMs (Mixtral, Qwen2/3-MoE, OLMoE, ...) add
``router_aux_loss_coef * load_balancing_loss_func(router_logits of all layers, E, k, mask)``.
Over all routed layers l and (unmasked) tokens t, with p = softmax(logits):

    T_e = sum_{l,t} m_t [e in topk(p_lt)]    P_e = sum_{l,t} m_t p_lte    R = sum_{l,t} m_t
    aux = E * sum_e (T_e / R) * (P_e / R)

A product of sums, so not additive over layers or tokens — but the three sums are. Each holder
of some layers' logits computes its partial ``(T, P, R)`` (``router_statistics``), the partials
are summed over stages and replicas (``reduce_statistics``), and then the loss and its
gradient follow exactly: T and R carry no gradient (top-k counts, mask sums), so
``d(coef * aux) / dP_e = coef * E * T_e / R^2`` (``gradient_weights``) and each holder's routers
get HF's gradient from the surrogate ``sum_e w_e * P_e(local)`` (``surrogate_loss``), whose
value summed over holders is ``coef * aux`` as well.
"""

import dataclasses

import torch
import torch.nn.functional as F

from nxd_hf import backend


@dataclasses.dataclass(kw_only=True)
class AuxLossSpec:
    """What HF's causal-LM forward uses to add the aux loss, read from the model."""

    num_experts: int
    top_k: int
    coef: float
    router_cls: type
    """The module class whose output holds a layer's router logits (HF's ``OutputRecorder``)."""
    index: int
    """Position of the router logits in that module's output tuple."""


def aux_loss_spec(hf_model) -> AuxLossSpec | None:
    """The aux-loss spec of ``hf_model``, or None when its forward adds no aux loss (no
    ``output_router_logits`` in the config, a zero coefficient, or no recorded router logits)."""
    config = getattr(hf_model, "config", None)
    if config is None or not getattr(config, "output_router_logits", False):
        return None
    coef = getattr(hf_model, "router_aux_loss_coef", None)
    if not coef or not hasattr(hf_model, "num_experts") or not hasattr(hf_model, "num_experts_per_tok"):
        return None
    recorder = None
    for module in hf_model.modules():
        recorder = (getattr(module, "_can_record_outputs", None) or {}).get("router_logits") or recorder
    if recorder is None or getattr(recorder, "target_class", None) is None:
        return None
    return AuxLossSpec(num_experts=hf_model.num_experts, top_k=hf_model.num_experts_per_tok, coef=float(coef),
                       router_cls=recorder.target_class, index=recorder.index or 0)


def router_statistics(router_logits: torch.Tensor, *, num_experts: int, top_k: int,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's partial sums ``cat([T (E), P (E), R (1)])`` in fp32, without gradient:
    computed as HF's ``load_balancing_loss_func`` computes them. ``router_logits``:
    ``[tokens, E]``; ``mask``: the attention mask of those tokens (any shape), or None."""
    with torch.no_grad():
        probs = F.softmax(router_logits, dim=-1)
        _, selected = torch.topk(probs, top_k, dim=-1)
        if mask is None:
            weights = torch.ones(selected.shape[0], dtype=torch.float32, device=probs.device)
        else:
            weights = mask.reshape(-1).to(device=probs.device, dtype=torch.float32)
        counts = torch.zeros(num_experts, dtype=torch.float32, device=probs.device).scatter_add_(
            0, selected.reshape(-1), weights.repeat_interleave(top_k))
        prob_sums = (probs.float() * weights.unsqueeze(-1)).sum(dim=0)
        return torch.cat([counts, prob_sums, weights.sum().reshape(1)])


def empty_statistics(num_experts: int, device) -> torch.Tensor:
    return torch.zeros(2 * num_experts + 1, dtype=torch.float32, device=device)


def reduce_statistics(stats: torch.Tensor, groups) -> torch.Tensor:
    """The partial sums summed over each process group in ``groups`` (those that split the
    routed layers or the tokens: pipeline, data); in place, returned."""
    for group in groups:
        backend.all_reduce(stats, group)
    return stats


def aux_loss(stats: torch.Tensor, num_experts: int) -> torch.Tensor:
    """HF's aux loss (without the coefficient) from the complete sums."""
    counts, prob_sums, rows = stats[:num_experts], stats[num_experts:2 * num_experts], stats[-1]
    return torch.sum((counts / rows) * (prob_sums / rows).unsqueeze(0)) * num_experts


def gradient_weights(stats: torch.Tensor, num_experts: int, coef: float) -> torch.Tensor:
    """``w_e = coef * E * T_e / R^2``: the gradient of ``coef * aux`` with respect to ``P_e``."""
    counts, rows = stats[:num_experts], stats[-1]
    return coef * num_experts * counts / (rows * rows)


def surrogate_loss(router_logits: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_e w_e * P_e`` over these logits' tokens: differentiable, its gradient is HF's aux
    gradient for them (``weights`` from ``gradient_weights`` of the complete sums)."""
    probs = F.softmax(router_logits, dim=-1).float()
    if mask is not None:
        probs = probs * mask.reshape(-1, 1).to(device=probs.device, dtype=torch.float32)
    return probs.sum(dim=0) @ weights.to(probs.device)


class _AttachLoss(torch.autograd.Function):
    """``x`` unchanged; backward also sends a gradient of one into ``side``, so a loss computed
    inside a stage reaches its parameters through that stage's backward."""

    @staticmethod
    def forward(ctx, x, side):
        ctx.side_shape = side.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones(ctx.side_shape, dtype=grad.dtype, device=grad.device)


def attach_loss(x: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
    """``x``, with ``side`` (a scalar) added to the loss its backward differentiates."""
    return _AttachLoss.apply(x, side)
