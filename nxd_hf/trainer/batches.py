"""The batches ``NxDTrainer`` hands its model: a data-parallel replica's rows of the global batch
(with their weight in it), the pipeline's named inputs, and an evaluation batch padded to a
multiple of the microbatches."""

import contextlib

import torch

from nxd_hf import backend, parallel_state
from nxd_hf.trainer.model import NxDModel

ROW_WEIGHT = "_nxd_row_weight"
"""The key ``replica_rows`` adds to a batch: the weight of this replica's rows in the global batch."""


FILLER_ROWS = "_nxd_filler_rows"
"""The key ``replica_rows`` adds to a batch: how many of its rows only stand in for none (they count for nothing)."""


def replica_rows(batch: dict) -> dict:
    """This data-parallel replica's rows of every batched tensor of ``batch`` (split as evenly as
    ``tensor_split`` does), and the weight of its rows in the global batch.

    A short last batch (fewer rows than replicas) leaves a replica no row; it still runs the step,
    since every collective of it (the gradient reduction, ZeRO-1's reduce-scatter and all-gather)
    needs every replica, on a copy of the batch's first row marked ``FILLER_ROWS``: the trainer
    makes its loss and gradients zero."""
    # the context-parallel ranks of a replica share its rows (they split the sequence)
    dp_size, dp_rank = parallel_state.get_data_parallel_replicas(), parallel_state.get_data_parallel_replica_rank()
    rows = next(v.shape[0] for v in batch.values() if torch.is_tensor(v) and v.dim() > 0)
    _check_rows(batch, rows)
    local_rows = len(torch.arange(rows).tensor_split(dp_size)[dp_rank])
    batched = [k for k, v in batch.items() if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == rows]
    local = dict(batch)
    for key in batched:
        local[key] = batch[key].tensor_split(dp_size)[dp_rank] if local_rows else batch[key][:1].clone()
    local[ROW_WEIGHT] = local_rows * dp_size / rows
    local[FILLER_ROWS] = 0 if local_rows else 1
    return type(batch)(local) if isinstance(batch, dict) else local


@contextlib.contextmanager
def global_eval_batch(trainer):
    """``trainer.args.per_device_eval_batch_size`` rows per replica, as the train batch: while
    inside, an evaluation batch is the global one (that many rows x data-parallel replicas),
    which every rank evaluates whole. The same script on one process batches so, which matters
    where a metric is a per-batch mean (a token-mean loss that ``evaluation_loop`` weighs by
    ``eval_batch_size``, TRL's entropy and token accuracy, DPO's rewards). Re-entrant: the
    dataloader is built inside ``evaluation_loop``."""
    args = trainer.args
    if getattr(trainer, "_nxd_eval_batch_scaled", False):
        yield
        return
    per_replica = args.per_device_eval_batch_size
    args.per_device_eval_batch_size = per_replica * parallel_state.get_data_parallel_replicas()
    trainer._nxd_eval_batch_scaled = True
    try:
        yield
    finally:
        args.per_device_eval_batch_size, trainer._nxd_eval_batch_scaled = per_replica, False


def warn_single_packed_rows(trainer, batch: dict) -> None:
    """Once per trainer: a training batch packed into one row (``DataCollatorWithFlattening``, a
    padding-free collator: ``position_ids`` restart per sequence) cannot be split over the
    data-parallel replicas, so all but one train on a stand-in row (exact, but their work is lost)."""
    replicas = parallel_state.get_data_parallel_replicas()
    ids = batch.get("input_ids")
    if replicas == 1 or getattr(trainer, "_nxd_warned_packed", False) or "position_ids" not in batch \
            or not torch.is_tensor(ids) or ids.dim() < 2 or ids.shape[0] != 1:
        return
    trainer._nxd_warned_packed = True
    backend.warn_once(f"the training batches are single packed rows (a flattening collator such as "
                      f"DataCollatorWithFlattening): the {replicas} data-parallel replicas cannot split them, so all "
                      "but one train on a stand-in row each step. Give the ranks to tensor_parallel_size or "
                      "context_parallel_size, or use a collator that keeps the rows (padding)")


def check_dataset_size(dataset, name: str) -> None:
    """Every data-parallel replica needs a sample (the same check on every rank: same dataset)."""
    dp_size = parallel_state.get_data_parallel_replicas()
    size = len(dataset) if dataset is not None and hasattr(dataset, "__len__") else None
    if size is not None and size < dp_size:
        raise ValueError(f"the {name} has {size} samples but there are {dp_size} data-parallel replicas: each needs "
                         "at least one sample per step. Use a larger dataset or fewer data-parallel replicas "
                         "(a larger tensor_parallel_size x pipeline_parallel_size, or fewer processes)")


def _check_rows(batch: dict, rows: int) -> None:
    """The global batch (the same on every rank) must hold a row of at least one token: a
    ValueError naming it on every rank, not a reshape error on one."""
    ids = batch.get("input_ids")
    if rows == 0 or (torch.is_tensor(ids) and ids.dim() > 1 and ids.shape[-1] == 0):
        shapes = {k: list(v.shape) for k, v in batch.items() if torch.is_tensor(v)}
        raise ValueError(f"empty training batch {shapes}: drop empty examples from the dataset and check the collator")


def pipeline_inputs(model: NxDModel, inputs: dict) -> dict:
    return {k: v for k, v in inputs.items() if k in model.module.input_names}


def pad_rows(inputs: dict, multiple: int, *, filler_rows: int = 0) -> tuple[dict, int]:
    """Repeat the last row until the batch splits into ``multiple`` microbatches; returns the
    padded batch and its number of padded rows (the added ones and the last ``filler_rows``,
    rows that already only stand in). Their labels are ignored, so a token-weighted loss is
    unchanged (``run_train``/``run_eval(padded_rows=...)`` leave them out of the load-balancing
    loss as well)."""
    rows = inputs["labels"].shape[0]
    extra = -rows % multiple
    if not extra and not filler_rows:
        return inputs, 0
    padded = {k: torch.cat([v, v[-1:].expand(extra, *v.shape[1:])]) for k, v in inputs.items()}
    padded["labels"][rows - filler_rows:] = -100  # cat made a copy: the caller's batch is left alone
    return padded, extra + filler_rows


def data_parallel_mean(value: torch.Tensor) -> torch.Tensor:
    value = value.float() / parallel_state.get_data_parallel_size()
    return backend.all_reduce(value, parallel_state.get_data_parallel_group())
