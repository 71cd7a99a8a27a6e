"""Context parallelism inside the pipeline: each step's full batch split over the CP ranks
before the schedule runs (docs/context_parallel.md, "Pipeline").

At pp = 1 a forward pre-hook on the HF model splits its inputs (``nxd_hf.context.model``); the
pipeline never calls that model, so ``run_train``/``run_eval`` split the step's inputs here,
the same way: labels shifted on the whole sequence, this rank's two chunks of ``input_ids``, of
the shifted labels and of the real ``position_ids`` (a traced input of every stage, so rotary
embeddings see them), and the batch's masking facts set for attention. Every stage's attention
then runs across its CP peers, which hold the same stage; the last stage's loss is the model's
CP loss (``ContextLossSum``), on the already shifted labels.
"""

import torch

from nxd_hf import parallel_state
from nxd_hf.context.attention import current_batch
from nxd_hf.context.model import check_same_batch, split_inputs
from nxd_hf.pipeline.pooled_loss import takes_pooled_logits

SPLIT_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


def context_parallel_size(model) -> int:
    """The CP size an ``NxDPPModel`` of ``model`` splits over (1: none); ValueError for a model
    the split does not know."""
    cp = parallel_state.get_context_parallel_size()
    if cp > 1 and getattr(model, "context_parallel_multiple", None) is None:
        raise ValueError(f"context_parallel_size={cp} in the pipeline needs a Hugging Face model parallelized by "
                         "nxd_hf.parallelize(..., context_parallel_size=...): build the NxDPPModel through it")
    if cp > 1 and takes_pooled_logits(model):  # one label per row: nothing to split over the sequence
        raise ValueError("context parallelism in the pipeline trains causal LMs (labels per token), not sequence "
                         "classification: use context_parallel_size=1 for this model")
    return cp


def with_position_ids(input_names: list[str]) -> list[str]:
    """``input_names`` with ``position_ids`` (each CP rank's real positions reach every stage),
    last: positional ``run_train`` arguments keep the meaning the caller's names give them."""
    return input_names if "position_ids" in input_names else [*input_names, "position_ids"]


class StepSplit:
    """Splits each step's inputs for this CP rank (checks on the first step that every CP rank
    got the same batch, as the pp = 1 hook does)."""

    def __init__(self, hf_model, num_microbatches: int):
        self.multiple = hf_model.context_parallel_multiple
        self.num_microbatches = num_microbatches
        self.checked = False

    def __call__(self, inputs: dict) -> tuple[dict, torch.Tensor]:
        """(this rank's inputs, its shifted labels) from the full batch's."""
        unknown = sorted(set(inputs) - set(SPLIT_KEYS))
        if unknown:
            raise ValueError(f"context parallelism in the pipeline splits {list(SPLIT_KEYS)} over the sequence; got "
                             f"{unknown} too: pass only those")
        if not self.checked:
            check_same_batch(inputs)
            self.checked = True
        local = split_inputs(dict(inputs), self.multiple)
        batch = current_batch()
        if (batch.doc is not None or batch.key_valid is not None) and self.num_microbatches > 1:
            # the masks are per row, and attention cannot tell which microbatch's rows it runs
            raise ValueError("context parallelism in the pipeline takes padding (attention_mask with zeros) or packed "
                             f"sequences only with num_microbatches=1 (got {self.num_microbatches}): pass no padding "
                             "and positions 0..S-1, or one microbatch")
        out = {"input_ids": local["input_ids"], "position_ids": local["position_ids"]}
        return out, local.get("shift_labels")
