"""``NxDOptimizer``: the optimizer of the config API without ZeRO-1 (``initialize_parallel_optimizer``):
``step()`` does the data-parallel gradient reduction (unless ``reduce_in_backward``: the model's
backward does it, overlapped), gradient clipping on the global norm, and the step, on fp32 master
weights for bf16/fp16 parameters."""

import torch

from nxd_hf.checkpoint.optim_state import MASTER, ParamStates, set_torch_state, tensor_state
from nxd_hf.optim.mixed_precision import MasterWeights
from nxd_hf.parallel_layers.grad_reduction import grad_reductions_of
from nxd_hf.parallel_layers.grads import clip_grad_norm, data_parallel_mean


class NxDOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` over fp32 masters; ``step()`` = DP mean of the (fp32-accumulated)
    gradients, clipping (``grad_norm`` keeps the norm), inner step, masters back into the model.
    ``param_groups`` are the inner optimizer's, so LR schedulers work on this object.
    Checkpoints read and set its state through ``param_states`` / ``load_param_states``
    (``nxd_hf.checkpoint.optim_state``: each master's state, keyed by its parameter)."""

    shards_state_over_dp = False

    def __init__(self, params, optimizer_class, *, max_grad_norm: float | None, use_master_weights: bool,
                 bucket_size_mb: float = 25, reduce_in_backward: bool = False, **defaults):
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.masters = [MasterWeights([p for p in g["params"] if p.requires_grad], enabled=use_master_weights)
                        for g in groups]
        inner_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": m.masters}
                        for g, m in zip(groups, self.masters)]
        self.optimizer = optimizer_class(inner_groups, **defaults)
        self.reduce_in_backward = reduce_in_backward
        """The model's backward averages the gradients over DP (overlapped, per bucket; micro-steps of an
        accumulation inside ``model.no_sync()``), not ``step()``."""
        for policy in ([] if reduce_in_backward else grad_reductions_of(p for g in groups for p in g["params"])):
            policy.reduce_in_optimizer()  # step() does the data-parallel reduction
        self.max_grad_norm, self.bucket_size_mb = max_grad_norm, bucket_size_mb
        self.grad_norm: torch.Tensor | None = None
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = {}, {}
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = {}, {}

    # the inner optimizer's groups, state and defaults (load_state_dict replaces its group list)
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    @torch.no_grad()
    def step(self, closure=None):
        masters = [m for group in self.masters for m in group.masters]
        for group in self.masters:
            group.load_grads()
        if not self.reduce_in_backward:
            with_grads = [m for m in masters if m.grad is not None]
            data_parallel_mean(with_grads, [m.grad for m in with_grads], bucket_size_mb=self.bucket_size_mb)
        if self.max_grad_norm is not None:
            self.grad_norm = clip_grad_norm(masters, self.max_grad_norm)
        loss = self.optimizer.step(closure)
        for group in self.masters:
            group.store_params()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.masters:
            group.zero_grad()

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(),
                "masters": [[m.detach().clone() for m in group.masters] for group in self.masters]}

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict["optimizer"])
        with torch.no_grad():
            for group, saved in zip(self.masters, state_dict["masters"]):
                for master, value in zip(group.masters, saved):
                    master.copy_(value)
                group.store_params()

    # -- the checkpoint's optimizer-state protocol
    def param_states(self) -> ParamStates:
        out = {}
        for group in self.masters:
            for param, master in zip(group.params, group.masters):
                state = tensor_state(self.optimizer.state.get(master, {}))
                if master is not param:
                    state[MASTER] = master.detach()
                out[id(param)] = (param, state)
        return out

    def load_param_states(self, states: dict[int, dict]) -> None:
        keyed = []
        with torch.no_grad():
            for group in self.masters:
                for param, master in zip(group.params, group.masters):
                    state = dict(states.get(id(param), {}))
                    saved_master = state.pop(MASTER, None)
                    if master is not param:
                        master.copy_(saved_master if saved_master is not None else param)
                    keyed.append((master, state))
        set_torch_state(self.optimizer, keyed)
