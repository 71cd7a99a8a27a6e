"""Render the generated tables of ``docs/`` from the JSON in ``bench/results/``: the benchmark
tables of ``docs/benchmarks.md``, each between ``<!-- bench:NAME:begin -->`` and
``<!-- bench:NAME:end -->`` and headed by the date and machine it was measured on (the JSON's
``date`` and ``machine``, from ``bench/common/stamp.py``), and the architecture table of
``docs/architectures.md`` (``bench/architectures/table.py``, its own markers) and the GPU step
tables of ``docs/gpu_speed.md`` (``bench/gpu_step/report.py``). Each table comes
from its benchmark's own formatter, so the page shows what the benchmark printed.

    python -m bench.docs_tables           # rewrite the pages in place
    python -m bench.docs_tables --check   # exit 1 if a page is not what this would write
"""

import argparse
import json
import pathlib
import sys

from bench.architectures import table as architectures_table
from bench.common import REPO, RESULTS
from bench.checkpoint.run import GB
from bench.comm_volume.run import format_case
from bench.context_parallel.run import format_table as context_parallel_table
from bench.fsdp.run import format_table as fsdp_table
from bench.gpu_step import report as gpu_step_report
from bench.lora.run import format_table as lora_table
from bench.memory.report import format_table as memory_table
from bench.optimizer.report import format_table as optimizer_table
from bench.pipeline.summary import LEGEND, format_rows
from bench.train_step.report import format_table as train_step_table

BENCHMARKS = REPO / "docs" / "benchmarks.md"
ARCHITECTURES = REPO / "docs" / "architectures.md"
GPU_SPEED = REPO / "docs" / "gpu_speed.md"


def _markdown(text: str) -> str:
    """A formatter's markdown output with a blank line around each table and between the other
    lines, so that no line is read as a table row or run into its neighbour."""
    blocks, table = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            table.append(line)
            continue
        if table:
            blocks, table = blocks + ["\n".join(table)], []
        blocks.append(line)
    return "\n\n".join(blocks + (["\n".join(table)] if table else []))


def _fenced(text: str) -> str:
    return f"```text\n{text}\n```"


def comm_volume(result: dict) -> str:
    config = result["config"]
    lines = [f"One transformer block (batch {config['batch']}, seq {config['seq']}, hidden {config['hidden']}, "
             f"{config['num_heads']} heads, {config['num_kv_heads']} K/V heads, intermediate "
             f"{config['intermediate']}, {result['dtype']}); bytes = {result['payload_definition']}, per block "
             "forward + backward.", "",
             "| tp | sequence parallel | kv_size_multiplier | collectives | counted bytes | theory bytes | "
             "counted / theory | ring bytes / rank | beyond Megatron's terms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for case in result["cases"]:
        total = case["total"]
        ratio = "-" if total["ratio"] is None else f"{total['ratio']:.2f}"
        extra = ", ".join(f"{e['phase']} {e['op']} ({e['share_of_total']:.1%})" for e in case["extra_terms"])
        lines.append(f"| {case['tp']} | {case['sequence_parallel']} | {case['kv_size_multiplier']} | "
                     f"{total['count']} | {total['bytes']:,} | {total['theory_bytes']:,} | {ratio} | "
                     f"{total['ring_bytes_per_rank']:,.0f} | {extra or 'none'} |")
    detail = "\n\n".join(format_case(case) for case in result["cases"])
    lines += ["", "<details><summary>per collective</summary>", "", _fenced(detail), "", "</details>"]
    return "\n".join(lines)


def memory(result: dict) -> str:
    return _fenced(memory_table(result["rows"]))


def pipeline(result: dict) -> str:
    verdict = "all met" if result["all_pass"] else "MISSED"
    return _fenced(f"{format_rows(result['rows'])}\n\n{LEGEND.format(quiet=result['quiet_cores'])}\n\n"
                   f"targets: bubble {result['targets']['bubble']}, step {result['targets']['step']}: {verdict}")


def lora(result: dict) -> str:
    summary = result["summary"]
    return _markdown(f"{lora_table(result['rows'])}\nLoRA tp=2 peak / single-process peft LoRA peak: "
                     f"{summary['lora_tp2_peak_over_single_peft']:.2f} (aim <= {summary['target']})")


def optimizer(result: dict) -> str:
    return _markdown(optimizer_table(result))


def checkpoint(result: dict) -> str:
    lines = ["| tp | save GB/s | raw write GB/s | save / raw | load GB/s | raw read GB/s | load / raw | "
             "async blocks (s) | memcpy (s) | async / memcpy |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['tp']} | {r['save_GBps']:.2f} | {r['raw_write_GBps']:.2f} | {r['save_vs_raw']:.2f} | "
                     f"{r['load_GBps']:.2f} | {r['raw_read_GBps']:.2f} | {r['load_vs_raw']:.2f} | "
                     f"{r['async_block_s']:.2f} | {r['memcpy_s']:.2f} | {r['async_vs_memcpy']:.2f} |")
    c = result["consolidation"]
    lines.append(f"Consolidation of the tp=2 checkpoint ({result['rows'][-1]['checkpoint_bytes'] / GB:.2f} GB of "
                 f"tensors) with `max_shard_size={c['max_shard_size']}`: {c['num_shards']} shards in "
                 f"{c['seconds']:.1f} s, peak RSS {c['peak_rss_above_baseline_bytes'] / 1e6:.0f} MB above a bare "
                 f"process = {c['peak_vs_largest_shard']:.2f}x the largest output shard "
                 f"({c['largest_shard_bytes'] / 1e6:.0f} MB).")
    return _markdown("\n".join(lines))


def context_parallel(result: dict) -> str:
    return _markdown(context_parallel_table(result))


def fsdp(result: dict) -> str:
    return _markdown(fsdp_table(result))


def train_step(result: dict) -> str:
    return _markdown(train_step_table(result))


TABLES = dict(comm_volume=comm_volume, memory=memory, pipeline=pipeline, lora=lora, optimizer=optimizer,
              checkpoint=checkpoint, train_step=train_step, overlap=train_step, train_step_peers=train_step,
              train_step_throughput=train_step, context_parallel=context_parallel, fsdp=fsdp)


def _splice(page: str, begin: str, end: str, body: str) -> str:
    if page.count(begin) != 1 or page.count(end) != 1:
        raise ValueError(f"the page needs exactly one {begin} ... {end} pair; add them where the table goes")
    head, rest = page.split(begin, 1)
    return f"{head}{begin}\n{body}\n{end}{rest.split(end, 1)[1]}"


def render(page: str, results: pathlib.Path = RESULTS) -> str:
    """``docs/benchmarks.md`` (``page``) with every benchmark table replaced by what the JSON in
    ``results`` renders."""
    for name, table in TABLES.items():
        result = json.loads((results / f"{name}.json").read_text())
        body = f"*Measured {result['date']} on {result['machine']}.*\n\n{table(result)}"
        page = _splice(page, f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->", body)
    return page


def render_architectures(page: str, results: pathlib.Path = RESULTS) -> str:
    """``docs/architectures.md`` (``page``) with its table replaced by what the JSON renders."""
    architectures = json.loads((results / "architectures.json").read_text())
    return _splice(page, architectures_table.BEGIN, architectures_table.END, architectures_table.table(architectures))


def render_gpu_speed(page: str, results: pathlib.Path = RESULTS) -> str:
    """``docs/gpu_speed.md`` (``page``) with each shape's ``bench/gpu_step`` table, or a line saying
    it has not been measured."""
    for shape in ("1b", "8b"):
        path = results / f"gpu_step_{shape}.json"
        if path.exists():
            report = json.loads(path.read_text())
            body = f"{gpu_step_report.heading(report)}\n\n{gpu_step_report.format_table(report)}"
        else:
            body = f"*Not measured yet: `python -m bench.gpu_step --shape {shape}` on a GPU writes this table.*"
        page = _splice(page, f"<!-- bench:gpu_step_{shape}:begin -->", f"<!-- bench:gpu_step_{shape}:end -->", body)
    return page


PAGES = {BENCHMARKS: render, ARCHITECTURES: render_architectures, GPU_SPEED: render_gpu_speed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a page differs from what would be written")
    args = parser.parse_args(argv)
    stale = []
    for path, render_page in PAGES.items():
        page = path.read_text()
        rendered = render_page(page)
        if rendered == page:
            continue
        stale.append(path.relative_to(REPO))
        if not args.check:
            path.write_text(rendered)
    if args.check and stale:
        print(f"stale generated tables in {', '.join(map(str, stale))}: run python -m bench.docs_tables",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
