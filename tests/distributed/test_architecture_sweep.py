"""The architecture sweep's per-case timeout (``bench.architectures.run.sweep_world``): a case
past it is recorded as a "hang", a case whose ranks die as a "crash", and the sweep goes on with
the next case in a new spawn. The cases here stand in for ``parity_case`` and agree with a barrier
at their end, as ``run_case`` does."""

import os
import time

import torch.distributed as dist

from bench.architectures import run, table


def stand_in_case(model_type: str, layout: str) -> dict:
    if model_type == "sleeps":
        time.sleep(120)
    if model_type == "dies" and dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()
    return dict(status="pass", message="")


def test_case_past_its_timeout_is_a_hang_and_the_sweep_goes_on(tmp_path):
    log = str(tmp_path / "log.jsonl")
    start = time.perf_counter()
    run.sweep_world(2, ["first", "sleeps", "dies", "last"], ["pp2"], log, case_timeout_s=3, case_fn=stand_in_case)
    elapsed = time.perf_counter() - start
    results = {r["model_type"]: r for r in run._read_log(log)}
    assert list(results) == ["first", "sleeps", "dies", "last"]
    assert results["first"]["status"] == results["last"]["status"] == "pass"
    assert results["sleeps"]["status"] == "hang", results["sleeps"]
    assert results["sleeps"]["message"].startswith("timed out after 3 s"), results["sleeps"]
    assert results["dies"]["status"] == "crash" and "died" in results["dies"]["message"], results["dies"]
    assert elapsed < 40, elapsed  # the sleeping case is stopped at 3 s, not after its 120 s
    rendered = table.table(dict(transformers="x", results={"sleeps": {"pp2": results["sleeps"]}}))
    assert "| sleeps | **HANG** | timed out after 3 s" in rendered, rendered
