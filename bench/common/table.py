"""The plain-text tables the benchmarks print: a header of column titles, then one line per row,
each cell right-aligned in its column (``left``: left-aligned) and formatted by the column's spec."""

import dataclasses


@dataclasses.dataclass(kw_only=True)
class Column:
    title: str
    width: int
    spec: str = ""
    """Format spec of a number in this column after alignment and width (``","``, ``".3f"``); a
    string is written as it is."""
    left: bool = False


def header(columns: list[Column]) -> str:
    return " ".join(f"{c.title:{'<' if c.left else '>'}{c.width}}" for c in columns)


def row(columns: list[Column], values) -> str:
    """One line: ``values`` in the first ``len(values)`` columns."""
    cells = []
    for column, value in zip(columns, values):
        align = "<" if column.left else ">"
        spec = "" if isinstance(value, str) else column.spec
        cells.append(f"{value:{align}{column.width}{spec}}")
    return " ".join(cells)


def table(columns: list[Column], rows, *, rule: bool = False) -> list[str]:
    """The header (and a rule of dashes under it with ``rule``), then a line per row of values."""
    head = header(columns)
    return [head, *(["-" * len(head)] if rule else []), *(row(columns, values) for values in rows)]
