"""``model.nxd``: what the setup sequence records about one parallel model.

``nxd_hf.parallelize`` puts one ``NxDModelState`` on the Hugging Face model it shards (``model.nxd``);
an ``NxDPPModel`` carries the same object (``pp_model.nxd``, created when it is built directly),
and so do the wrappers around them (``NxDModel.nxd``; a ``peft.PeftModel`` forwards ``.nxd`` to
the model it wraps). Code above the setup sequence (``checkpoint/``, ``lora/``, ``optim/``,
``trainer/``) reads a model's state through ``state_of`` instead of probing the model's own
attributes. This module sits below ``checkpoint/`` so every package may read it; its fields of
upper-layer types are annotated through ``TYPE_CHECKING`` imports (never imported at run time).
"""

import dataclasses
from typing import TYPE_CHECKING, Literal

from torch import nn

from nxd_hf.guards.input_check import InputCheck
from nxd_hf.parallel_layers.grad_reduction import GradReduction
from nxd_hf.parallel_layers.heads import HeadLayout
from nxd_hf.parallel_sizes import ParallelSizes

if TYPE_CHECKING:  # upper layers: for the annotations only
    from nxd_hf.checkpoint.hf_safetensors import LoadReport
    from nxd_hf.fsdp.init import InitReport
    from nxd_hf.lora.checkpoint import LoraCheckpoint
    from nxd_hf.tp.plan import ModelPatch
    from nxd_hf.trainer.config import NxDConfig


@dataclasses.dataclass(kw_only=True, eq=False)
class NxDModelState:
    """One parallel model's setup record (``model.nxd``), made by
    ``nxd_hf.model_setup.finish_parallel_model`` once the model is set up; what is learnt later
    is recorded through its methods."""

    sizes: ParallelSizes
    """The layout the model was set up for (``parallel_state``'s)."""
    hf_model: nn.Module = dataclasses.field(repr=False)
    """The Hugging Face (or plain) model the setup sequence was given; under pp > 1 the original
    whole model, whose weights only exist in this rank's stages."""
    local_modules: list[nn.Module] = dataclasses.field(repr=False)
    """This rank's modules, holding its parameters under ``hf_model``'s names: ``[hf_model]``,
    or the local pipeline stages."""
    grad_reduction: GradReduction
    """The gradient-reduction policy of this rank's modules (``no_sync``, optimizers register with it)."""
    wrapper: Literal["plain", "pipeline"] = "plain"
    """What the setup sequence returned: the model itself, or an ``NxDPPModel`` around its stages."""
    patch: "ModelPatch | None" = None
    """The resolved architecture patch; None for a module no Hugging Face plan sharded."""
    head_layout: HeadLayout | None = None
    """This rank's attention-head layout (None: no attention heads in the config, or no TP setup)."""
    input_check: InputCheck | None = None
    """The first-step input check (the pipeline's step calls it; a forward pre-hook otherwise)."""
    adapters: "LoraCheckpoint | None" = None
    """The adapters' checkpoint protocol when the setup sequence added LoRA (see
    ``nxd_hf.checkpoint.logical``), else None."""
    load_report: "LoadReport | None" = None
    """What ``nxd_hf.from_pretrained`` read (``record_load_report``)."""
    init_report: "InitReport | None" = None
    """What ``param_init_fn`` held initializing into FSDP2's DP shards (``record_init_report``)."""
    nxd_config: "NxDConfig | None" = None
    """The config API's config once an ``NxDModel`` wraps the model (checkpoint options; ``attach_config``)."""

    @property
    def pipelined(self) -> bool:
        return self.wrapper == "pipeline"

    @property
    def tp_size(self) -> int:
        return self.sizes.tp

    @property
    def pp_size(self) -> int:
        return self.sizes.pp

    @property
    def dp_size(self) -> int:
        return self.sizes.dp

    @property
    def ep_size(self) -> int:
        return self.sizes.ep

    def record_load_report(self, report: "LoadReport") -> None:
        """``nxd_hf.from_pretrained``: what this rank read of the files."""
        self.load_report = report

    def record_init_report(self, report: "InitReport") -> None:
        """``nxd_hf.parallelize``: the largest tensor ``param_init_fn`` got under ZeRO-2/3 (``nxd_hf.fsdp.init``)."""
        self.init_report = report

    def attach_config(self, nxd_config: "NxDConfig") -> None:
        """``NxDModel``: the config whose checkpoint options (master weights, LoRA) ``save_checkpoint`` reads."""
        self.nxd_config = nxd_config


def state_of(model) -> NxDModelState | None:
    """``model.nxd`` of a parallel model (or of a wrapper around one), None for any other module."""
    state = getattr(model, "nxd", None)
    return state if isinstance(state, NxDModelState) else None
