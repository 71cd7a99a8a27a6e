"""One rank of ``bench/fsdp/run.py``: each method trains the same HF Llama in turn."""

import statistics
import time

import torch
import transformers

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
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    g = torch.Generator().manual_seed(1)
    vocab, batch, seq = config["model"]["vocab_size"], config["batch"], config["seq"]
    batches = [torch.randint(0, vocab, (batch * world, seq), generator=g) for _ in range(config["steps"] + 2)]
    results = {}
    for method in METHODS:
        model, optimizer, clip = _setup(method, config)
        times, memory = [], None
        for step, ids in enumerate(batches):
            ids = ids.chunk(world)[rank]
            torch.distributed.barrier()
            start = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            if clip is not None:
                clip(model.parameters(), 1.0)
            optimizer.step()
            if step == 0:
                memory = _bytes(model, optimizer, method)  # after the step: AdamW's state exists, grads still held
            optimizer.zero_grad()
            elapsed = torch.tensor(time.perf_counter() - start)
            torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)  # the slowest rank
            if step >= 2:
                times.append(elapsed.item())
        results[method] = {**memory, "step_seconds": statistics.median(times)}
    results["num_params"] = sum(p.numel() for p in build(config).parameters())
    return results
