"""Crash safety: a process SIGKILLed while writing a new checkpoint, while re-saving an existing
tag, or between the two renames that put a re-saved tag in place, leaves every earlier
checkpoint loadable and ``tag=None`` never picks the partial one; an ``async_save`` followed at
once by interpreter exit still completes. Each case is a process that kills itself at the
chosen moment (a patched write): forked from the test forkserver, or, where the interpreter's
own exit is under test, a fresh Python."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from support.paths import TESTS
from nxd_hf.testing import run_process


def job(path: str, mode: str, report: str) -> None:
    """Save checkpoint "a", then die in ``mode``'s way while saving the next; or ("load") write
    what ``load_checkpoint`` picks to ``report``."""
    import torch

    import nxd_hf
    from support import hf_parity
    from nxd_hf.checkpoint import store, writer

    torch.set_num_threads(1)
    _, model = hf_parity.build_pair("llama")
    nxd_hf.parallelize(model)
    if mode == "load":
        with open(report, "w") as f:
            f.write(f"LOADED {nxd_hf.load_checkpoint(path, model=model)}")
        return
    nxd_hf.save_checkpoint(path, tag="a", model=model, user_content="first")
    real_write, real_rename = writer.write_file, os.rename
    if mode in ("kill_new", "kill_resave"):
        def write_then_die(*args, **kwargs):
            real_write(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
        writer.write_file = write_then_die
    elif mode == "kill_between_renames":
        def rename(src, dst):
            real_rename(src, dst)
            if dst.endswith(".a.old"):
                os.kill(os.getpid(), signal.SIGKILL)
        store.os.rename = rename
    elif mode == "async_exit":
        def slow_write(*args, **kwargs):
            time.sleep(1.0)
            return real_write(*args, **kwargs)
        writer.write_file = slow_write
    tag = "b" if mode == "kill_new" else "a"
    nxd_hf.save_checkpoint(path, tag=tag, model=model, user_content="second", async_save=mode == "async_exit")
    with open(report, "w") as f:
        f.write("RETURNED")  # async_save: the interpreter exits now, the write still finishes


SCRIPT = textwrap.dedent("""
    import sys
    sys.path[:0] = [{tests!r}, {here!r}]
    from test_checkpoint_crash import job
    job(*sys.argv[1:])
""")


def _run_interpreter(tmp_path, mode) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.format(tests=str(TESTS), here=os.path.dirname(os.path.abspath(__file__))))
    return subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), mode, str(tmp_path / "report")],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)


@pytest.mark.parametrize("mode, newest, leftover", [
    ("kill_new", "first", ".b.tmp"),
    ("kill_resave", "first", ".a.tmp"),
    ("kill_between_renames", "first", ".a.old"),
    ("async_exit", "second", None),
])
def test_killed_save_leaves_the_previous_checkpoint(tmp_path, mode, newest, leftover):
    path, report = tmp_path / "ckpt", tmp_path / "report"
    if mode == "async_exit":
        done = _run_interpreter(tmp_path, mode)
        assert done.returncode == 0 and report.read_text() == "RETURNED", done.stderr
    else:
        assert run_process(job, str(path), mode, str(report)) == -signal.SIGKILL
        assert not report.exists()
    if leftover:
        assert leftover in os.listdir(path), os.listdir(path)
    assert run_process(job, str(path), "load", str(report)) == 0
    assert report.read_text() == f"LOADED {newest}"
