"""``model.nxd``: what the setup sequence records about one parallel model.

``nxd_hf.parallelize`` puts one ``NxDModelState`` on the Hugging Face model it shards (``model.nxd``);
an ``NxDPPModel`` carries the same object (``pp_model.nxd``, created when it is built directly),
and so do the wrappers around them (``NxDModel.nxd``; a ``peft.PeftModel`` forwards ``.nxd`` to
the model it wraps). Code above the setup sequence (``checkpoint/``, ``lora/``, ``optim/``,
``trainer/``) reads a model's state through ``state_of`` instead of probing the model's own
attributes. This module sits below ``checkpoint/`` so every package may read it; its fields of
upper-layer types are typed loosely (their packages are named in the comments).
"""

import dataclasses
from typing import Any, Literal

from torch import nn

from nxd_hf.parallel_layers.grad_reduction import GradReduction
from nxd_hf.parallel_layers.heads import HeadLayout
from nxd_hf.guards.input_check import InputCheck


@dataclasses.dataclass(kw_only=True, eq=False)
class NxDModelState:
    """One parallel model's setup record (``model.nxd``)."""

    tp_size: int
    """Tensor-parallel size the model was sharded for."""
    pp_size: int
    """Pipeline-parallel size (1: no ``NxDPPModel``)."""
    dp_size: int
    """Data-parallel size (ranks beyond tp x pp)."""
    hf_model: nn.Module = dataclasses.field(repr=False)
    """The Hugging Face (or plain) model the setup sequence was given; under pp > 1 the original
    whole model, whose weights only exist in this rank's stages."""
    local_modules: list[nn.Module] = dataclasses.field(repr=False)
    """This rank's modules, holding its parameters under ``hf_model``'s names: ``[hf_model]``,
    or the local pipeline stages."""
    wrapper: Literal["plain", "pipeline"] = "plain"
    """What the setup sequence returned: the model itself, or an ``NxDPPModel`` around its stages."""
    patch: Any = None
    """The resolved architecture patch (``nxd_hf.tp.plan.ModelPatch``); None for a plain module."""
    head_layout: HeadLayout | None = None
    """This rank's attention-head layout (None: no attention heads in the config, or no TP setup)."""
    grad_reduction: GradReduction | None = None
    """The gradient-reduction policy of this rank's modules (``no_sync``, optimizers register with it)."""
    input_check: InputCheck | None = None
    """The first-step input check (the pipeline's step calls it; a forward pre-hook otherwise)."""
    adapters: Any = None
    """The adapters' checkpoint protocol when the setup sequence added LoRA
    (``nxd_hf.lora.checkpoint.LoraCheckpoint``; see ``nxd_hf.checkpoint.logical``), else None."""
    load_report: Any = None
    """What ``nxd_hf.from_pretrained`` read (``nxd_hf.checkpoint.hf_safetensors.LoadReport``)."""
    nxd_config: Any = None
    """The config API's ``NxDConfig`` once an ``NxDModel`` wraps the model (checkpoint options)."""
    ep_size: int = 1
    """Expert-parallel size: the ranks each mixture-of-experts layer's experts are split over."""

    @property
    def pipelined(self) -> bool:
        return self.wrapper == "pipeline"


def state_of(model) -> NxDModelState | None:
    """``model.nxd`` of a parallel model (or of a wrapper around one), None for any other module."""
    state = getattr(model, "nxd", None)
    return state if isinstance(state, NxDModelState) else None
