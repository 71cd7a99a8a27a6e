"""Architecture sweep: every transformers model type with a non-empty ``base_model_tp_plan`` and a
causal-LM class, shrunk (``nxd_hf.parity.shrink``), on every layout below, against the
unparallelized model (``nxd_hf.parity.run_case``: loss and every gathered gradient).

One spawn per world size runs every architecture; each case is isolated (failures are caught
and classified inside the ranks, which agree on the outcome before going on). Rank 0 appends
each result to a JSON-lines log as it goes, and names the case it starts in a side file; should
a spawn die anyway, the sweep records that case as a crash and resumes after it. A case that runs
longer than ``--case-timeout`` seconds ends its spawn (rank 0's timer marks the case timed out,
prints its stacks on stderr and exits; its peers are stopped with it): the sweep records it as a
"hang" and resumes after it. Writes ``bench/results/architectures.json``;
``bench/architectures/table.py`` turns it into the table in ``docs/architectures.md``.

    python -m bench.architectures [--world 2 4] [--types gemma apertus ...] [--case-timeout 300]
"""

import argparse
import faulthandler
import json
import os
import pathlib
import tempfile
import threading
import time
import warnings

import transformers

from bench.common import RESULTS
from bench.common.stamp import stamp
from nxd_hf.testing import DistributedTestError, run_distributed

# name -> (world size, tp, pp, sequence parallel[, expert parallel[, fused loss]]); the ep layouts
# run only for mixture-of-experts types (``is_moe``), their ep ranks all on the same batch
# (``run_case``); "tp2_fused": tp=2 with ``fused_loss=True``
LAYOUTS = {
    "tp2": (2, 2, 1, False), "tp2_sp": (2, 2, 1, True), "pp2": (2, 1, 2, False),
    "tp4": (4, 4, 1, False), "tp4_sp": (4, 4, 1, True), "tp2_pp2": (4, 2, 2, False),
    "ep2": (2, 1, 1, False, 2), "tp2_ep2": (4, 2, 1, False, 2), "tp2_fused": (2, 2, 1, False, 1, True),
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
    "bamba": dict(attn_layer_indices=[1]),  # the shrunk default keeps no attention layer, which its cache needs
    "dory": dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                 n_input_layers=1, n_recurrent_layers=1, n_output_layers=1),  # counts that add up to the layers
    "dots1": dict(n_shared_experts=1),
    "falcon_h1": dict(mamba_d_ssm=None, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=8),
    "dots3_note_text": dict(per_layer_config={}, num_hidden_layers=2, mlp_layer_types=["dense", "sparse"],
                            layer_types=["indexed_attention", "indexed_attention"]),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    # its default indexer layers lie past the shrunk layer count; NVFP4 rounding of K/V needs head_dim % 16 == 0
    "kolibri1_1": dict(num_hidden_layers=2, layer_types=["sliding_attention", "indexed_attention"], index_layers=[1],
                       kv_source_layers=[0, 1], head_dim=16, mlp_only_layers=[0]),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4,
                           indexer_compress_ratio=2),
}


def tiny_config(model_type: str):
    from nxd_hf.parity.shrink import shrink_config

    config = _lm_config(transformers.AutoConfig.for_model(model_type))
    return shrink_config(config, overrides=BUILD_FIXES.get(model_type))


CASE_TIMEOUT_S = 300.0
"""Default limit of one (type, layout) case, in seconds: the slowest case of the committed sweep
took under 2 s, the first of a spawn a few more; the rest is room for a loaded machine."""


def _plain_forward(config) -> None:
    """The unparallelized model runs on the shrunk config (bamba's, with no attention layer left,
    does not): otherwise its failure would read as nxd_hf's crash."""
    from nxd_hf.parity.cases import causal_lm_class, make_batch

    ids, labels = make_batch(config.get_text_config().vocab_size)
    causal_lm_class(config)(config)(input_ids=ids, labels=labels)


def parity_case(model_type: str, layout: str) -> dict | None:
    """One sweep case inside the ranks: the agreed ``run_case`` outcome as a dict, or None when
    the layout does not apply (an ep layout for a type without routed experts)."""
    from nxd_hf.parity.cases import run_case

    _, tp, pp, sp, *rest = LAYOUTS[layout]
    ep, fused = tuple(rest) + (1, False)[len(rest):]
    try:
        config = tiny_config(model_type)
        _plain_forward(config)
    except Exception as exc:  # noqa: BLE001  the same on every rank: our shrinking failed
        return dict(status="build_error", message=f"{type(exc).__name__}: {exc}"[:1000])
    if ep > 1 and not is_moe(config):
        return None
    case = run_case(config, tensor_parallel_size=tp, pipeline_parallel_size=pp, sequence_parallel=sp,
                    expert_parallel_size=ep, fused_loss=fused)
    return dict(vars(case))


def _current_path(log_path: str) -> str:
    return log_path + ".current"


def _name_case(log_path: str, model_type: str, layout: str, **extra) -> None:
    """Rank 0's record of the case it is in (``extra``: timed_out=True once its timer fired)."""
    tmp = _current_path(log_path) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(dict(model_type=model_type, layout=layout, **extra), f)
    os.replace(tmp, _current_path(log_path))


def _time_out(log_path: str, model_type: str, layout: str) -> None:
    faulthandler.dump_traceback(all_threads=True)  # where it hung, on the sweep's stderr
    _name_case(log_path, model_type, layout, timed_out=True)
    os._exit(124)


def _sweep_rank(cases: list[tuple[str, str]], log_path: str, case_timeout_s: float, case_fn) -> None:
    """Every (type, layout) case on this rank; rank 0 names each case it starts and logs each
    agreed result. A case past ``case_timeout_s`` exits rank 0 (``sweep_world`` goes on): a
    Python timer that marks the case timed out, and one in C (``faulthandler``) a minute later
    should the case hold the GIL."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    first = dist.get_rank() == 0
    for model_type, layout in cases:
        start = time.perf_counter()
        if first:
            _name_case(log_path, model_type, layout)
            timer = threading.Timer(case_timeout_s, _time_out, (log_path, model_type, layout))
            timer.daemon = True
            timer.start()
            faulthandler.dump_traceback_later(case_timeout_s + 60, exit=True)
        try:
            result = case_fn(model_type, layout)
        finally:
            if first:
                timer.cancel()
                faulthandler.cancel_dump_traceback_later()
        if result is None:
            continue
        result["seconds"] = round(time.perf_counter() - start, 2)
        if first:
            with open(log_path, "a") as f:
                f.write(json.dumps(dict(model_type=model_type, layout=layout, **result)) + "\n")


def _read_log(log_path: str) -> list[dict]:
    if not os.path.exists(log_path):
        return []
    with open(log_path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _dead_case(log_path: str, cases: list[tuple[str, str]]) -> tuple[int, bool]:
    """(index in ``cases`` of the case a dead spawn was in, whether it timed out): the case rank 0
    named last, or else the first case without a result."""
    done = {(r["model_type"], r["layout"]) for r in _read_log(log_path)}
    try:
        with open(_current_path(log_path)) as f:
            current = json.load(f)
        index = cases.index((current["model_type"], current["layout"]))
    except (OSError, ValueError, KeyError):
        current, index = {}, -1
    if index >= 0 and cases[index] not in done:
        return index, current.get("timed_out", False)
    return next(i for i, case in enumerate(cases) if case not in done), False


def sweep_world(world_size: int, types: list[str], layouts: list[str], log_path: str, *,
                case_timeout_s: float = CASE_TIMEOUT_S, case_fn=parity_case) -> None:
    """Run ``layouts`` (all of ``world_size``) for ``types``, resuming after a dead spawn: a case
    past ``case_timeout_s`` is recorded as "hang", one whose ranks died as "crash". ``case_fn``
    (module level, see ``parity_case``) runs one case inside the ranks."""
    remaining = [(t, layout) for t in types for layout in layouts]
    while remaining:
        if os.path.exists(_current_path(log_path)):
            os.remove(_current_path(log_path))
        try:  # the spawn's own limit only backs up the per-case one
            run_distributed(_sweep_rank, world_size, remaining, log_path, case_timeout_s, case_fn,
                            timeout_s=case_timeout_s * len(remaining) + 120)
            return
        except DistributedTestError as exc:
            index, timed_out = _dead_case(log_path, remaining)
            model_type, layout = remaining[index]
            if timed_out:
                record = dict(status="hang", message=f"timed out after {case_timeout_s:g} s (its ranks were stopped; "
                                                     "the sweep went on with the next case)")
            else:
                record = dict(status="crash", message=f"the ranks died: {str(exc)[-1500:]}")
            with open(log_path, "a") as f:
                f.write(json.dumps(dict(model_type=model_type, layout=layout, **record)) + "\n")
            remaining = remaining[index + 1:]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.architectures", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--types", nargs="+", default=None)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "architectures.json")
    parser.add_argument("--case-timeout", type=float, default=CASE_TIMEOUT_S,
                        help="seconds one (type, layout) case may run before it is recorded as a hang")
    args = parser.parse_args(argv)
    types = args.types or model_types()
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "log.jsonl")
        for world in args.world:
            layouts = [name for name in args.layouts if LAYOUTS[name][0] == world]
            if layouts:
                sweep_world(world, types, layouts, log_path, case_timeout_s=args.case_timeout)
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
