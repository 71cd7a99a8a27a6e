"""TRL's ``DPOTrainer`` on nxd_hf: ``NxDDPOTrainer`` and ``NxDDPOConfig`` (TRL is an optional
extra, ``pip install nxd_hf[trl]``); ``nxd_hf.parallel_trainer(DPOTrainer)`` returns this class.

``NxDDPOTrainer`` is ``DPOTrainer`` with ``NxDTrainer`` first in the method order (see
``nxd_hf.integrations.subclass``). What DPO needs beyond that:

- the policy's and the reference's per-token log-probabilities come from TRL's fused LM head,
  which nxd_hf replaces on both models by one computing them from the vocab-parallel logits
  (``nxd_hf.integrations.fused_head``): the full vocabulary is never gathered;
- the reference model is a frozen copy of the policy parallelized with the same layout (or the
  ``ref_model`` given, parallelized likewise); with ``peft_config`` there is none: the reference
  is the policy with its adapters disabled, as DPOTrainer does;
- a batch is ``[chosen rows; rejected rows]``: each data-parallel replica takes its pairs, its
  slice of the chosen rows and the same slice of the rejected rows (``pair_rows``);
- ``per_device_eval_batch_size`` counts pairs per replica, as the train batch (as in
  ``NxDTrainer``): an evaluation batch is the global one, evaluated whole by every replica;
- under pipeline parallelism the reference's and the policy's passes of the schedule, the DPO loss
  and metrics on the last stage: ``nxd_hf.integrations.dpo_pipeline``.
"""

import copy
import dataclasses

from torch import nn
from trl import DPOConfig, DPOTrainer

from nxd_hf import parallel_state
from nxd_hf.integrations import fused_head
from nxd_hf.integrations.dpo_pipeline import PipelineDPOMixin, PipelinedReference, adapters_disabled
from nxd_hf.integrations.model_path import load_named_model
from nxd_hf.integrations.pairs import check_pairs_split, pair_rows
from nxd_hf.integrations.subclass import ParallelTrainerMixin, combined_arguments, refuse_set_fields, trl_refusals


@dataclasses.dataclass(kw_only=True)
class NxDDPOConfig(combined_arguments(DPOConfig)):
    """TRL's ``DPOConfig`` and ``NxDTrainingArguments`` in one dataclass (one ``HfArgumentParser``)."""

    def __post_init__(self):
        super().__post_init__()
        refused = {
            **trl_refusals(self),
            "precompute_ref_log_probs": (self.precompute_ref_log_probs, "drop it: the reference is a frozen "
                                         "parallel copy, computed at every step"),
            "sync_ref_model": (self.sync_ref_model, "drop it (not supported with nxd_hf yet)"),
            "sequence_parallel": (self.sequence_parallel, "drop it (the preference batches are not padded to a "
                                  "multiple of tensor_parallel_size)"),
        }
        refuse_set_fields("NxDDPOTrainer", refused)


# DPOTrainer's losses that are not a mean of per-pair terms
BATCH_COUPLED_LOSSES = {"sft", "aot", "aot_unpaired"}


class _DPOInit(DPOTrainer):
    """DPOTrainer's ``__init__`` as ``NxDTrainer`` calls its next class's (``model, args`` first),
    given the policy already parallelized: the reference is parallelized here, with the groups
    the policy's layout created."""

    def __init__(self, model, args, *trainer_args, ref_model=None, **trainer_kwargs):
        pipelined = self.nxd_model.pipelined
        coupled = sorted(set(args.loss_type) & BATCH_COUPLED_LOSSES)
        if coupled and parallel_state.get_data_parallel_size() > 1:
            raise ValueError(f"loss_type {coupled} couples the rows of a batch (a token mean over it, or a sort of it): "
                             "data-parallel replicas would each compute it over their own rows, not the global batch's. "
                             "Use tensor_parallel_size = the world size, or per-pair losses ('sigmoid', 'ipo', ...)")
        if coupled and pipelined and self.nxd_model.module.num_microbatches > 1:
            raise ValueError(f"loss_type {coupled} couples the rows of a batch (a token mean over it, or a sort of it): "
                             "each pipeline microbatch would compute it over its own rows. Use num_microbatches=1, or "
                             "per-pair losses ('sigmoid', 'ipo', ...)")
        if ref_model is not None:
            ref_model = _frozen_parallel_copy(ref_model, args, self.nxd_config if pipelined else None)
        elif self.nxd_config.lora_config is not None:
            ref_model = AdaptersDisabled(model)
        DPOTrainer.__init__(self, model, ref_model, args, *trainer_args, **trainer_kwargs)
        if pipelined:
            if self.aux_loss_enabled:
                raise ValueError("MoE router logits (router_aux_loss_coef) are not supported by NxDDPOTrainer with "
                                 "pipeline parallelism: set router_aux_loss_coef=0.0")
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            policy, reference = fused_head.trl_settings(base), fused_head.trl_settings(self.ref_model)
            assert policy is not None and reference is not None, "DPOTrainer patches both with TRL's fused LM head"
            self.ref_model.__dict__.pop("forward")  # a holder: the schedule runs the model
            self._nxd_pipeline_setup(policy, reference)
        elif isinstance(ref_model, AdaptersDisabled):
            # DPOTrainer patched its forward with TRL's fused head, which would run the policy's
            # backbone with the adapters on: its own forward calls the policy (nxd_hf's head)
            ref_model.__dict__.pop("forward")
        else:
            fused_head.install(self.ref_model)


class NxDDPOTrainer(PipelineDPOMixin, ParallelTrainerMixin, _DPOInit):
    """``trl.DPOTrainer`` with tensor, pipeline and data parallelism (ZeRO-1) and LoRA; ``args``:
    ``NxDDPOConfig`` (module docstring). Takes DPOTrainer's arguments; ``model`` may be a name or a
    directory, as DPOTrainer's (loaded with ``args.model_init_kwargs``)."""

    nxd_pipeline_hooks = ("compute_loss", "prediction_step", "evaluate")  # nxd_hf.integrations.dpo_pipeline

    def __init__(self, model=None, ref_model=None, args: NxDDPOConfig | None = None, *trainer_args,
                 peft_config=None, quantization_config=None, **trainer_kwargs):
        if not isinstance(args, NxDDPOConfig):
            raise ValueError("NxDDPOTrainer takes args=nxd_hf.NxDDPOConfig(...) (or nxd_hf.parallel_arguments("
                             "DPOConfig)(...)): DPOConfig's fields and the parallel layout in one dataclass")
        if quantization_config is not None:
            raise ValueError("quantization_config is not supported by nxd_hf.NxDDPOTrainer: train the model in "
                             "fp32 or bf16 (bf16=True)")
        from transformers import set_seed

        set_seed(args.seed)  # DPOTrainer seeds before it creates the model and its adapter: the same weights
        if isinstance(model, str):
            model = load_named_model(model, args, trainer_kwargs, trainer="NxDDPOTrainer")
        if ref_model is not None and ref_model is model:
            raise ValueError("`model` and `ref_model` cannot be the same object: omit ref_model (a frozen copy of the "
                             "model is the reference)")
        if ref_model is not None and peft_config is not None:
            raise ValueError("ref_model with peft_config: the reference is the model with its adapters disabled; "
                             "omit ref_model")
        if ref_model is None and peft_config is None:
            ref_model = copy.deepcopy(model)  # before the policy is sharded in place
        super().__init__(model, args, *trainer_args, ref_model=ref_model, peft_config=peft_config, **trainer_kwargs)

    def _nxd_replica_rows(self, batch: dict) -> dict:
        return pair_rows(batch)

    def get_train_dataloader(self):
        check_pairs_split(self.train_dataset, self.args)
        return super().get_train_dataloader()

    def _save_checkpoint(self, model, trial):
        self.create_model_card(model_name=self.args.output_dir.rstrip("/").split("/")[-1])
        super()._save_checkpoint(model, trial)


class AdaptersDisabled(nn.Module):
    """DPO's reference under LoRA: the policy with its adapters disabled (what DPOTrainer gets
    from ``peft``'s ``disable_adapter``). The policy is not a submodule: nothing of it is the
    reference's own."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.__dict__["policy"] = policy

    @property
    def config(self):
        return self.policy.config

    def forward(self, *args, **kwargs):
        with adapters_disabled([self.policy]):
            return self.policy(*args, **kwargs)


def _frozen_parallel_copy(model: nn.Module, args, nxd_config=None) -> nn.Module:
    """``model`` sharded with the policy's layout, without gradients, in evaluation mode; with
    ``nxd_config`` (pipeline parallelism) split into the policy's pipeline stages too."""
    from nxd_hf.model_state import state_of
    from nxd_hf.parallelize import parallelize

    if not hasattr(model, "config") or state_of(model) is not None:
        raise ValueError("ref_model must be a plain Hugging Face model (not parallelized: nxd_hf shards it like the "
                         f"policy), got {type(model).__name__}; or omit it: a frozen copy of the model is the reference")

    pipeline = {} if nxd_config is None else {"pipeline_parallel_size": nxd_config.pipeline_parallel_size,
                                              **nxd_config.pipeline_config}
    ref = parallelize(model, tensor_parallel_size=args.tensor_parallel_size, pad_model={
        "auto": "auto", "true": True, "false": False}[str(args.pad_model).lower()],
        kv_size_multiplier="auto" if args.kv_size_multiplier == "auto" else int(args.kv_size_multiplier), **pipeline)
    if nxd_config is None:
        ref.requires_grad_(False)
        return ref.eval()
    ref.move_model_to_device()
    for stage in ref.local_modules():
        stage.requires_grad_(False)
        stage.eval()
    return PipelinedReference(ref)
