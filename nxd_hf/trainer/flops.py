"""``Trainer``'s floating-point-operation count (``total_flos``, in ``trainer_state.json`` and the
model card) as it is on one process: 6 x the tokens trained on x the model's parameters less its
embeddings (``PreTrainedModel.num_parameters(exclude_embeddings=True)``).

Under nxd_hf a rank holds shards of some stages and trains on its replica's rows, so the count
is taken of the unparallelized model (the logical shapes of every stage's tensors, each once)
and of the global batch (the replicas' counts summed when ``Trainer`` stores them)."""

import math

import torch
from torch import nn

from nxd_hf import backend, parallel_state
from nxd_hf.checkpoint.logical import local_roots, logical_tensors, named_local_tensors
from nxd_hf.parallel_layers.layers import ParallelEmbedding


def logical_non_embedding_parameters(model: nn.Module) -> int:
    """The parameters of the unparallelized ``model`` (adapters included) less its embeddings'
    weights, as ``num_parameters(exclude_embeddings=True)`` counts them on the plain model.
    Collective over the TP and PP groups."""
    embeddings = {f"{name}.weight" for root in local_roots(model) for name, m in root.named_modules()
                  if isinstance(m, (nn.Embedding, ParallelEmbedding))}
    # a weight tied across pipeline stages is counted by its first holder (as named_parameters
    # counts a tied weight once)
    local = sum(math.prod(lt.shape) for lt in logical_tensors(model, named=named_local_tensors(model, buffers=False))
                if lt.model_name not in embeddings and not lt.tied_copy
                and getattr(lt.tensor, "count_in_grad_norm", True))
    if not parallel_state.model_parallel_is_initialized():
        return local
    group = parallel_state.get_pipeline_model_parallel_group()
    total = torch.tensor([local], dtype=torch.int64, device=backend.collective_device(group))
    return int(backend.all_reduce(total, group).item())


def global_flos(current_flos: float) -> float:
    """The sum over data-parallel replicas of ``current_flos``, which every rank of a replica
    (its TP, PP and CP ranks) counted alike on the replica's rows. Collective over the world,
    as ``Trainer.store_flos`` is under DDP."""
    world = backend.world_size()
    if world == 1:
        return current_flos
    ranks_per_replica = world // parallel_state.get_data_parallel_replicas()
    total = torch.tensor([current_flos], dtype=torch.float64, device=backend.collective_device(None))
    return backend.all_reduce(total, None).item() / ranks_per_replica
