"""TRL's ``SFTTrainer`` on nxd_hf: ``NxDSFTTrainer`` and ``NxDSFTConfig`` (TRL is an optional
extra, ``pip install nxd_hf[trl]``, imported when these are first used).

``NxDSFTTrainer`` is ``nxd_hf.parallel_trainer(SFTTrainer)`` (every hook SFTTrainer overrides
runs on nxd_hf's parallel path, see ``nxd_hf.integrations.subclass``) plus what pipeline
parallelism needs, since there only the schedule runs the model: the last stage computes
SFTTrainer's loss (``loss_type`` "nll" or "dft") and its metrics (``entropy``,
``mean_token_accuracy``) from the vocab-parallel logits, and they are sent to every rank.
``peft_config`` gives nxd_hf's LoRA (the same adapter SFTTrainer's ``get_peft_model`` makes).
"""

import dataclasses

import torch
import torch.nn.functional as F
import transformers
from trl import SFTConfig, SFTTrainer

from nxd_hf import backend, parallel_state
from nxd_hf.integrations import fused_head
from nxd_hf.integrations.model_path import load_named_model
from nxd_hf.integrations.subclass import parallel_arguments, parallel_trainer
from nxd_hf.integrations.token_stats import token_stats

_METRICS = ("entropy", "is_top1", "label_mask")


@dataclasses.dataclass(kw_only=True)
class NxDSFTConfig(parallel_arguments(SFTConfig)):
    """TRL's ``SFTConfig`` and ``NxDTrainingArguments`` in one dataclass (one ``HfArgumentParser``)."""

    def __post_init__(self):
        super().__post_init__()
        if self.activation_offloading:
            raise ValueError("activation_offloading is not supported by NxDSFTTrainer: drop it (gradient_checkpointing "
                             "checkpoints every layer with nxd_hf)")
        if self.use_liger_kernel:
            raise ValueError("use_liger_kernel is not supported with nxd_hf's parallel layers: drop it")
        if self.sequence_parallel and (self.padding_free or self.packing or not self.pad_to_multiple_of
                                       or self.pad_to_multiple_of % self.tensor_parallel_size):
            raise ValueError("sequence_parallel splits every sequence over the tensor-parallel ranks: set "
                             f"pad_to_multiple_of to a multiple of tensor_parallel_size={self.tensor_parallel_size}, "
                             "without packing or padding_free")
        if self.pipeline_parallel_size > 1 and (self.padding_free or self.packing):
            raise ValueError("packing and padding_free batches are not supported with pipeline parallelism (the "
                             "schedule takes input_ids, attention_mask and labels): use pipeline_parallel_size=1")


class NxDSFTTrainer(parallel_trainer(SFTTrainer)):
    """``trl.SFTTrainer`` with tensor, pipeline and data parallelism; ``args``: ``NxDSFTConfig``.
    ``model`` may be a name or a directory, as SFTTrainer's (``nxd_hf.integrations.model_path``)."""

    nxd_pipeline_hooks = ("compute_loss", "prediction_step", "evaluate")

    def __init__(self, model=None, args: NxDSFTConfig | None = None, *trainer_args, **trainer_kwargs):
        if not isinstance(args, NxDSFTConfig):
            raise ValueError("NxDSFTTrainer takes args=nxd_hf.NxDSFTConfig(...): SFTConfig's fields and the parallel "
                             "layout in one dataclass")
        if isinstance(model, str):  # TRL's scripts pass the name; SFTTrainer seeds before it loads
            transformers.set_seed(args.seed)
            model = load_named_model(model, args, trainer_kwargs, trainer="NxDSFTTrainer",
                                     quantization_config=trainer_kwargs.pop("quantization_config", None))
        padding_free = args.padding_free or (args.packing and args.packing_strategy in {"bfd", "bfd_split"})
        # the CP ranks of a replica share its rows (the model splits the sequence)
        model_parallel = args.tensor_parallel_size * args.pipeline_parallel_size * args.context_parallel_size
        if padding_free and backend.world_size() > model_parallel:
            raise ValueError("padding-free batches (padding_free=True, or packing with packing_strategy 'bfd') are one "
                             "row, which data parallelism cannot split: use packing_strategy='wrapped', or "
                             "tensor_parallel_size x pipeline_parallel_size x context_parallel_size = the world size")
        torch.manual_seed(args.seed)  # SFTTrainer seeds before it creates the adapter: the same LoRA weights
        super().__init__(model, args, *trainer_args, **trainer_kwargs)
        self._nxd_sums: list[torch.Tensor] = []
        if self.nxd_model.pipelined:
            self._install_pipeline_loss()

    def _save_checkpoint(self, model, trial):
        self.create_model_card(model_name=self.args.output_dir.rstrip("/").split("/")[-1])
        super()._save_checkpoint(model, trial)

    # -- pipeline parallelism: SFTTrainer's loss and metrics on the last stage
    def _install_pipeline_loss(self) -> None:
        original = self.nxd_model.hf_model
        base = original.get_base_model() if hasattr(original, "get_base_model") else original
        settings = fused_head.trl_settings(base)
        assert settings is not None, "SFTTrainer patches the model with TRL's fused LM head"

        def sft_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, **kwargs):
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].to(logits.device)
            stats = token_stats(fused_head.transform(logits, settings), shift_labels, vocab_size,
                                outputs=("log_probs", "entropy", "is_top1"))
            per_token = -stats["log_probs"]
            if self.args.loss_type == "dft":
                per_token = per_token * stats["log_probs"].exp().detach()
            self._nxd_sums.append(torch.stack([stats[k].detach().float().sum() for k in _METRICS]))
            count = stats["label_mask"].sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
            return per_token.sum() / count

        original.loss_function = sft_loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not model.pipelined:
            return super().training_step(model, inputs, num_items_in_batch)
        tokens = inputs["attention_mask"].sum().float()
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._record_pipeline_metrics("train", tokens)
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        result = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if model.pipelined:
            self._record_pipeline_metrics("eval", None)
        return result

    def _record_pipeline_metrics(self, mode: str, tokens: torch.Tensor | None) -> None:
        """What SFTTrainer.compute_loss records, from the last stage's sums (every replica's in training)."""
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        device = backend.collective_device(pp_group)
        sums = torch.stack(self._nxd_sums).sum(0) if self._nxd_sums else torch.zeros(len(_METRICS), device=device)
        self._nxd_sums.clear()
        extra = torch.zeros(1, device=device) if tokens is None else tokens.view(1)
        sums = torch.cat([sums.to(device), extra.to(device)])
        runner = self.nxd_model.module._runner
        backend.broadcast(sums, runner._last_stage_rank(), pp_group)
        if mode == "train":  # each replica holds its rows of the batch
            backend.all_reduce(sums, parallel_state.get_data_parallel_group())
        entropy, correct, valid, tokens = sums.tolist()
        self._metrics[mode]["entropy"].append(entropy / valid if valid > 0 else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append(correct / valid if valid > 0 else 0.0)
        if mode == "train":
            self._total_train_tokens += int(tokens)
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]

    def log(self, logs: dict, start_time: float | None = None) -> None:
        if self.nxd_model.pipelined:  # SFTTrainer.log reads the mode from the HF model, not run by the schedule
            self.model.training = self.nxd_model.training
        super().log(logs, start_time)
