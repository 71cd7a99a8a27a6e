"""Preference batches (TRL's ``DataCollatorForPreference``: ``[chosen rows (B); rejected rows (B)]``)
under data parallelism, shared by ``NxDDPOTrainer`` and ``NxDRewardTrainer``: each replica takes
its pairs, never a chosen row without its rejected one."""

import torch

from nxd_hf import parallel_state
from nxd_hf.trainer.batches import FILLER_ROWS, ROW_WEIGHT, _check_rows


def pair_rows(batch: dict) -> dict:
    """This data-parallel replica's rows of a preference batch ``[chosen (B); rejected (B)]``: its
    pairs' chosen rows then the same pairs' rejected rows (per-pair tensors, ``[B]``, sliced
    alike), and the weight of its pairs in the global batch (``replica_rows``'s keys)."""
    dp_size, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    rows = batch["input_ids"].shape[0]
    _check_rows(batch, rows)
    pairs = rows // 2
    assert 2 * pairs == rows, "DataCollatorForPreference stacks the chosen rows over the rejected ones"
    mine = torch.arange(pairs).tensor_split(dp_size)[dp_rank]
    if len(mine) == 0:  # a short last batch: a stand-in pair whose loss and gradients count for nothing
        mine = torch.arange(1)
    local = dict(batch)
    for key, value in batch.items():
        if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == rows:
            local[key] = torch.cat([value[mine], value[mine + pairs]])
        elif torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == pairs:
            local[key] = value[mine]
    filler = len(torch.arange(pairs).tensor_split(dp_size)[dp_rank]) == 0
    local[ROW_WEIGHT] = 0.0 if filler else len(mine) * dp_size / pairs
    local[FILLER_ROWS] = int(filler)
    return type(batch)(local) if isinstance(batch, dict) else local


def check_pairs_split(train_dataset, args) -> None:
    """A last batch the data-parallel replicas cannot split evenly is refused: the trainers'
    metrics average the replicas' per-batch means, which only equal the global batch's mean over
    equal shares."""
    dp_size = parallel_state.get_data_parallel_size()
    step_pairs = args.per_device_train_batch_size * dp_size
    last = len(train_dataset) % step_pairs if hasattr(train_dataset, "__len__") else 0
    if last % dp_size and not args.dataloader_drop_last:
        raise ValueError(f"the train_dataset's {len(train_dataset)} pairs leave a last batch of {last}, which "
                         f"the {dp_size} data-parallel replicas cannot split evenly: set dataloader_drop_last=True, "
                         f"or use a multiple of {dp_size} pairs in the last batch")
