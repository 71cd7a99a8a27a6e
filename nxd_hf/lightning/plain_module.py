"""A LightningModule written the usual way under ``NxDStrategy``: automatic optimization, its
Hugging Face model an attribute built in ``__init__`` (or ``configure_model``), its own
``configure_optimizers``. Not in NxD, whose strategy takes only a ``NeuronLTModule``; without this,
each data-parallel replica trained its own copy of the model (nothing averaged the gradients) and
tp > 1 sharded nothing.

The strategy parallelizes each Hugging Face model the module holds (``nxd_hf.parallelize``: tensor
parallelism, and the data-parallel mean of its gradients at the end of each backward), before
``configure_optimizers`` runs, so the user's optimizer holds the parallel parameters. The module's
other trainable parameters (a head of its own) are replicated: their gradients are averaged over
data parallelism after each backward. Lightning's accumulation micro-steps skip both averages
(``no_sync``), as DDP's do; gradient clipping by norm is over the whole model (``clip_grad_norm``
over every shard), not this rank's shards."""

import contextlib

import torch
import torchmetrics
from torch import nn
from transformers import PreTrainedModel

from nxd_hf import parallel_state
from nxd_hf.checkpoint.optim_state import MASTER, set_torch_state, tensor_state
from nxd_hf.model_state import state_of
from nxd_hf.parallel_layers.grads import clip_grad_norm, data_parallel_mean
from nxd_hf.parallelize import parallelize


def _is_hf_model(module: nn.Module) -> bool:
    """A transformers model, or peft's wrapper of one (known by its ``peft_config``: peft is optional)."""
    return isinstance(module, PreTrainedModel) or hasattr(module, "peft_config")


def hf_models_of(module: nn.Module) -> dict[str, nn.Module]:
    """The outermost Hugging Face models inside ``module``, by their name in it."""
    found = {}

    def visit(prefix: str, parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if _is_hf_model(child):
                found[prefix + name] = child
            else:
                visit(f"{prefix}{name}.", child)

    visit("", module)
    return found


class PlainModuleParallel:
    """What the strategy did to a plain LightningModule, and what it does at each backward."""

    def __init__(self, module: nn.Module, *, tensor_parallel_size: int, pipeline_parallel_size: int):
        name = type(module).__name__
        if pipeline_parallel_size > 1:
            raise ValueError(
                f"NxDStrategy(pipeline_parallel_size={pipeline_parallel_size}) with {name}, a LightningModule of "
                "its own: a pipeline step runs the schedule over the stages (model.run_train), which Lightning's "
                "automatic optimization cannot call. Use NeuronLTModule (docs/lightning.md), or "
                "pipeline_parallel_size=1")
        self.models = hf_models_of(module)
        if tensor_parallel_size > 1 and not self.models:
            raise ValueError(
                f"NxDStrategy(tensor_parallel_size={tensor_parallel_size}): {name} holds no Hugging Face model to "
                "shard (a transformers PreTrainedModel as an attribute). Hold one, build the model with "
                "nxd_hf.parallel_layers and NeuronLTModule, or use tensor_parallel_size=1 (data parallelism)")
        for attr, model in self.models.items():
            if state_of(model) is not None:  # the user parallelized it (configure_model): as it is
                sizes = state_of(model).sizes
                if (sizes.tp, sizes.pp) != (tensor_parallel_size, pipeline_parallel_size):
                    raise ValueError(
                        f"{name}.{attr} is parallelized at tensor_parallel_size={sizes.tp}, pipeline_parallel_size="
                        f"{sizes.pp}, this NxDStrategy at {tensor_parallel_size}, {pipeline_parallel_size}: pass the "
                        "model's sizes to NxDStrategy (a model is parallelized once; build a new one for other sizes)")
                continue
            if hasattr(model, "peft_config"):
                raise ValueError(
                    f"{name}.{attr} is a peft model over an unparallelized model: NxDStrategy cannot shard the "
                    "layers peft wrapped. Parallelize first, then add the adapters: in configure_model, "
                    "nxd_hf.parallelize(base_model, tensor_parallel_size=..., lora_config=lora_config) (or "
                    "peft.get_peft_model on nxd_hf.parallelize's result)")
            parallelize(model, tensor_parallel_size=tensor_parallel_size)
        in_models = {id(p) for model in self.models.values() for p in model.parameters()}
        self.extra_params = [p for p in module.parameters() if p.requires_grad and id(p) not in in_models]
        """Trainable parameters outside the Hugging Face models: replicated, averaged here."""
        self.deferred = False

    @contextlib.contextmanager
    def no_sync(self):
        """Lightning's accumulation micro-steps: no data-parallel mean (the last backward's
        averages the accumulated sum)."""
        with contextlib.ExitStack() as stack:
            for model in self.models.values():
                stack.enter_context(state_of(model).grad_reduction.no_sync())
            previous, self.deferred = self.deferred, True
            try:
                yield
            finally:
                self.deferred = previous

    def after_backward(self) -> None:
        if self.deferred or parallel_state.get_data_parallel_size() == 1:
            return
        params = [p for p in self.extra_params if p.grad is not None]
        data_parallel_mean(params, [p.grad for p in params])

    def checkpoint_model(self, module_name: str, optimizer) -> nn.Module:
        """The one Hugging Face model a checkpoint holds; the rest of the module is ``outside_state``'s."""
        if len(self.models) != 1:
            raise ValueError(
                f"NxDStrategy.save_checkpoint: {module_name} holds {len(self.models)} Hugging Face models "
                f"({', '.join(self.models) or 'none'}): a checkpoint holds one. Save each model with "
                "nxd_hf.save_checkpoint yourself, or keep one model in the module")
        (attr, model), = self.models.items()
        known = {id(p) for p in model.parameters()} | {id(p) for p in self.extra_params}
        if optimizer is not None and any(id(p) not in known for g in optimizer.param_groups for p in g["params"]):
            raise ValueError(
                f"NxDStrategy.save_checkpoint: the optimizer of {module_name} trains tensors that are not the "
                f"module's parameters: only {module_name}'s own parameters are saved; give the optimizer those")
        return model

    def _outside(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The module's state-dict tensors outside its Hugging Face models, by name (live)."""
        inside = {id(t) for model in self.models.values() for t in [*model.parameters(), *model.buffers()]}
        return {name: t for name, t in module.state_dict(keep_vars=True).items() if id(t) not in inside}

    def outside_state(self, module: nn.Module, optimizer) -> dict:
        """Those tensors (replicated: any rank's copy is all of it) and the optimizer's state of the
        ones it trains."""
        names = {id(p): name for name, p in module.named_parameters()}
        state = optimizer.state if optimizer is not None else {}
        moments = {names[id(p)]: {k: v.detach().cpu().clone() for k, v in tensor_state(state[p]).items()}
                   for p in self.extra_params if p in state}
        return {"tensors": {name: t.detach().cpu().clone() for name, t in self._outside(module).items()},
                "optimizer": moments}

    def load_outside_state(self, module: nn.Module, optimizer, saved: dict) -> None:
        current = self._outside(module)
        if set(saved["tensors"]) != set(current):
            raise ValueError(
                f"NxDStrategy: the checkpoint's tensors outside the Hugging Face model "
                f"({sorted(saved['tensors'])[:5]}) are not {type(module).__name__}'s ({sorted(current)[:5]}): load it "
                "into the kind of module that saved it")
        with torch.no_grad():
            for name, value in saved["tensors"].items():
                current[name].copy_(value)
        if optimizer is not None:  # validate has none
            params = dict(module.named_parameters())
            set_torch_state(optimizer, [(params[name], moments) for name, moments in saved["optimizer"].items()])


class ModelShareOfOptimizer:
    """The user's optimizer as nxd_hf's checkpoint sees it (``OptimizerState``): the state of the
    Hugging Face model's parameters, in their layout; the module's own layers' state is
    ``outside_state``'s. Hyperparameters (lr, ...) are the optimizer's own groups."""

    shards_state_over_dp = False

    def __init__(self, optimizer, model: nn.Module):
        self.optimizer = optimizer
        self._inside = {id(p) for p in model.parameters()}

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"] if id(p) in self._inside]

    def param_states(self) -> dict:
        return {id(p): (p, tensor_state(self.optimizer.state.get(p, {}))) for p in self._params()}

    def load_param_states(self, states: dict) -> None:
        set_torch_state(self.optimizer, [(p, {k: v for k, v in states.get(id(p), {}).items() if k != MASTER})
                                         for p in self._params()])


def clip_by_global_norm(optimizer, clip_val: float) -> torch.Tensor:
    """Lightning's ``gradient_clip_val`` (by norm) over the whole model: every TP shard, each
    replicated tensor once."""
    return clip_grad_norm([p for group in optimizer.param_groups for p in group["params"]], clip_val)


def sync_metrics_over_data_parallel(module: nn.Module) -> None:
    """torchmetrics' metrics sync over the whole world by default, where the ranks of a TP group
    (and of a pipeline stage's peers) saw the same rows: a sum counted them tp times. Over data
    parallelism, each replica's rows count once; a metric given its own process group keeps it."""
    for metric in module.modules():
        if isinstance(metric, torchmetrics.Metric) and metric.process_group is None:
            metric.process_group = parallel_state.get_data_parallel_group()
