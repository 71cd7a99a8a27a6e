"""HF's load-balancing (aux) loss when the routed layers sit on several pipeline stages.

The loss of one ``run_train`` call is HF's aux loss of that whole batch (all microbatches, all
data-parallel replicas: the batch the unparallelized model would see), computed from partial
sums (``nxd_hf.moe.aux_loss``). Its gradient needs the complete top-k counts before any
backward, which a 1F1B schedule starts before the last forward; so a training step with the
aux loss first runs the forwards alone (no autograd) to collect each stage's partial sums, sums
them over the pipeline and data-parallel groups, and then runs the schedule with every router
adding its surrogate loss (whose gradient is HF's) to the backward of its decoder layer. The
cost is one extra forward per step. The returned loss includes ``coef * aux``.

Routers are found as HF finds them (the ``router_logits`` ``OutputRecorder``); the k-th forward
of a router within a pass is microbatch k (every schedule runs a stage's forwards in order).
"""

import torch
from torch import nn

from nxd_hf import parallel_state
from nxd_hf.moe import aux_loss as aux


class RouterAuxLoss:
    """Forward hooks on this rank's routers and decoder layers (see module doc). ``mode``:
    "off", "collect" (sum the partial statistics) or "attach" (add surrogate losses)."""

    def __init__(self, spec: aux.AuxLossSpec, stages: list[nn.Module], layer_types: tuple[type, ...],
                 device: torch.device):
        self.spec, self.device = spec, device
        self.mode = "off"
        self.masks: list[torch.Tensor | None] = []
        self.calls: dict[int, int] = {}
        self.pending: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.stats = aux.empty_statistics(spec.num_experts, device)
        self.weights = None
        self.routers = [m for stage in stages for m in stage.modules() if isinstance(m, spec.router_cls)]
        for router in self.routers:
            router.register_forward_hook(self._router_hook)
        for layer in {id(m): m for stage in stages for m in stage.modules() if isinstance(m, layer_types)}.values():
            layer.register_forward_hook(self._layer_hook)

    def begin(self, mode: str, masks: list[torch.Tensor | None], weights: torch.Tensor | None = None) -> None:
        self.mode, self.masks, self.weights = mode, masks, weights
        self.calls, self.pending = {}, []
        if mode == "collect":
            self.stats = aux.empty_statistics(self.spec.num_experts, self.device)

    def end(self) -> None:
        self.mode, self.pending = "off", []

    def complete_statistics(self) -> torch.Tensor:
        """The collected partial sums, summed over the pipeline and data-parallel groups."""
        groups = [parallel_state.get_pipeline_model_parallel_group(), parallel_state.get_data_parallel_group()]
        return aux.reduce_statistics(self.stats, groups)

    def _router_hook(self, module, args, output):
        if self.mode == "off" or torch._C._current_graph_task_id() != -1:  # not a recompute inside backward
            return
        k = self.calls.get(id(module), 0)
        self.calls[id(module)] = k + 1
        logits = output[self.spec.index] if isinstance(output, (tuple, list)) else output
        if k >= len(self.masks):
            raise ValueError(
                f"a {type(module).__name__} ran {k + 1} times in a pass of {len(self.masks)} microbatches: nxd_hf's "
                "aux loss across pipeline stages needs each router called once per microbatch (no router shared "
                "between layers); set config.output_router_logits=False to train without the aux loss")
        mask = self.masks[k]
        if self.mode == "collect":
            self.stats += aux.router_statistics(logits, num_experts=self.spec.num_experts, top_k=self.spec.top_k,
                                                mask=mask).to(self.device)
        elif torch.is_grad_enabled():
            self.pending.append((logits, mask))

    def _layer_hook(self, module, args, output):
        """The surrogate is computed here, outside the layer: under activation checkpointing the
        layer's inside is recomputed in backward, where the router hook does nothing."""
        if not self.pending:
            return None
        side = torch.stack([aux.surrogate_loss(logits, self.weights, mask) for logits, mask in self.pending]).sum()
        self.pending = []
        if isinstance(output, torch.Tensor):
            return _attached(output, side)
        return type(output)((_attached(output[0], side), *output[1:]))


def _attached(hidden: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
    """``hidden`` carrying ``side`` into its backward, as a tensor of its own: the zero-bubble
    schedules' input-gradient step detaches a stage's outputs in place, which a view cannot be."""
    return aux.attach_loss(hidden, side.to(hidden.dtype)).clone()


def microbatch_masks(inputs: dict, num_microbatches: int, padded_rows: int = 0) -> list[torch.Tensor | None]:
    """The 2-D attention mask of each microbatch as HF's aux loss reads it (None: no mask).
    ``padded_rows``: the batch's last rows only fill the microbatches; their tokens count for nothing."""
    mask = inputs.get("attention_mask")
    if padded_rows:
        ids = inputs["input_ids"]
        mask = mask.clone() if mask is not None and mask.dim() == 2 else torch.ones(ids.shape[:2], device=ids.device)
        mask[-padded_rows:] = 0
    if mask is None or mask.dim() != 2:
        return [None] * num_microbatches
    return list(mask.tensor_split(num_microbatches))
