"""One rank of ``bench/fsdp/run.py``: each method trains the same HF Llama in turn. Before each,
the last is freed, glibc's heap trimmed and the baseline RssAnon read (as ``bench/plan/worker.py``
does; the launcher sets ``MALLOC_MMAP_THRESHOLD_`` so freed tensors go back to the kernel); a
thread samples RssAnon while the model trains: the peak over the baseline."""

import ctypes
import gc
import statistics
import time

import torch
import transformers

from bench.memory.rank import PeakSampler, read_status
import nxd_hf
from nxd_hf import parallel_state
from nxd_hf.parallel_layers.grads import clip_grad_norm

METHODS = ["nxd_zero1", "nxd_zero2", "nxd_zero3", "fsdp2_by_hand"]


def build(config: dict):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config["model"]))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _setup(method: str, config: dict):
    """(model, optimizer, clip) of ``method`` on this rank."""
    parallel_state.destroy_model_parallel()
    model = build(config)
    if method == "fsdp2_by_hand":  # the peer: torch's FSDP2 on the plain HF model, over every rank
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4), torch.nn.utils.clip_grad_norm_
    if method == "nxd_zero1":
        from nxd_hf.optim import NeuronZero1Optimizer

        nxd_hf.parallelize(model)
        return model, NeuronZero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, max_norm=1.0), None
    nxd_hf.parallelize(model, data_parallel_sharding=method.removeprefix("nxd_"))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), clip_grad_norm


def _bytes(model, optimizer, method: str) -> dict:
    params = list(model.parameters())
    out = {"param_bytes": sum(_local(p).numel() * 4 for p in params),
           "grad_bytes": sum(_local(p.grad).numel() * 4 for p in params if p.grad is not None)}
    if method == "nxd_zero1":
        out["optimizer_bytes"] = optimizer.optimizer_state_bytes()
    else:
        out["optimizer_bytes"] = sum(_local(t).numel() * 4 for s in optimizer.state.values() for t in s.values()
                                     if torch.is_tensor(t) and t.dim() > 0)
    return out


def measure(config: dict) -> dict:
    torch.set_num_threads(1)
    world = torch.distributed.get_world_size()
    g = torch.Generator().manual_seed(1)
    vocab, batch, seq = config["model"]["vocab_size"], config["batch"], config["seq"]
    batches = [torch.randint(0, vocab, (batch * world, seq), generator=g) for _ in range(config["steps"] + 2)]
    results = {}
    for method in METHODS:
        parallel_state.destroy_model_parallel()
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        torch.distributed.barrier()
        baseline = read_status()["RssAnon"]
        with PeakSampler(interval_s=0.002) as sampler:
            setup = _setup(method, config)
            # every rank builds the whole HF model before it is sharded (from_pretrained reads into the
            # shards instead): the peak is that of training, taken from here on
            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            sampler.peak = read_status()
            memory, times = _train(*setup, batches, method)
            del setup
        results[method] = {**memory, "step_seconds": statistics.median(times),
                           "peak_over_baseline_bytes": sampler.peak["RssAnon"] - baseline}
    results["num_params"] = sum(p.numel() for p in build(config).parameters())
    return results


def _train(model, optimizer, clip, batches, method: str) -> tuple[dict, list]:
    """(the bytes held after the first step, the step times from the third on)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    memory, times = {}, []
    for step, ids in enumerate(batches):
        ids = ids.chunk(world)[rank]
        torch.distributed.barrier()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        if clip is not None:
            clip(model.parameters(), 1.0)
        optimizer.step()
        if step == 0:
            memory.update(_bytes(model, optimizer, method))  # after the step: AdamW's state exists, grads still held
        optimizer.zero_grad()
        elapsed = torch.tensor(time.perf_counter() - start)
        torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)  # the slowest rank
        if step >= 2:
            times.append(elapsed.item())
    return memory, times
