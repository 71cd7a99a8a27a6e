"""``NxDDPOTrainer`` under pipeline parallelism, where only the schedule runs the model.

A step (training or evaluation) is two passes of the schedule over the same microbatches:

1. the reference: the frozen copy's own pipeline (``PipelinedReference``) or, under LoRA, the
   policy's with its adapters disabled, in ``run_eval``; its last stage keeps each microbatch's
   per-token log-probabilities (from the vocab-parallel logits, TRL's logit transform applied);
2. the policy (``run_train``, or ``run_eval`` in evaluation): its last stage computes each
   microbatch's DPO loss with DPOTrainer's own ``_compute_loss``, the model outputs given as
   what TRL's fused LM head would return for those rows.

DPO's loss pairs row ``i`` (chosen) with row ``B + i`` (rejected): the rows are reordered so that
each microbatch holds whole pairs (``[its chosen; its rejected]``), and the pairs are padded, by
repeating the last one, to a multiple of the microbatches; padded pairs count for nothing. A
microbatch's share is its mean over its pairs times its pairs over the batch's (DPO's losses other
than the refused batch-coupled ones are means of per-pair terms), so the step's gradients are the
batch's. The metrics (``rewards/*``, ``logps/*``, ``logits/*``, ...) are DPOTrainer's, computed once
after the step on the last stage from every microbatch's outputs in the batch's row order, and sent
to the other stages.
"""

import collections
import contextlib

import torch
from torch import nn
from trl import DPOTrainer
from trl.trainer.utils import FusedCausalLMOutput

from nxd_hf import backend, parallel_state
from nxd_hf.integrations import fused_head
from nxd_hf.integrations.token_stats import token_stats

_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


class PipelinedReference(nn.Module):
    """DPO's frozen reference under pipeline parallelism: the copy's ``NxDPPModel`` (run by its
    schedule; not a submodule, so DPOTrainer's preparation of the reference leaves it alone)."""

    def __init__(self, pipeline):
        super().__init__()
        self.__dict__["pipeline"] = pipeline

    @property
    def config(self):
        return self.pipeline.hf_model.config

    def forward(self, *args, **kwargs):
        raise ValueError("the pipelined reference runs through its schedule (run_eval), not forward")


@contextlib.contextmanager
def adapters_disabled(modules):
    """LoRA's adapters off in ``modules`` (only the flag peft's layers read in forward: peft's
    ``enable_adapters`` would also flip ``requires_grad``, which the optimizer relies on)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for module in modules for m in module.modules() if isinstance(m, BaseTunerLayer)]
    was = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, disabled in zip(layers, was):
            layer._disable_adapters = disabled


class _Returns:
    """A stand-in model for DPOTrainer's ``_compute_loss``: returns the outputs already computed."""

    def __init__(self, outputs):
        self.outputs = outputs

    def __call__(self, *args, **kwargs):
        return self.outputs


class PipelineDPOMixin:
    """The pipelined step of ``NxDDPOTrainer`` (module docstring); at pp=1 every hook defers."""

    def _nxd_pipeline_setup(self, policy_settings: dict, reference_settings: dict) -> None:
        self._nxd_pp = None
        self._nxd_settings = {"policy": policy_settings, "reference": reference_settings}
        self.nxd_model.hf_model.loss_function = self._nxd_pipeline_loss
        if isinstance(self.ref_model, PipelinedReference):
            self.ref_model.pipeline.hf_model.loss_function = self._nxd_pipeline_loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not model.pipelined:
            return super().training_step(model, inputs, num_items_in_batch)
        from nxd_hf.trainer.batches import FILLER_ROWS, ROW_WEIGHT

        with contextlib.nullcontext() if self.accelerator.sync_gradients else model.no_sync():
            model.train()
            inputs = self._prepare_inputs(inputs)
            weight = inputs.pop(ROW_WEIGHT) * (not inputs.pop(FILLER_ROWS))
            with self.compute_loss_context_manager():  # a per-batch mean: this replica's weight, over accumulation
                return self._nxd_pipeline_step(model, inputs, "train", weight / self.current_gradient_accumulation_steps)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if not model.pipelined:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self._nxd_pipeline_step(model, inputs, "eval", 1.0)
        return loss.detach(), None, None  # the fused head builds no logits

    def log(self, logs: dict, start_time: float | None = None) -> None:
        if self.nxd_model.pipelined:  # DPOTrainer.log reads the mode from the HF model, not run by the schedule
            self.model.training = self.nxd_model.training
        super().log(logs, start_time)

    # -- the step
    def _nxd_pipeline_step(self, model, inputs: dict, mode: str, scale: float) -> torch.Tensor:
        pipeline = model.module
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        batch, real = _microbatched_pairs(
            {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"], "labels": labels},
            pipeline.num_microbatches)
        self._nxd_pp = {"pass": "reference", "microbatch": 0, "real": real, "pairs": labels.shape[0] // 2,
                        "scale": scale, "mode": mode, "reference": [], "outputs": []}
        try:
            if isinstance(self.ref_model, PipelinedReference):
                self.ref_model.pipeline.run_eval(**batch)
            else:  # LoRA: the policy with its adapters disabled
                with adapters_disabled(pipeline.local_modules()):
                    model.run_eval(**batch)
            self._nxd_pp.update({"pass": "policy", "microbatch": 0})
            loss = model.run_train(**batch) if mode == "train" else model.run_eval(**batch)
            self._nxd_pipeline_metrics(pipeline, inputs["attention_mask"], mode)
        finally:
            self._nxd_pp = None
        return loss

    def _nxd_pipeline_loss(self, logits, labels, vocab_size, num_items_in_batch=None, **kwargs):
        """The last stage's loss function on one microbatch: the reference's log-probabilities
        kept (pass 1), or the policy's DPO loss share (pass 2)."""
        state = self._nxd_pp
        assert state is not None, "the pipelined DPO loss runs inside NxDDPOTrainer's step"
        index = state["microbatch"]
        state["microbatch"] += 1
        half = labels.shape[0] // 2
        if state["pass"] == "reference":
            stats = token_stats(fused_head.transform(logits[:, :-1], self._nxd_settings["reference"]), labels[:, 1:],
                                vocab_size, outputs=("log_probs",))
            state["reference"].append(stats["log_probs"].detach())
            return logits.new_zeros((), dtype=torch.float32)
        real = state["real"][index]
        if real == 0:  # a microbatch of padded pairs
            return logits.sum() * 0.0
        rows = torch.cat([torch.arange(real, device=labels.device), half + torch.arange(real, device=labels.device)])
        logits, labels = logits[rows], labels[rows]
        settings = self._nxd_settings["policy"]
        stats = token_stats(fused_head.transform(logits[:, :-1], settings), labels[:, 1:], vocab_size,
                            outputs=settings["outputs"])
        reference = state["reference"][index][rows]
        loss = self._nxd_trl_loss(stats, reference, labels, None, state["mode"], metrics=False)
        state["outputs"].append(({k: v.detach() for k, v in stats.items() if v is not None}, reference, labels))
        return loss * (real / state["pairs"]) * state["scale"]

    def _nxd_trl_loss(self, stats: dict, reference: torch.Tensor, labels, attention_mask, mode: str, *,
                      metrics: bool) -> torch.Tensor:
        """DPOTrainer's ``_compute_loss`` on rows whose policy and reference outputs are given."""
        policy = FusedCausalLMOutput(**{k: stats.get(k) for k in _FIELDS})
        inputs = {"input_ids": labels.clamp(min=0), "completion_mask": (labels != -100).long(),
                  "attention_mask": attention_mask if attention_mask is not None else torch.ones_like(labels)}
        saved = self.ref_model, self.model.training, self._metrics, self._total_train_tokens
        self.ref_model, self.model.training = _Returns(FusedCausalLMOutput(log_probs=reference)), mode == "train"
        if not metrics:  # a microbatch's: the batch's metrics are computed once after the step
            self._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
        try:
            return DPOTrainer._compute_loss(self, _Returns(policy), inputs, False)
        finally:
            self.ref_model, self.model.training = saved[0], saved[1]
            if not metrics:
                self._metrics, self._total_train_tokens = saved[2], saved[3]

    def _nxd_pipeline_metrics(self, pipeline, attention_mask, mode: str) -> None:
        """DPOTrainer's metrics of the batch on the last stage (gathered over the data-parallel
        replicas in training), then the same metrics on every stage."""
        state = self._nxd_pp
        last = pipeline.num_stages - 1 in pipeline.local_stage_ids
        found = None
        if last:
            outputs = state["outputs"]
            halves = [len(labels) // 2 for _, _, labels in outputs]

            def batch_rows(parts):  # [every chosen row; every rejected row], in the batch's order
                return torch.cat([p[:n] for p, n in zip(parts, halves)] + [p[n:] for p, n in zip(parts, halves)])

            stats = {k: batch_rows([s[k] for s, _, _ in outputs]) for k in outputs[0][0]}
            reference = batch_rows([r for _, r, _ in outputs])
            labels = batch_rows([l for _, _, l in outputs])
            self._nxd_in_training_step = mode == "train"  # gathers over the data-parallel replicas
            try:
                with torch.no_grad():
                    self._nxd_trl_loss(stats, reference, labels, attention_mask, mode, metrics=True)
            finally:
                self._nxd_in_training_step = False
            found = (dict(self._metrics[mode]), self._total_train_tokens)
        group = parallel_state.get_pipeline_model_parallel_group()
        found = next(f for f in backend.all_gather_object(found, group) if f is not None)
        if not last:
            self._metrics[mode].clear()
            self._metrics[mode].update({k: list(v) for k, v in found[0].items()})
            self._total_train_tokens = found[1]


def _microbatched_pairs(batch: dict, num_microbatches: int) -> tuple[dict, list[int]]:
    """``batch`` (``[chosen (B); rejected (B)]`` rows) padded to a multiple of ``num_microbatches``
    pairs, by repeating the last pair, and reordered so that microbatch ``m`` is ``[its chosen;
    its rejected]``; and the number of real pairs in each microbatch (the padded come last)."""
    rows = batch["input_ids"].shape[0]
    pairs = rows // 2
    assert 2 * pairs == rows, "DataCollatorForPreference stacks the chosen rows over the rejected ones"
    per = -(-pairs // num_microbatches)
    padded = per * num_microbatches
    take = torch.cat([torch.arange(pairs), torch.full((padded - pairs,), pairs - 1, dtype=torch.long)])
    order = torch.cat([torch.cat([take[m * per:(m + 1) * per], pairs + take[m * per:(m + 1) * per]])
                       for m in range(num_microbatches)])
    real = [max(0, min(per, pairs - m * per)) for m in range(num_microbatches)]
    return {k: v[order.to(v.device)] for k, v in batch.items()}, real
