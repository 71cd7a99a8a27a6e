"""The ``TrainingArguments`` options that ``NxDTrainer`` applies itself, on the parallel model,
instead of ``Trainer``: Liger's kernels (``use_liger_kernel``), ``torch_compile`` and
``label_smoothing_factor``."""

import contextlib

from nxd_hf import backend
from nxd_hf.model_setup.liger import liger_options
from nxd_hf.pipeline.model import NxDPPModel
from nxd_hf.tp.outputs import has_causal_lm_loss, label_smoothing
from nxd_hf.trainer.arguments import NxDTrainingArguments
from nxd_hf.trainer.model import NxDModel
from nxd_hf.trainer.user_hooks import runs_own_compute_loss


def check_liger(args: NxDTrainingArguments) -> None:
    """``use_liger_kernel`` fails before any work when it cannot apply (model_setup/liger.py)."""
    liger_options(args.liger_kernel_config)
    device = backend.default_device().type
    if device != "cuda":
        raise ValueError(f"use_liger_kernel=True: Liger's kernels are Triton kernels for CUDA GPUs and this run "
                         f"computes on {device}. Drop use_liger_kernel on CPU and XLA")
    if args.pipeline_parallel_size > 1:
        raise ValueError("use_liger_kernel=True is not supported with pipeline_parallel_size > 1: drop one of them")


@contextlib.contextmanager
def without_trainers_liger_patch(args: NxDTrainingArguments):
    """``Trainer.__init__`` would apply Liger with its full-vocabulary loss on vocab-parallel logits;
    NxDTrainer applies the kernels itself after it (``apply_liger_kernels``)."""
    asked, args.use_liger_kernel = args.use_liger_kernel, False
    try:
        yield
    finally:
        args.use_liger_kernel = asked


def compile_model(nxd_model: NxDModel, args: NxDTrainingArguments) -> None:
    """``torch_compile``: the parallel HF model compiled in place (``nn.Module.compile``: its
    parameter names, hooks and checkpoints stay those of the uncompiled model)."""
    if isinstance(nxd_model.module, NxDPPModel):
        raise ValueError("torch_compile=True is not supported with pipeline_parallel_size > 1: drop torch_compile "
                         "or train without pipeline parallelism")
    kwargs = {"backend": args.torch_compile_backend or "inductor"}
    if args.torch_compile_mode:
        kwargs["mode"] = args.torch_compile_mode
    nxd_model.hf_model.compile(**kwargs)


class _ShiftedLabelSmoother:
    """``Trainer``'s ``LabelSmoother`` with the labels shifted, as ``Trainer.compute_loss`` calls it
    for a causal LM: it tells one by the class name of the model it is handed, here the
    ``NxDModel`` wrapper, and would compare unshifted labels (evaluation, a subclass's loss)."""

    def __init__(self, smoother):
        self.smoother = smoother

    def __call__(self, model_output, labels, shift_labels=False, num_items_in_batch=None):
        return self.smoother(model_output, labels, shift_labels=True, num_items_in_batch=num_items_in_batch)


def setup_label_smoothing(trainer) -> None:
    """``label_smoothing_factor``: ``Trainer`` runs its ``LabelSmoother`` on the full logits, which
    tensor parallelism does not hold in training; with ``Trainer``'s own ``compute_loss`` NxDTrainer
    has the vocab-parallel causal-LM loss smooth the labels instead (``smoothed_loss``), the same
    numbers. A subclass's ``compute_loss`` runs as it would under ``Trainer`` (TRL's SFT calls the
    smoother on logits the model gathers without labels), except where the pipeline schedule runs
    the model in its place; evaluation, as under ``Trainer``, on the gathered logits."""
    if not trainer.args.label_smoothing_factor:
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    hf_model = trainer.nxd_model.hf_model
    base = hf_model.get_base_model() if hasattr(hf_model, "get_base_model") else hf_model
    if base._get_name() in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():  # Trainer's rule, on the HF model
        trainer.label_smoother = _ShiftedLabelSmoother(trainer.label_smoother)
    if runs_own_compute_loss(trainer):
        if trainer.nxd_model.pipelined:  # NxDSFTTrainer's own pipeline loss
            raise ValueError(f"label_smoothing_factor with pipeline_parallel_size > 1: {type(trainer).__name__}'s "
                             "loss on the last stage does not smooth labels. Drop one of them")
        return
    if not has_causal_lm_loss(hf_model):
        raise ValueError(f"label_smoothing_factor: NxDTrainer smooths the labels inside nxd_hf's vocab-parallel "
                         f"causal-LM loss, and {type(hf_model).__name__} computes another loss. Drop "
                         "label_smoothing_factor")
    if getattr(hf_model.config, "output_router_logits", False):
        raise ValueError("label_smoothing_factor with output_router_logits=True: Trainer's LabelSmoother replaces "
                         "the model's loss and so drops the router's auxiliary loss, which NxDTrainer would keep. "
                         "Drop one of them")


def smoothed_loss(trainer):
    """The context ``NxDTrainer`` computes its default loss in (``setup_label_smoothing``)."""
    return label_smoothing(trainer.args.label_smoothing_factor)
