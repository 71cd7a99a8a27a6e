"""One rank of ``bench/memory/run.py`` (a ``torch.distributed.run`` worker): load the checkpoint
with one loader while a thread samples RssAnon/RssFile, then account the local parameters.

Only the standard library is imported at module level: the worker's "bare" reading is taken
with torch, transformers and nxd_hf imported and nothing else."""

import json
import os
import threading
import time

from bench.memory.checkpoint import checkpoint_numels


def read_status() -> dict[str, int]:
    """RssAnon and RssFile of this process, in bytes."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                key, amount, _unit = line.split()
                values[key[:-1]] = int(amount) * 1024
    return values


class PeakSampler:
    """Samples RssAnon/RssFile every ``interval_s`` in a thread; ``peak`` holds the maxima."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s, self.peak, self.samples = interval_s, read_status(), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self):
        for key, value in read_status().items():
            self.peak[key] = max(self.peak[key], value)
        self.samples += 1

    def _run(self):
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()


def load(loader: str, path: str, tp: int):
    import torch
    import transformers

    import nxd_hf

    if loader == "nxd_hf":
        return nxd_hf.from_pretrained(path, tensor_parallel_size=tp, dtype=torch.bfloat16)
    kwargs = {}
    if tp > 1:
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_size=tp)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kwargs)


def param_accounting(model, loader: str, path: str, tp: int) -> dict:
    """Local parameter bytes, and the ideal of this loader's plan from the unsharded shapes."""
    from torch.distributed.tensor import DTensor, Shard

    from nxd_hf.parallel_layers.sharding import is_sharded

    numels = checkpoint_numels(path)
    local_bytes, sharded_full, replicated_full = 0, 0, 0
    for name, param in model.named_parameters():  # each parameter once, tied or not
        local = param.to_local() if isinstance(param, DTensor) else param
        local_bytes += local.numel() * local.element_size()
        full = numels[name] * param.element_size()
        if loader == "nxd_hf":
            sharded = is_sharded(param)
        else:
            sharded = isinstance(param, DTensor) and any(isinstance(p, Shard) for p in param.placements)
        if sharded and tp > 1:
            sharded_full += full
        else:
            replicated_full += full
    return dict(param_bytes=local_bytes, ideal_bytes=sharded_full / tp + replicated_full,
                sharded_full_bytes=sharded_full, replicated_bytes=replicated_full)


def import_model_code(path: str) -> None:
    """Import what either loader imports before it touches a weight: the config classes (~900
    modules, ~75 MiB of anonymous memory for code objects, whatever the model's size), the
    Llama modeling code and transformers' distributed module. Done before the baseline so the
    baseline is a process ready to load this model and peak - baseline is the load itself."""
    import transformers
    from transformers.distributed import DistributedConfig  # noqa: F401

    config = transformers.AutoConfig.from_pretrained(path)
    transformers.AutoModelForCausalLM._model_mapping[type(config)]  # imports modeling_llama


def mapped_ranges(path: str) -> list[tuple[int, int]]:
    """Address ranges of this process that map files under ``path`` (the safetensors shards)."""
    ranges, prefix = [], os.path.abspath(path) + os.sep
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip().startswith(prefix):
                start, stop = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, stop))
    return ranges


def file_backed_param_bytes(model, path: str) -> int:
    """Bytes of local parameters that are views of the mapped checkpoint files (copy-on-write
    file pages: in RssFile once read, never in RssAnon until written)."""
    from torch.distributed.tensor import DTensor

    ranges, total = mapped_ranges(path), 0
    for param in model.parameters():  # each parameter once, tied or not
        local = param.to_local() if isinstance(param, DTensor) else param
        if any(start <= local.data_ptr() < stop for start, stop in ranges):
            total += local.numel() * local.element_size()
    return total


def worker(loader: str, path: str, tp: int, result_dir: str) -> None:
    import gc

    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401  the baseline includes it

    import nxd_hf  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    bare = read_status()
    import_model_code(path)
    gc.collect()
    dist.barrier()
    baseline = read_status()
    start = time.perf_counter()
    with PeakSampler() as sampler:
        model = load(loader, path, tp)
    seconds = time.perf_counter() - start
    after = read_status()
    result = dict(rank=rank, seconds=seconds, samples=sampler.samples, bare_anon=bare["RssAnon"],
                  baseline_anon=baseline["RssAnon"], peak_anon=sampler.peak["RssAnon"], after_anon=after["RssAnon"],
                  baseline_file=baseline["RssFile"], peak_file=sampler.peak["RssFile"],
                  after_file=after["RssFile"], file_backed_param_bytes=file_backed_param_bytes(model, path),
                  **param_accounting(model, loader, path, tp))
    if loader == "nxd_hf":
        result["bytes_read"] = model.nxd.load_report.bytes_read
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
