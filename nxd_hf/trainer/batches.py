"""The batches ``NxDTrainer`` hands its model: a data-parallel replica's rows of the global batch
(with their weight in it), the pipeline's named inputs, and an evaluation batch padded to a
multiple of the microbatches."""

import torch

from nxd_hf import backend, parallel_state
from nxd_hf.trainer.model import NxDModel

ROW_WEIGHT = "_nxd_row_weight"
"""The key ``replica_rows`` adds to a batch: the weight of this replica's rows in the global batch."""


def replica_rows(batch: dict) -> dict:
    """This data-parallel replica's rows of every batched tensor of ``batch`` (split as evenly as
    ``tensor_split`` does), and the weight of its rows in the global batch."""
    dp_size, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    rows = next(v.shape[0] for v in batch.values() if torch.is_tensor(v) and v.dim() > 0)
    _check_rows(batch, rows, dp_size)
    local = {k: v.tensor_split(dp_size)[dp_rank] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == rows else v
             for k, v in batch.items()}
    local_rows = len(torch.arange(rows).tensor_split(dp_size)[dp_rank])
    local[ROW_WEIGHT] = local_rows * dp_size / rows
    return type(batch)(local) if isinstance(batch, dict) else local


def check_dataset_size(dataset, name: str) -> None:
    """Every data-parallel replica needs a sample (the same check on every rank: same dataset)."""
    dp_size = parallel_state.get_data_parallel_size()
    size = len(dataset) if dataset is not None and hasattr(dataset, "__len__") else None
    if size is not None and size < dp_size:
        raise ValueError(f"the {name} has {size} samples but there are {dp_size} data-parallel replicas: each needs "
                         "at least one sample per step. Use a larger dataset or fewer data-parallel replicas "
                         "(a larger tensor_parallel_size x pipeline_parallel_size, or fewer processes)")


def _check_rows(batch: dict, rows: int, dp_size: int) -> None:
    """The global batch (the same on every rank) must give every replica at least one row of at
    least one token: a ValueError naming it on every rank, not a reshape error on one."""
    ids = batch.get("input_ids")
    if rows == 0 or (torch.is_tensor(ids) and ids.dim() > 1 and ids.shape[-1] == 0):
        shapes = {k: list(v.shape) for k, v in batch.items() if torch.is_tensor(v)}
        raise ValueError(f"empty training batch {shapes}: drop empty examples from the dataset and check the collator")
    if rows < dp_size:
        raise ValueError(f"a training batch has {rows} rows but there are {dp_size} data-parallel replicas: each "
                         "needs at least one row. Set dataloader_drop_last=True (the last batch of an epoch can be "
                         "short), or use a dataset whose size is a multiple of the global batch size")


def pipeline_inputs(model: NxDModel, inputs: dict) -> dict:
    return {k: v for k, v in inputs.items() if k in model.module.input_names}


def pad_rows(inputs: dict, multiple: int) -> dict:
    """Repeat the last row until the batch splits into ``multiple`` microbatches; the added rows'
    labels are ignored, so a token-weighted loss is unchanged (``run_eval(padded_rows=...)`` leaves
    them out of the load-balancing loss as well)."""
    rows = inputs["labels"].shape[0]
    extra = -rows % multiple
    if not extra:
        return inputs
    padded = {k: torch.cat([v, v[-1:].expand(extra, *v.shape[1:])]) for k, v in inputs.items()}
    padded["labels"][rows:] = -100
    return padded


def data_parallel_mean(value: torch.Tensor) -> torch.Tensor:
    value = value.float() / parallel_state.get_data_parallel_size()
    return backend.all_reduce(value, parallel_state.get_data_parallel_group())
