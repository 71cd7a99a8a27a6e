"""Memory of loading a ~0.5B-parameter Llama checkpoint under tensor parallelism, per rank:
``nxd_hf.from_pretrained`` beside transformers' own tensor-parallel loading on the same files.

For tp in {1, 2, 4} and each loader, one fresh ``torch.distributed.run`` launch (gloo, CPU):

- parameter bytes per rank (unique local parameters; a DTensor counts its local shard), beside
  the ideal of the loader's own plan: (unsharded bytes of the parameters it shards) / tp +
  bytes of the parameters it replicates (both loaders shard everything but the norms);
- peak anonymous memory: ``RssAnon`` from /proc/self/status, sampled every ~5 ms by a thread
  during the load (``VmHWM`` would count the safetensors files' mapped pages, which the kernel
  can drop at any time), beside the baseline taken just before the load: torch, transformers
  and nxd_hf imported, process group up, and the model's code imported (``import_model_code``,
  ~80 MiB whatever the model's size; "bare" is the process without it). ``RssFile`` peaks are
  recorded for information;
- parameter bytes that are copy-on-write views of the mapped safetensors files. transformers
  keeps every contiguous slice that way (all parameters at tp=1), so they never enter RssAnon
  until written; nxd_hf copies every local slice into its own memory. "anon+mmap" (peak - base
  + mapped parameter bytes) compares the two on equal terms.

Targets (nxd_hf): parameter bytes <= 1.05 x ideal; peak - baseline <= 1.25 x parameter bytes;
peak not above transformers' at the same tp.

Run from the repo root: ``python bench/memory.py [--out PATH] [--ckpt-dir DIR] [--tp 1 2 4]``.
The random checkpoint is written once (bf16, ~1 GB, sharded with an index) and reused.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CKPT = "/tmp/nxd_hf_bench/llama-0.5b"
LOADERS = ("nxd_hf", "transformers")
MODEL = dict(hidden_size=1280, intermediate_size=3456, num_hidden_layers=24, num_attention_heads=16,
             num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)
PARAM_SLACK, PEAK_SLACK = 1.05, 1.25
MiB = 2**20


# ---------------------------------------------------------------- the checkpoint (parent process)

def ensure_checkpoint(path: str) -> None:
    """Write a random bf16 Llama checkpoint to ``path`` unless one with this shape is there."""
    import transformers

    config_file, index_file = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(config_file) and os.path.exists(index_file):
        with open(config_file) as f:
            saved = json.load(f)
        if all(saved.get(k) == v for k, v in MODEL.items()):
            print(f"checkpoint: reusing {path}", flush=True)
            return
    import torch

    start = time.perf_counter()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**MODEL, dtype="bfloat16")
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # ~1 GB, random init
    model.save_pretrained(path, max_shard_size="200MB")
    print(f"checkpoint: wrote {path} in {time.perf_counter() - start:.0f}s", flush=True)


def checkpoint_numels(path: str) -> dict[str, int]:
    """Elements of every tensor in the (sharded) checkpoint, from the safetensors headers."""
    from safetensors import safe_open

    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    numels = {}
    for name in sorted(set(weight_map.values())):
        with safe_open(os.path.join(path, name), framework="pt") as f:
            numels.update({key: math.prod(f.get_slice(key).get_shape()) for key in f.keys()})
    return numels


def checkpoint_summary(path: str) -> dict:
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        num_files = len(set(json.load(f)["weight_map"].values()))
    num_params = sum(checkpoint_numels(path).values())
    return dict(path=path, files=num_files, num_params=num_params, param_bytes=2 * num_params, dtype="bfloat16",
                config=MODEL)


# ---------------------------------------------------------------- one rank (torch.distributed.run worker)

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
    report = getattr(model, "nxd_load_report", None)
    if report is not None:
        result["bytes_read"] = report.bytes_read
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- launches and the table (parent process)

def launch(loader: str, path: str, tp: int, timeout_s: float) -> dict:
    """One fresh torch.distributed.run world of ``tp`` ranks; per-rank results or the error."""
    with tempfile.TemporaryDirectory() as result_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp}",
               os.path.abspath(__file__), "--worker", loader, "--tp", str(tp), "--ckpt-dir", path,
               "--result-dir", result_dir]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, TRANSFORMERS_VERBOSITY="error")
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
            error = None if proc.returncode == 0 else f"exit {proc.returncode}: {_last_error(proc.stderr)}"
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout_s:.0f}s"
        ranks = []
        for r in range(tp):
            file = os.path.join(result_dir, f"rank{r}.json")
            if os.path.exists(file):
                with open(file) as f:
                    ranks.append(json.load(f))
    if len(ranks) < tp and error is None:
        error = "missing rank results"
    return dict(loader=loader, tp=tp, wall_s=time.perf_counter() - start, error=error,
                ranks=ranks if len(ranks) == tp else [])


def _last_error(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors[-1] if errors else lines[-1] if lines else "no output")[:300]


def summarize(run: dict) -> dict:
    """Worst rank of a launch: the numbers the targets are checked on."""
    if run["error"]:
        return dict(loader=run["loader"], tp=run["tp"], error=run["error"])
    ranks = run["ranks"]
    worst = max(ranks, key=lambda r: r["peak_anon"] - r["baseline_anon"])
    return dict(
        loader=run["loader"], tp=run["tp"], error=None,
        param_bytes=max(r["param_bytes"] for r in ranks), ideal_bytes=max(r["ideal_bytes"] for r in ranks),
        bare_anon=worst["bare_anon"], baseline_anon=worst["baseline_anon"], peak_anon=worst["peak_anon"],
        load_anon=worst["peak_anon"] - worst["baseline_anon"], peak_file=max(r["peak_file"] for r in ranks),
        file_backed_param_bytes=worst["file_backed_param_bytes"],
        anon_plus_mapped=worst["peak_anon"] - worst["baseline_anon"] + worst["file_backed_param_bytes"],
        load_seconds=max(r["seconds"] for r in ranks),
    )


def check_targets(ours: dict, theirs: dict | None) -> dict:
    checks = dict(
        param_bytes=ours["param_bytes"] <= PARAM_SLACK * ours["ideal_bytes"],
        peak_anon=ours["load_anon"] <= PEAK_SLACK * ours["param_bytes"],
    )
    if theirs and not theirs["error"]:
        checks["not_above_transformers"] = ours["peak_anon"] <= theirs["peak_anon"]
    return checks


def format_table(rows: list[dict]) -> str:
    cols = (f"{'loader':<13} {'tp':>2} {'params':>7} {'ideal':>7} {'ratio':>5} {'bare':>6} {'base':>6} {'peak':>7} "
            f"{'pk-base':>7} {'target':>7} {'ok':>4} {'file pk':>7} {'mmap':>7} {'anon+mm':>7} {'load s':>6}")
    lines = ["MiB per rank (worst rank). bare: RssAnon with torch+transformers+nxd_hf imported; base: + model code "
             "imported; peak: peak RssAnon during the load; target: 1.25 x params for pk-base; file pk: peak RssFile; "
             "mmap: parameter bytes that are copy-on-write views of the mapped safetensors files (not anonymous); "
             "anon+mm: pk-base + mmap", cols, "-" * len(cols)]
    for row in rows:
        if row["error"]:
            lines.append(f"{row['loader']:<13} {row['tp']:>2} FAILED: {row['error']}")
            continue
        checks = row.get("checks", {})
        ok = "" if not checks else "yes" if checks["peak_anon"] else "NO"
        lines.append(
            f"{row['loader']:<13} {row['tp']:>2} {row['param_bytes'] / MiB:>7.1f} {row['ideal_bytes'] / MiB:>7.1f} "
            f"{row['param_bytes'] / row['ideal_bytes']:>5.3f} {row['bare_anon'] / MiB:>6.1f} "
            f"{row['baseline_anon'] / MiB:>6.1f} {row['peak_anon'] / MiB:>7.1f} {row['load_anon'] / MiB:>7.1f} "
            f"{PEAK_SLACK * row['param_bytes'] / MiB:>7.1f} {ok:>4} {row['peak_file'] / MiB:>7.1f} "
            f"{row['file_backed_param_bytes'] / MiB:>7.1f} {row['anon_plus_mapped'] / MiB:>7.1f} "
            f"{row['load_seconds']:>6.1f}")
    lines.append("")
    for row in rows:
        if row.get("checks"):
            lines.append(f"nxd_hf tp={row['tp']}: " + ", ".join(
                f"{name} {'PASS' if ok else 'FAIL'}" for name, ok in row["checks"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "memory.json"))
    parser.add_argument("--ckpt-dir", default=DEFAULT_CKPT)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument("--worker", choices=LOADERS, help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.ckpt_dir, args.tp[0], args.result_dir)

    start = time.perf_counter()
    ensure_checkpoint(args.ckpt_dir)
    checkpoint = checkpoint_summary(args.ckpt_dir)
    print(f"checkpoint: {checkpoint['num_params']:,} params, {checkpoint['param_bytes'] / MiB:.0f} MiB bf16 "
          f"in {checkpoint['files']} files", flush=True)
    runs, rows = [], []
    for tp in args.tp:
        by_loader = {}
        for loader in LOADERS:
            print(f"launch: {loader} tp={tp} ...", end=" ", flush=True)
            run = launch(loader, args.ckpt_dir, tp, args.timeout)
            print(f"{run['wall_s']:.0f}s" + (f" FAILED: {run['error']}" if run["error"] else ""), flush=True)
            runs.append(run)
            by_loader[loader] = summarize(run)
        ours = by_loader["nxd_hf"]
        if not ours["error"]:
            ours["checks"] = check_targets(ours, by_loader["transformers"])
        rows += [by_loader[loader] for loader in LOADERS]
    print()
    print(format_table(rows))
    total_s = time.perf_counter() - start
    passed = all(row.get("checks") and all(row["checks"].values()) for row in rows if row["loader"] == "nxd_hf")
    print(f"\nnxd_hf targets: {'all PASS' if passed else 'some FAIL'}; total {total_s:.0f}s")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        targets = dict(param_bytes=f"<= {PARAM_SLACK} x ideal", peak_anon=f"peak - base <= {PEAK_SLACK} x param bytes",
                       not_above_transformers="peak RssAnon <= transformers' (same base)")
        json.dump(dict(checkpoint=checkpoint, targets=targets, rows=rows, runs=runs, all_pass=passed,
                       total_seconds=total_s), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
