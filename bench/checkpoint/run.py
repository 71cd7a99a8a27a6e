"""Checkpoint I/O of a ~0.5B-parameter llama (bf16) at tp 1 and 2, beside the raw disk.

Per tp, in the same run on the same disk:
- save and load GB/s (bytes of the checkpoint's tensor files / wall time of save_checkpoint or
  load_checkpoint), beside a raw fsync'd sequential write and a sequential read of the same
  number of bytes per rank; page cache is dropped for every file (``posix_fadvise``
  DONTNEED) before any read, so both reads come from the disk or neither does;
- the time ``save_checkpoint(async_save=True)`` blocks training, beside a memcpy (clone) of
  the same parameters;
- ``consolidate`` (tp=2 checkpoint, ``max_shard_size`` well below the model) wall time and
  peak RSS of a fresh process above a bare process that imports the same modules.
Report only; the issue's targets: >= 0.5x raw disk, async blocking <= 2x the memcpy,
consolidation <= 1.5x the largest output shard above baseline.

Run from the repo root: ``python -m bench.checkpoint [--out PATH] [--dir DIR] [--layers N]``.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from bench.common import RESULTS
from bench.common.stamp import stamp
from nxd_hf import backend
from nxd_hf.testing import run_distributed

GB = 1e9


def _config(layers: int):
    import transformers

    return transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
                                    num_key_value_heads=8, num_hidden_layers=layers, vocab_size=32000,
                                    tie_word_embeddings=False)


def _drop_cache(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def _raw(path: str, nbytes: int) -> tuple[float, float]:
    """(write s, read s) of ``nbytes`` written sequentially in 64 MiB blocks, fsync'd."""
    block = os.urandom(1 << 26)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for offset in range(0, nbytes, len(block)):
            f.write(block[: min(len(block), nbytes - offset)])
        f.flush()
        os.fsync(f.fileno())
    write = time.perf_counter() - start
    _drop_cache(os.path.dirname(path))
    start = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 26):
            pass
    return write, time.perf_counter() - start


def _timed(fn) -> float:
    backend.barrier()
    start = time.perf_counter()
    fn()
    backend.barrier()
    return time.perf_counter() - start


def _files_bytes(path: str, rank: int) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
               if f"rank_{rank:05d}.safetensors" in f)


def run_tp(directory: str, layers: int) -> dict:
    import accelerate
    import transformers

    import nxd_hf

    tp = backend.world_size()
    torch.manual_seed(0)
    with accelerate.init_empty_weights(include_buffers=False):
        model = transformers.AutoModelForCausalLM.from_config(_config(layers), dtype=torch.bfloat16)
    nxd_hf.parallelize(model, tensor_parallel_size=tp)
    for module in model.modules():  # random local shards (the values do not matter for I/O)
        for name, param in list(module._parameters.items()):
            if param is not None:
                new = torch.nn.Parameter(torch.randn(param.shape, dtype=torch.bfloat16))
                new.__dict__.update(param.__dict__)
                module._parameters[name] = new
    rank = backend.rank()
    path = os.path.join(directory, f"tp{tp}")
    save_s = _timed(lambda: nxd_hf.save_checkpoint(path, tag="sync", model=model))
    my_bytes = _files_bytes(os.path.join(path, "sync"), rank)
    total_bytes = sum(backend.all_gather_object(my_bytes))
    _drop_cache(path)
    load_s = _timed(lambda: nxd_hf.load_checkpoint(path, tag="sync", model=model))
    raw_write, raw_read = _raw(os.path.join(directory, f"raw_tp{tp}_rank{rank}.bin"), my_bytes)
    raw_write, raw_read = max(backend.all_gather_object(raw_write)), max(backend.all_gather_object(raw_read))
    memcpy_s = _timed(lambda: [p.detach().clone() for p in model.parameters()])
    async_s = _timed(lambda: nxd_hf.save_checkpoint(path, tag="async", model=model, async_save=True))
    nxd_hf.wait_for_checkpoint()
    backend.barrier()
    os.remove(os.path.join(directory, f"raw_tp{tp}_rank{rank}.bin"))
    params = sum(p.numel() for p in model.parameters())
    return {"tp": tp, "params_per_rank": params, "checkpoint_bytes": total_bytes,
            "save_s": save_s, "load_s": load_s, "raw_write_s": raw_write, "raw_read_s": raw_read,
            "save_GBps": total_bytes / save_s / GB, "load_GBps": total_bytes / load_s / GB,
            "raw_write_GBps": total_bytes / raw_write / GB, "raw_read_GBps": total_bytes / raw_read / GB,
            "save_vs_raw": raw_write / save_s, "load_vs_raw": raw_read / load_s,
            "async_block_s": async_s, "memcpy_s": memcpy_s, "async_vs_memcpy": async_s / memcpy_s}


PEAK = "import resource, sys; {body}; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"


def consolidation(directory: str, max_shard_size: str) -> dict:
    base = PEAK.format(body="import torch, transformers, safetensors, nxd_hf.checkpoint.consolidate")
    body = (f"from nxd_hf.checkpoint.consolidate import consolidate; "
            f"consolidate({os.path.join(directory, 'tp2')!r}, {os.path.join(directory, 'hf')!r}, tag='sync', "
            f"max_shard_size={max_shard_size!r})")
    baseline = int(subprocess.run([sys.executable, "-c", base], capture_output=True, text=True, check=True).stdout)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PEAK.format(body=body)], capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - start
    shards = [os.path.getsize(os.path.join(directory, "hf", f)) for f in os.listdir(os.path.join(directory, "hf"))
              if f.startswith("model-")]
    above = int(done.stdout) - baseline
    return {"max_shard_size": max_shard_size, "seconds": seconds, "num_shards": len(shards),
            "largest_shard_bytes": max(shards), "peak_rss_above_baseline_bytes": above,
            "peak_vs_largest_shard": above / max(shards)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoint", )
    parser.add_argument("--out", default=str(RESULTS / "checkpoint.json"))
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "nxd_hf_bench_checkpoint"))
    parser.add_argument("--layers", type=int, default=34, help="34 layers: ~0.49B parameters")
    parser.add_argument("--max-shard-size", default="200MB")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    rows = []
    for tp in (1, 2):
        rows.append(run_distributed(run_tp, tp, args.dir, args.layers, timeout_s=1800)[0])
        print(json.dumps(rows[-1]))
    result = {**stamp(), "rows": rows, "consolidation": consolidation(args.dir, args.max_shard_size)}
    print(json.dumps(result["consolidation"]))
    print(f"{'tp':>3} {'save GB/s':>10} {'raw write':>10} {'x':>5} {'load GB/s':>10} {'raw read':>9} {'x':>5} "
          f"{'async s':>8} {'memcpy s':>9} {'x':>5}")
    for r in rows:
        print(f"{r['tp']:>3} {r['save_GBps']:>10.2f} {r['raw_write_GBps']:>10.2f} {r['save_vs_raw']:>5.2f} "
              f"{r['load_GBps']:>10.2f} {r['raw_read_GBps']:>9.2f} {r['load_vs_raw']:>5.2f} {r['async_block_s']:>8.3f} "
              f"{r['memcpy_s']:>9.3f} {r['async_vs_memcpy']:>5.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    shutil.rmtree(args.dir, ignore_errors=True)
