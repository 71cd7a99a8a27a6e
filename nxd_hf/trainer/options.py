"""The ``TrainingArguments`` options that ``NxDTrainer`` applies itself, on the parallel model,
instead of ``Trainer``: Liger's kernels (``use_liger_kernel``) and ``torch_compile``."""

import contextlib

from nxd_hf import backend
from nxd_hf.model_setup.liger import liger_options
from nxd_hf.pipeline.model import NxDPPModel
from nxd_hf.trainer.arguments import NxDTrainingArguments
from nxd_hf.trainer.model import NxDModel


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
