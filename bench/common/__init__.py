"""What the benchmarks share: the repository root, where results go, when and on what a
benchmark ran (``stamp``) and reading back the file each rank wrote (``rank_results``)."""

import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
