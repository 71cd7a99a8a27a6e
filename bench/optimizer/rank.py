"""One rank of ``bench/optimizer/run.py``: a method's state bytes and peak memory in fresh
processes, and every method's step times side by side (run by ``run_distributed``)."""

import os

import torch

from bench.optimizer.methods import BenchConfig, Method, build_model
from nxd_hf import parallel_state


def _batch(config: BenchConfig, step: int, dp_rank: int):
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    shape = (config.batch, config.seq, config.hidden)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _setup(names: list[str]) -> int:
    os.environ["DS_ACCELERATOR"] = "cpu"
    if "deepspeed_zero1" in names:
        import deepspeed  # noqa: F401  before the memory baseline
    parallel_state.initialize_model_parallel(1, 1)  # every rank data-parallel
    return parallel_state.get_data_parallel_rank()


def _build(name: str, config: BenchConfig) -> Method:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Method(name, build_model(config), config)


def measure_memory(name: str, config: BenchConfig) -> dict:
    """One rank's state bytes and peak memory for one method, in fresh processes."""
    dp_rank = _setup([name])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    baseline = _rss_bytes("VmRSS")
    method = _build(name, config)
    losses = []
    for step in range(config.memory_steps):
        losses.append(method.forward_backward(*_batch(config, step, dp_rank)))
        method.update()
    checksum = sum(float(p.detach().double().sum()) for p in method.model.parameters())
    return dict(state_bytes=method.state_bytes(), full_state_bytes=method.full_state_bytes(),
                peak_bytes=_rss_bytes("VmHWM") - baseline, num_params=method.num_params, losses=losses,
                param_checksum=checksum)


def measure_times(names: list[str], config: BenchConfig) -> dict[str, list[float]]:
    """One rank's step seconds of every method, built side by side and interleaved step by
    step (the order rotating), so that load from other processes hits them alike."""
    dp_rank = _setup(names)
    methods = {name: _build(name, config) for name in names}
    seconds = {name: [] for name in names}
    for step in range(config.warmup + config.steps):
        for k in range(len(names)):
            name = names[(step + k) % len(names)]
            methods[name].forward_backward(*_batch(config, step, dp_rank))
            elapsed = methods[name].update()
            if step >= config.warmup:
                seconds[name].append(elapsed)
    return seconds
