"""``ParallelModule``: the module ``nxd_hf.nnscaler.parallelize`` returns.

It holds the user's module after nxd_hf's setup sequence (``nxd_hf.nnscaler.build``): its
parameters under their original names (``state_dict`` keys are the user module's), the setup
record ``nxd`` (``nxd_hf.model_state``) and, at pp > 1, the ``NxDPPModel`` of this rank's
stages. ``forward`` runs the module (its traced graph under tensor parallelism, one per
``self.training`` mode); end2end modules train with ``train_step`` and infer with ``infer_step``.
"""

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nxd_hf import backend, parallel_state
from nxd_hf.model_state import NxDModelState, state_of
from nxd_hf.nnscaler import end2end
from nxd_hf.nnscaler.config import ComputeConfig
from nxd_hf.nnscaler.policy import Plan
from nxd_hf.nnscaler.state_dicts import EXTRA_STATE_KEY, add_extra_state_hooks, module_extra_state


@dataclasses.dataclass(kw_only=True, eq=False)
class Spec:
    """What ``parallelize`` decided, kept on the ``ParallelModule`` class."""

    plan: Plan
    compute_config: ComputeConfig
    dummy_forward_args: dict = dataclasses.field(repr=False)
    new_module: Callable[[], nn.Module] | None = None
    """Builds a fresh module (the class path: ``module_fn`` or the class)."""
    initial_state: dict | None = dataclasses.field(default=None, repr=False)
    """The traced module's weights: what ``init_params=True`` starts from (class path)."""
    instance_name: str = "_"
    is_hf: bool = False


class ParallelModule(nn.Module):
    """nnScaler's ``ParallelModule`` on nxd_hf (see the module docstring)."""

    _spec: Spec | None = None

    def __init__(self, init_params: bool = True, *, _module: nn.Module | None = None):
        super().__init__()
        spec = type(self)._spec
        if spec is None:
            raise ValueError("ParallelModule is not constructed directly: call nxd_hf.nnscaler.parallelize")
        module = _module if _module is not None else spec.new_module()
        if _module is None and init_params and spec.initial_state is not None:
            module.load_state_dict(spec.initial_state)
        if not init_params:  # nnScaler: "they will be empty tensor"; zeros here, the same on every rank
            with torch.no_grad():
                for p in module.parameters():
                    p.zero_()
        from nxd_hf.nnscaler.build import build

        self._pipeline = None
        self.reducers = []  # nnScaler's: the gradient reducers; build_optimizer sets them (nxd_hf's are the optimizer's)
        training = module.training
        build(self, module, spec, init_params=init_params)
        self.train(training)  # nnScaler's: the parallel module is in the mode the module was in
        add_extra_state_hooks(self)  # state_dict() carries the layout merge_state_dicts needs (nnScaler's too)

    # -- set by build
    def _adopt(self, module: nn.Module) -> None:
        """Share ``module``'s children, parameters and buffers (same names, same objects)."""
        for key in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"):
            self.__dict__[key] = module.__dict__[key]
        self.__dict__["_module"] = module

    @property
    def nxd(self) -> NxDModelState | None:
        """The setup record of what this module runs: its pipeline's, or the adopted module's."""
        return state_of(self._pipeline if self._pipeline is not None else self.__dict__.get("_module"))

    @property
    def compute_config(self) -> ComputeConfig:
        return type(self)._spec.compute_config

    @property
    def plan(self) -> Plan:
        return type(self)._spec.plan

    @property
    def use_end2end(self) -> bool:
        return self.compute_config.use_end2end

    @property
    def use_scheduler(self) -> bool:
        """nnScaler's flag for a module run by a pipeline schedule (train_step / infer_step only)."""
        return self._pipeline is not None

    def forward(self, *args, **kwargs):
        if self._pipeline is not None:
            raise ValueError("this end2end module is pipelined: call train_step(samples) / infer_step(samples), "
                             "not forward")
        check = self.nxd.input_check
        if check is not None and not type(self)._spec.is_hf:  # an HF model checks its own inputs
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            check({f"input{i}": leaf for i, leaf in enumerate(leaves)})
        return self._run(self, *args, **kwargs)

    # -- nnScaler's step functions
    def train_step(self, samples: list[Any], is_dummy_batch: list[bool] | None = None,
                   scale_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[Any]:
        """One training step over ``samples`` (micro-batches): gradients are zeroed first, then
        accumulated (summed) over the samples and averaged over the units (data parallelism).
        ``is_dummy_batch[i]``: sample i runs but adds nothing (its loss times 0); ``scale_fn``
        scales each loss before backward. Returns each sample's output with the loss as
        backpropagated (scaled; 0 for a dummy batch); pipelined: the losses only."""
        samples, dummy = self._check_step(samples, is_dummy_batch, "train_step")
        self.zero_grad(set_to_none=True)
        if self._pipeline is not None:
            return self._pipeline_step(samples, dummy, scale_fn, train=True)
        outputs = []
        for i, sample in enumerate(samples):
            sync = contextlib.nullcontext() if i == len(samples) - 1 else self.nxd.grad_reduction.no_sync()
            with sync:
                out = self._call_sample(sample)
                loss = out[0] if isinstance(out, (tuple, list)) else out
                if scale_fn is not None:
                    loss = scale_fn(loss)
                if dummy[i]:
                    loss = loss * 0
                loss.backward()
            outputs.append(_detached((loss, *out[1:]) if isinstance(out, (tuple, list)) else loss))
        return outputs

    def infer_step(self, samples: list[Any]) -> list[Any]:
        """Outputs for ``samples`` without gradients (pipelined: each sample's loss)."""
        samples, dummy = self._check_step(samples, None, "infer_step")
        with torch.no_grad():
            if self._pipeline is not None:
                return self._pipeline_step(samples, dummy, None, train=False)
            return [self._call_sample(sample) for sample in samples]

    def _check_step(self, samples, is_dummy_batch, what: str):
        if not self.use_end2end:
            raise ValueError(f"{what} is for end2end modules: parallelize with ComputeConfig(use_end2end=True), or "
                             "call the module itself")
        samples = list(samples)
        dummy = list(is_dummy_batch) if is_dummy_batch is not None else [False] * len(samples)
        if not samples or len(dummy) != len(samples):
            raise ValueError(f"{what} needs a non-empty list of samples and one is_dummy_batch flag per sample "
                             f"(got {len(samples)} samples, {len(dummy)} flags)")
        nmicros = getattr(self._pipeline, "num_microbatches", None)
        if nmicros is not None and len(samples) != nmicros:
            raise ValueError(f"{what}: the pipeline runs pas_config['pipeline_nmicros']={nmicros} micro-batches per "
                             f"step; pass {nmicros} samples (got {len(samples)})")
        return samples, dummy

    def _call_sample(self, sample):
        if type(self)._spec.is_hf and isinstance(sample, dict):
            return self(**sample)
        return self(sample)

    def _pipeline_step(self, samples, dummy, scale_fn, *, train: bool):
        pipe = self._pipeline
        if type(self)._spec.is_hf:  # the model's own token-mean loss over all samples
            if any(dummy) or scale_fn is not None:
                raise ValueError("a pipelined Hugging Face model trains on its token-mean loss: is_dummy_batch and "
                                 "scale_fn are not supported; drop them")
            batch = {k: torch.cat([s[k] for s in samples]) for k in samples[0]}
            loss = pipe.run_train(**batch) if train else pipe.run_eval(**batch)
            losses, n = (None if loss is None else [loss]), 1
        else:
            losses, n = self._end2end_pipeline_step(pipe, samples, dummy, scale_fn, train), len(samples)
        group = parallel_state.get_pipeline_model_parallel_group()
        stacked = torch.stack(losses) if losses is not None else torch.zeros(n, device=backend.collective_device(group))
        stacked = backend.broadcast(stacked.detach().float(), pipe._runner._last_stage_rank(), group)
        return list(stacked)

    @staticmethod
    def _end2end_pipeline_step(pipe, samples, dummy, scale_fn, train: bool):
        wrapper = pipe.nxd.hf_model
        leaves, _ = end2end.flatten_samples(samples, wrapper._nxd_spec)
        n = len(samples)
        weight = torch.tensor([0.0 if d else float(n) for d in dummy], device=leaves[0].device)
        wrapper._nxd_loss_scale.fn = scale_fn
        try:
            inputs = dict(zip(wrapper._nxd_input_names, [*leaves, weight]))
            return pipe.run_train(**inputs) if train else pipe.run_eval(**inputs)
        finally:
            wrapper._nxd_loss_scale.fn = None

    # -- pipelined: only this rank's stages exist
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        if self._pipeline is None:
            yield from super().named_parameters(prefix, recurse, remove_duplicate)
            return
        for name, p in self._pipeline.local_named_parameters():
            yield prefix + name, p

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        if self._pipeline is None:
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        out = {} if destination is None else destination
        stages = self._pipeline.local_modules()
        for stage in stages:
            stage.state_dict(destination=out, prefix=prefix, keep_vars=keep_vars)
        # the stages' tensors under the original names: what merge_state_dicts reads
        out[prefix + EXTRA_STATE_KEY] = module_extra_state(self, paths={id(s._parameters): "" for s in stages})
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if self._pipeline is None:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        state_dict = {k: v for k, v in state_dict.items() if k != EXTRA_STATE_KEY}
        missing, unexpected = [], set(state_dict)
        for stage in self._pipeline.local_modules():
            keys = set(stage.state_dict())
            stage.load_state_dict({k: v for k, v in state_dict.items() if k in keys}, strict=False, assign=assign)
            missing += sorted(keys - set(state_dict))
            unexpected -= keys
        if strict and (missing or unexpected):
            raise RuntimeError(f"load_state_dict: missing keys {missing}, unexpected keys {sorted(unexpected)}")
        return nn.modules.module._IncompatibleKeys(missing, sorted(unexpected))


def _detached(out):
    return torch.utils._pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out)
