"""TRL's ``RewardTrainer`` on nxd_hf: ``NxDRewardTrainer`` and ``NxDRewardConfig`` (TRL is an
optional extra); ``nxd_hf.parallel_trainer(RewardTrainer)`` returns this class.

``NxDRewardTrainer`` is ``RewardTrainer`` with ``NxDTrainer`` first in the method order (see
``nxd_hf.integrations.subclass``), at any tensor and data parallelism, with LoRA (``peft_config``).
RewardTrainer's ``compute_loss`` runs on the parallel model: the sequence-classification head
(one reward per row) is replicated, so its scores need no gather. What it needs beyond that:

- a batch is ``[chosen rows; rejected rows]``: each data-parallel replica takes its pairs
  (``nxd_hf.integrations.pairs``), weighted by its share of the batch's pairs, so the loss (a
  mean over pairs) and its gradients are the global batch's; the metrics RewardTrainer gathers in
  a step (rewards, accuracy, margin, tokens) are gathered over the replicas;
- ``model`` may be a name or a directory, loaded as RewardTrainer loads it (a sequence
  classifier with one label, seeded first: its head is drawn at random), on the CPU.

Pipeline parallelism is refused (only the schedule could run the model, and the loss pairs rows
of different microbatches), as are ``activation_offloading`` and ``use_liger_kernel``.
"""

import dataclasses

import transformers
from trl import RewardConfig, RewardTrainer

from nxd_hf.integrations.model_path import load_named_model
from nxd_hf.integrations.pairs import check_pairs_split, pair_rows
from nxd_hf.integrations.subclass import ParallelTrainerMixin, combined_arguments, refuse_set_fields, trl_refusals


@dataclasses.dataclass(kw_only=True)
class NxDRewardConfig(combined_arguments(RewardConfig)):
    """TRL's ``RewardConfig`` and ``NxDTrainingArguments`` in one dataclass (one ``HfArgumentParser``)."""

    def __post_init__(self):
        super().__post_init__()
        refused = {
            **trl_refusals(self),
            "pipeline_parallel_size": (self.pipeline_parallel_size > 1, "use tensor and data parallelism: the reward "
                                       "loss pairs each chosen row with its rejected one, which pipeline microbatches "
                                       "would separate"),
            "context_parallel_size": (self.context_parallel_size > 1, "use tensor and data parallelism (a reward is "
                                      "read at each row's last token)"),
        }
        refuse_set_fields("NxDRewardTrainer", refused)


class NxDRewardTrainer(ParallelTrainerMixin, RewardTrainer):
    """``trl.RewardTrainer`` with tensor and data parallelism (ZeRO-1) and LoRA; ``args``:
    ``NxDRewardConfig`` (module docstring)."""

    def __init__(self, model=None, args: NxDRewardConfig | None = None, *trainer_args, quantization_config=None,
                 **trainer_kwargs):
        if not isinstance(args, NxDRewardConfig):
            raise ValueError("NxDRewardTrainer takes args=nxd_hf.NxDRewardConfig(...) (or nxd_hf.parallel_arguments("
                             "RewardConfig)(...)): RewardConfig's fields and the parallel layout in one dataclass")
        if isinstance(model, str):  # RewardTrainer seeds first: the classification head is drawn at random
            transformers.set_seed(args.seed)
            model = load_named_model(model, args, trainer_kwargs, trainer="NxDRewardTrainer",
                                     quantization_config=quantization_config,
                                     architecture=transformers.AutoModelForSequenceClassification, num_labels=1)
        elif quantization_config is not None:
            trainer_kwargs["quantization_config"] = quantization_config  # RewardTrainer warns that it is ignored
        super().__init__(model, args, *trainer_args, **trainer_kwargs)

    def _nxd_replica_rows(self, batch: dict) -> dict:
        return pair_rows(batch)

    def get_train_dataloader(self):
        check_pairs_split(self.train_dataset, self.args)
        return super().get_train_dataloader()

    def _save_checkpoint(self, model, trial):  # RewardTrainer's model card, before nxd_hf's checkpoint
        name = self.args.output_dir.rstrip("/").split("/")[-1]
        self.create_model_card(model_name=self.args.hub_model_id.split("/")[-1] if self.args.hub_model_id else name)
        super()._save_checkpoint(model, trial)
