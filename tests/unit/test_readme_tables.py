"""README.md's benchmark tables are what ``bench/readme_tables.py`` renders from ``bench/results/``
(no processes: reads the committed JSON)."""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # bench/ is not an installed package

from bench import readme_tables  # noqa: E402


def test_readme_tables_match_results():
    assert readme_tables.main(["--check"]) == 0, "README.md is stale: run python bench/readme_tables.py"


def test_stale_table_is_caught():
    readme = readme_tables.README.read_text()
    begin = "<!-- bench:lora:begin -->\n"
    stale = readme.replace(begin, begin + "| hand-edited | row |\n")
    assert stale != readme and readme_tables.render(stale) == readme


def test_every_table_is_stamped():
    readme = readme_tables.README.read_text()
    for name in readme_tables.TABLES:
        block = readme.split(f"<!-- bench:{name}:begin -->\n", 1)[1]
        assert block.startswith("*Measured 20"), name


def test_missing_markers_are_an_error():
    with pytest.raises(ValueError, match="bench:lora:begin"):
        readme_tables.render(readme_tables.README.read_text().replace("<!-- bench:lora:begin -->", ""))
