"""TRL's fused LM head on a tensor-parallel model.

TRL's trainers patch the model (``trl.trainer.utils.add_fused_lm_head``) so that
``model(..., fused_lm_head=True)`` returns per-token log-probabilities computed from
``lm_head.weight``. Under tensor parallelism that weight is a vocabulary shard, so TRL's kernel
would normalize over part of the vocabulary: a silently wrong loss. ``install`` replaces the
patch with one that keeps TRL's settings (temperature, logit scale and soft-capping, the fields
asked for) and computes the same fields from the vocab-parallel logits (``token_stats``). Under
context parallelism the fields are those of the whole sequence, on every CP rank
(``nxd_hf.context.gather``)."""

import inspect
import types

import torch

from nxd_hf.context.gather import gather_sequence
from nxd_hf.integrations.token_stats import token_stats


def trl_settings(model) -> dict | None:
    """The settings of TRL's fused-head patch on ``model`` (None when it is not patched)."""
    forward = model.__dict__.get("forward")
    code = getattr(getattr(forward, "__func__", None), "__code__", None)
    if code is None or code.co_name != "_fused_forward":  # functools.wraps renamed it "forward"
        return None
    settings = inspect.getclosurevars(forward.__func__).nonlocals
    expected = {"temperature", "outputs", "final_logit_softcapping", "logit_scale", "backbone_attr"}
    assert expected <= set(settings), f"TRL's fused head changed: {sorted(settings)} (nxd_hf pins trl's range)"
    return {**{key: settings[key] for key in expected}, "trl_forward": forward}


def install(model) -> bool:
    """Replace TRL's fused head on ``model`` (see the module docstring); False when there is none."""
    settings = trl_settings(model)
    if settings is None:
        return False
    trl_forward = settings.pop("trl_forward")

    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            return trl_forward(*args, labels=labels, shift_labels=shift_labels,
                               num_items_in_batch=num_items_in_batch, **kwargs)
        return _fused(self, settings, args, kwargs, labels, shift_labels, num_items_in_batch)

    model.forward = types.MethodType(forward, model)
    return True


def transform(logits: torch.Tensor, settings: dict) -> torch.Tensor:
    """TRL's logit transform: scale, soft-cap, temperature."""
    logits = logits * settings["logit_scale"]
    cap = settings["final_logit_softcapping"]
    if cap:
        logits = cap * torch.tanh(logits / cap)
    return logits / settings["temperature"]


def _fused(model, settings, args, kwargs, labels, shift_labels, num_items_in_batch):
    from trl.trainer.utils import FusedCausalLMOutput

    if kwargs.get("output_router_logits"):
        raise ValueError("MoE router logits (router_aux_loss_coef) are not supported with nxd_hf's fused LM head: "
                         "set router_aux_loss_coef=0.0")
    kwargs["use_cache"] = False
    hidden = getattr(model, settings["backbone_attr"])(*args, **kwargs).last_hidden_state
    logits = model.get_output_embeddings()(hidden)  # [b, s, V/tp]: this rank's vocabulary columns
    if shift_labels is None:
        logits, labels = logits[:, :-1], labels[:, 1:]
    else:
        labels = shift_labels
    vocab_size = model.config.get_text_config().vocab_size
    stats = token_stats(transform(logits, settings), labels.to(logits.device), vocab_size, outputs=settings["outputs"])
    # under context parallelism each rank holds its chunks of the sequence: TRL sums these
    # per-token fields itself, so it gets the whole sequence's (the labels came shifted)
    stats = {key: None if value is None else gather_sequence(value) for key, value in stats.items()}
    mask = stats["label_mask"]
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return FusedCausalLMOutput(loss=-stats["log_probs"].sum() / count,
                               **{k: stats.get(k) for k in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits",
                                                            "is_top1")},
                               label_mask=mask)
