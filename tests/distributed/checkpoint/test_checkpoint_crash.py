"""Crash safety: a process SIGKILLed while writing a new checkpoint, while re-saving an existing
tag, or between the two renames that put a re-saved tag in place, leaves every earlier
checkpoint loadable and ``tag=None`` never picks the partial one; an ``async_save`` followed at
once by interpreter exit still completes. Each case is a fresh single-process Python that
kills itself at the chosen moment (a patched write)."""

import os
import subprocess
import sys
import textwrap

import pytest

from support.paths import TESTS

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {tests!r})
    import nxd_hf
    from support import hf_parity
    from nxd_hf.checkpoint import store, writer

    path, mode = sys.argv[1], sys.argv[2]
    _, model = hf_parity.build_pair("llama")
    nxd_hf.parallelize(model)
    if mode == "load":
        print("LOADED", nxd_hf.load_checkpoint(path, model=model))
        sys.exit(0)
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
    print("RETURNED")  # async_save: the interpreter exits now, the write still finishes
""")


def _run(script, path, mode):
    return subprocess.run([sys.executable, str(script), str(path), mode], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)


@pytest.mark.parametrize("mode, newest, leftover", [
    ("kill_new", "first", ".b.tmp"),
    ("kill_resave", "first", ".a.tmp"),
    ("kill_between_renames", "first", ".a.old"),
    ("async_exit", "second", None),
])
def test_killed_save_leaves_the_previous_checkpoint(tmp_path, mode, newest, leftover):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.format(tests=str(TESTS)))
    path = tmp_path / "ckpt"
    done = _run(script, path, mode)
    if mode == "async_exit":
        assert done.returncode == 0 and "RETURNED" in done.stdout, done.stderr
    else:
        assert done.returncode == -9, (done.returncode, done.stderr)
    if leftover:
        assert leftover in os.listdir(path), os.listdir(path)
    loaded = _run(script, path, "load")
    assert loaded.returncode == 0, loaded.stderr
    assert f"LOADED {newest}" in loaded.stdout, loaded.stdout
