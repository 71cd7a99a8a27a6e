"""Architecture sweep: every transformers model type with a non-empty ``base_model_tp_plan`` and a
causal-LM class, shrunk (``nxd_hf.parity.shrink``), on every layout below, against the
unparallelized model (``nxd_hf.parity.run_case``: loss and every gathered gradient).

One spawn per world size runs every architecture; each case is isolated (failures are caught
and classified inside the ranks, which agree on the outcome before going on). Rank 0 appends
each result to a JSON-lines log as it goes; should a spawn die anyway, the sweep records the
case it was in as a crash and resumes after it. Writes ``bench/results/architectures.json``;
``bench/architectures/table.py`` turns it into the table in ``docs/architectures.md``.

    python -m bench.architectures [--world 2 4] [--types gemma apertus ...]
"""

import argparse
import json
import os
import pathlib
import tempfile
import time
import warnings

import transformers

from bench.common import RESULTS
from bench.common.stamp import stamp
from nxd_hf.testing import DistributedTestError, run_distributed

# name -> (world size, tp, pp, sequence parallel[, expert parallel]); the ep layouts run only
# for mixture-of-experts types (``is_moe``), their ep ranks all on the same batch (``run_case``)
LAYOUTS = {
    "tp2": (2, 2, 1, False), "tp2_sp": (2, 2, 1, True), "pp2": (2, 1, 2, False),
    "tp4": (4, 4, 1, False), "tp4_sp": (4, 4, 1, True), "tp2_pp2": (4, 2, 2, False),
    "ep2": (2, 1, 1, False, 2), "tp2_ep2": (4, 2, 1, False, 2),
}


def is_moe(config) -> bool:
    """Whether the (tiny) config has routed experts: the ep layouts apply to it."""
    return any(isinstance(getattr(config, name, None), int) and getattr(config, name) > 1
               for name in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"))


def model_types() -> list[str]:
    """Model types of this transformers with a causal-LM class and a non-empty TP plan."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config = transformers.AutoConfig.for_model(model_type)
        except Exception:  # noqa: BLE001  a config that does not build with defaults (gemma4_assistant)
            continue
        if getattr(config, "base_model_tp_plan", None):
            found.append(model_type)
    return found


def _lm_config(config):
    """The config the causal-LM class takes (the text config of a composite one)."""
    from nxd_hf.parity.cases import causal_lm_class

    try:
        model_cls = causal_lm_class(config)
    except KeyError:
        model_cls = None
    if model_cls is not None and isinstance(config, model_cls.config_class):
        return config
    return config.get_text_config()


# Default configs of this transformers that do not build a model (or build one without an
# attention layer); the least that makes them build.
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
BUILD_FIXES = {
    "cohere_compass_text": dict(rope_parameters={"full_attention": _ROPE, "sliding_attention": _ROPE}),
    "dots1": dict(n_shared_experts=1),
    "dots3_note_text": dict(per_layer_config={}, num_hidden_layers=2, mlp_layer_types=["dense", "sparse"],
                            layer_types=["indexed_attention", "indexed_attention"]),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4,
                           indexer_compress_ratio=2),
}


def tiny_config(model_type: str):
    from nxd_hf.parity.shrink import shrink_config

    config = _lm_config(transformers.AutoConfig.for_model(model_type))
    return shrink_config(config, overrides=BUILD_FIXES.get(model_type))


def _sweep_rank(types: list[str], layouts: list[str], log_path: str) -> None:
    """Every (type, layout) case on this rank; rank 0 logs each agreed result."""
    import torch.distributed as dist

    from nxd_hf.parity.cases import run_case

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    for model_type in types:
        for layout in layouts:
            _, tp, pp, sp, *ep = LAYOUTS[layout]
            ep = ep[0] if ep else 1
            start = time.perf_counter()
            try:
                config = tiny_config(model_type)
            except Exception as exc:  # noqa: BLE001  the same on every rank: our shrinking failed
                result = dict(status="build_error", message=f"{type(exc).__name__}: {exc}"[:1000])
            else:
                if ep > 1 and not is_moe(config):
                    continue
                case = run_case(config, tensor_parallel_size=tp, pipeline_parallel_size=pp, sequence_parallel=sp,
                                expert_parallel_size=ep)
                result = dict(vars(case))
            result["seconds"] = round(time.perf_counter() - start, 2)
            if dist.get_rank() == 0:
                with open(log_path, "a") as f:
                    f.write(json.dumps(dict(model_type=model_type, layout=layout, **result)) + "\n")


def _read_log(log_path: str) -> list[dict]:
    if not os.path.exists(log_path):
        return []
    with open(log_path) as f:
        return [json.loads(line) for line in f if line.strip()]


def sweep_world(world_size: int, types: list[str], layouts: list[str], log_path: str) -> None:
    """Run ``layouts`` (all of ``world_size``) for ``types``, resuming after a dead spawn."""
    remaining = list(types)
    while remaining:
        try:
            run_distributed(_sweep_rank, world_size, remaining, layouts, log_path, timeout_s=3600)
            return
        except DistributedTestError as exc:
            done = {(r["model_type"], r["layout"]) for r in _read_log(log_path)}
            current = next(t for t in remaining if any((t, lay) not in done for lay in layouts))
            with open(log_path, "a") as f:
                for layout in layouts:
                    if (current, layout) not in done:
                        f.write(json.dumps(dict(model_type=current, layout=layout, status="crash",
                                                message=f"the ranks died: {str(exc)[-1500:]}")) + "\n")
            remaining = remaining[remaining.index(current) + 1:]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.architectures", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--types", nargs="+", default=None)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "architectures.json")
    args = parser.parse_args(argv)
    types = args.types or model_types()
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "log.jsonl")
        for world in args.world:
            layouts = [name for name in args.layouts if LAYOUTS[name][0] == world]
            if layouts:
                sweep_world(world, types, layouts, log_path)
        results = {}
        for r in _read_log(log_path):
            results.setdefault(r.pop("model_type"), {})[r.pop("layout")] = r
    previous = json.loads(args.out.read_text())["results"] if args.out.exists() and args.types else {}
    for model_type, cases in results.items():  # a partial run updates the types it ran
        previous.setdefault(model_type, {}).update(cases)
    payload = dict(**stamp(), transformers=transformers.__version__, layouts=LAYOUTS,
                   results=dict(sorted(previous.items())))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = args.out.with_suffix(".json.tmp")
    tmp_out.write_text(json.dumps(payload, indent=1) + "\n")
    tmp_out.replace(args.out)
    print(summary(payload["results"]))


def summary(results: dict) -> str:
    """Counts per status for every layout."""
    lines = []
    for layout in LAYOUTS:
        counts = {}
        for cases in results.values():
            if layout in cases:
                counts[cases[layout]["status"]] = counts.get(cases[layout]["status"], 0) + 1
        if counts:
            lines.append(f"{layout:8s} " + "  ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    return "\n".join(lines)
