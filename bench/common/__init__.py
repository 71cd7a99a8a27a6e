"""What the benchmarks share: the repository root, where results go, when and on what a
benchmark ran (``stamp``), reading back the file each rank wrote (``rank_results``) and the
plain-text tables they print (``table``)."""

import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
