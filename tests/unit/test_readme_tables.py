"""The generated tables of ``docs/`` (benchmarks and architectures) are what
``bench/docs_tables.py`` renders from ``bench/results/`` (no processes: reads the committed JSON)."""

import pytest

from bench import docs_tables


def test_readme_tables_match_results():
    assert docs_tables.main(["--check"]) == 0, "docs/ tables are stale: run python -m bench.docs_tables"


def test_stale_table_is_caught():
    page = docs_tables.BENCHMARKS.read_text()
    begin = "<!-- bench:lora:begin -->\n"
    stale = page.replace(begin, begin + "| hand-edited | row |\n")
    assert stale != page and docs_tables.render(stale) == page


def test_every_table_is_stamped():
    page = docs_tables.BENCHMARKS.read_text()
    for name in docs_tables.TABLES:
        block = page.split(f"<!-- bench:{name}:begin -->\n", 1)[1]
        assert block.startswith("*Measured 20"), name


def test_missing_markers_are_an_error():
    with pytest.raises(ValueError, match="bench:lora:begin"):
        docs_tables.render(docs_tables.BENCHMARKS.read_text().replace("<!-- bench:lora:begin -->", ""))


def test_stale_architecture_table_is_caught():
    page = docs_tables.ARCHITECTURES.read_text()
    stale = page.replace("| apertus | yes |", "| apertus | no |")
    assert stale != page and docs_tables.render_architectures(stale) == page
