"""The table printer the benchmarks share (``bench/common/table.py``), and the tables of
``bench.moe`` and ``bench.plan`` it prints from their committed results."""

import json

from bench.common import RESULTS
from bench.common.table import Column, table
from bench.moe.run import format_case
from bench.plan.run import format_rows


def test_columns_align_and_format_numbers_not_strings():
    columns = [Column(title="name", width=6, left=True), Column(title="bytes", width=9, spec=","),
               Column(title="ratio", width=6, spec=".3f")]
    lines = table(columns, [("a", 1234567, 0.5), ("total", 12, "(n/a)"), ("short", 3)], rule=True)
    assert lines == ["name       bytes  ratio",
                     "-----------------------",
                     "a      1,234,567  0.500",
                     "total         12  (n/a)",
                     "short          3"]


def test_moe_and_plan_tables_from_the_committed_results():
    case = json.loads((RESULTS / "moe.json").read_text())["cases"][0]
    lines = format_case(case).splitlines()
    assert lines[1] == "all-to-all item             bytes    minimum  ratio"
    term = case["token_terms"][0]
    assert lines[2] == f"{term['item']:<22} {term['bytes']:>10,} {term['minimum']:>10,} {term['ratio']:>6.3f}"
    assert lines[-len(case["memory"]) - 1].startswith("rank    params B   expected  ratio    AdamW B")
    rows = json.loads((RESULTS / "plan.json").read_text())["rows"]
    lines = format_rows(rows).splitlines()
    assert lines[1] == "-" * len(lines[0]) and len(lines) == 2 + sum(len(row["ranks"]) for row in rows)
    first, rank = rows[0], rows[0]["ranks"][0]
    assert lines[2].startswith(f"{first['model']:<10} {first['layout']:<34} {rank['rank']:>4} "
                               f"{rank['predicted_peak'] / 2**20:>9.1f}")
