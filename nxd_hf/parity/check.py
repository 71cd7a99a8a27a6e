"""``nxd_hf.check_parity``: before a long run, the user's own architecture and config, shrunk
(``nxd_hf.parity.shrink``: few layers but one of each kind, small hidden size, head and K/V
ratios kept), run on the requested layout against the unparallelized model: loss and every
gradient. NxD has no such check."""

import os

import transformers

from nxd_hf import backend
from nxd_hf.parity.cases import CaseResult, run_case
from nxd_hf.parity.shrink import shrink_config


def check_parity(config, *, tensor_parallel_size: int, pipeline_parallel_size: int = 1,
                 sequence_parallel: bool = False, shrink: bool = True, timeout_s: float = 300.0,
                 expert_parallel_size: int = 1) -> CaseResult:
    """Parity of ``config`` (a ``PretrainedConfig``, or a model directory / hub id holding one)
    at ``tensor_parallel_size`` x ``pipeline_parallel_size``. Under torchrun (the process group
    already started, world size = tp x pp) every rank calls it; otherwise it spawns the ranks on
    CPU itself. Returns the agreed ``CaseResult`` ("pass", "refused", "wrong" or "crash").
    ``expert_parallel_size``: also split the experts over that many ranks (world tp x pp x ep)."""
    if isinstance(config, str):
        config = transformers.AutoConfig.from_pretrained(config)
    if shrink:
        config = shrink_config(config)
    world_size = tensor_parallel_size * pipeline_parallel_size * expert_parallel_size
    kwargs = dict(tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                  sequence_parallel=sequence_parallel, expert_parallel_size=expert_parallel_size)
    # a world of one this process started for itself (not a torchrun launch) does not hold the ranks: spawn them
    launched = backend.is_initialized() and (
        backend.world_size() > 1 or "TORCHELASTIC_RUN_ID" in os.environ or world_size == 1)
    if launched:
        if backend.world_size() != world_size:
            raise ValueError(f"check_parity needs world size tp x pp x ep = {world_size}, got {backend.world_size()}: "
                             f"launch it with torchrun --nproc-per-node {world_size}, or without torchrun")
        return run_case(config, **kwargs)
    from nxd_hf.testing import run_distributed  # the spawn harness, only when spawning

    return run_distributed(_check_rank, world_size, config, kwargs, timeout_s=timeout_s)[0]


def _check_rank(config, kwargs: dict) -> CaseResult:
    return run_case(config, **kwargs)
