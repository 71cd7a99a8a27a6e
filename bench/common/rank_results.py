"""What the benchmark launchers share: reading back the result file each rank wrote."""

import json
import os


def rank_results(result_dir: str, world: int) -> list[dict]:
    """The ``rank{r}.json`` files the ranks wrote into ``result_dir`` (missing ones left out)."""
    results = []
    for r in range(world):
        path = os.path.join(result_dir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
    return results
