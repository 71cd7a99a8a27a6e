"""The adapters' random initialization at pipeline parallelism: each stage's adapters are drawn
from the generator state plain peft would be in when it reaches that layer on the whole model.

peft creates the adapters one target layer after another, in the whole model's module order,
from the default (CPU) generator: ``nn.Linear`` construction of A [r, in] and B [out, r], then
A's init (kaiming-uniform, or normal for "gaussian"). A pipeline stage holds some of the layers,
so injecting into it alone would draw the first layers' numbers for its own. Before injecting,
``stage_rng_states`` replays peft's draws for every target of the whole model (peft's own
``lora.Linear`` on a meta stand-in of the layer's logical shape: the same calls, adapter-sized
tensors) and records the generator state at each; ``dispatch`` restores the recorded state when
peft creates the adapter of that layer on the stage; afterwards the generator is where plain
peft leaves it. Inits that do not draw (``False`` still draws in the constructors) are the same."""

import contextlib

import torch
from peft.tuners.lora import layer as peft_lora
from peft.utils.other import get_pattern_key
from torch import nn

from nxd_hf.parallel_layers import ColumnParallelLinear, RowParallelLinear

_STATES: dict[int, torch.Tensor] = {}
"""id(target module) -> the generator state peft would have when creating its adapter."""


def _logical_features(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        return module.input_size, module.output_size
    if type(module) is nn.Linear:
        return module.in_features, module.out_features
    raise ValueError(
        f"LoRA at pipeline_parallel_size > 1 draws each stage's adapters as plain peft would on the whole model, "
        f"which nxd_hf does for linear layers only, not {type(module).__name__}: target linear layers only, use "
        "init_lora_weights=False with adapters loaded from a saved adapter, or pipeline_parallel_size=1")


def replay(config, name: str, module: nn.Module) -> None:
    """Draw what peft draws creating the adapter of ``module`` (named ``name`` in the whole model)."""
    in_features, out_features = _logical_features(module)
    r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), name), config.r)
    alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), name), config.lora_alpha)
    stand_in = nn.Linear(in_features, out_features, bias=False, device="meta")
    peft_lora.Linear(stand_in, "nxd_hf_rng_replay", config=config, r=r, lora_alpha=alpha)


def drawn_adapter(config, module: nn.Module, *, adapter_name: str, r: int, alpha, dtype: torch.dtype):
    """(A [r, in], B [out, r]) as peft draws them from the generator creating the adapter of
    ``module``, a linear layer of ``dtype``: on a one-element stand-in of its logical weight
    (``nxd_hf.lora.meta_base``), cast to ``dtype`` as peft casts them to the base's."""
    in_features, out_features = _logical_features(module)
    stand_in = nn.Linear(in_features, out_features, bias=False, device="meta")
    stand_in.weight = nn.Parameter(torch.empty((), dtype=dtype).expand(out_features, in_features), requires_grad=False)
    layer = peft_lora.Linear(stand_in, adapter_name, config=config, r=r, lora_alpha=alpha)
    return layer.lora_A[adapter_name].weight.detach(), layer.lora_B[adapter_name].weight.detach()


def stage_rng_states(config, hf_model: nn.Module, whole_model_targets: list[str], stage_modules: list) -> torch.Tensor:
    """Records, for each target of ``stage_modules``, the generator state at which plain peft
    creates its adapter on ``hf_model`` (targets in ``whole_model_targets``' order); returns the
    state after the last target."""
    local = {}
    for stage in stage_modules:
        for name, module in stage.named_modules():
            local[name] = module
    start = torch.get_rng_state()
    for name in whole_model_targets:
        if name in local:
            _STATES[id(local[name])] = torch.get_rng_state()
        replay(config, name, hf_model.get_submodule(name))
    end = torch.get_rng_state()
    torch.set_rng_state(start)
    return end


@contextlib.contextmanager
def drawn_as_whole_model(config, hf_model: nn.Module, whole_model_targets: list[str], stage_modules: list):
    """Inside: peft's adapter creation on ``stage_modules`` draws as on the whole model; after,
    the generator is where plain peft on the whole model leaves it."""
    end = stage_rng_states(config, hf_model, whole_model_targets, stage_modules)
    try:
        yield
    finally:
        _STATES.clear()
    torch.set_rng_state(end)


def restore_state_for(target: nn.Module) -> None:
    """Called by the dispatch as peft creates ``target``'s adapter."""
    state = _STATES.get(id(target))
    if state is not None:
        torch.set_rng_state(state)
