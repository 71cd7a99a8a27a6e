"""Damaged checkpoints and failed saves: every damaged file (index.json, checkpoints.json,
state.pt, a rank's RNG file, config.json, trainer_state.json and other metadata) is found by its
checksum and named, with what to do, in the same ValueError on every rank; an unreadable
checkpoints.json falls back to the newest complete tag with a warning; user_content that
``torch.load(weights_only=True)`` cannot read is refused at save time; a disk that fills up mid-save
(OSError ENOSPC injected into one rank's real write) fails every rank with that error and leaves no
leftovers, and the next save removes those of a killed save. All cases on one spawn of 2 ranks."""

import errno
import json
import os
import shutil
import warnings

import pytest
import torch

from support import ckpt, hf_parity
import nxd_hf
from nxd_hf import backend, parallel_state
from nxd_hf.checkpoint import writer
from nxd_hf.testing import run_distributed


def _side_files(directory):
    with open(os.path.join(directory, "trainer_state.json"), "w") as f:
        json.dump({"global_step": 2}, f)


def _fresh_copy(root, name):
    """A copy of the pristine checkpoint directory ``root/base`` to damage (rank 0 copies)."""
    path = os.path.join(root, name)
    if backend.rank() == 0:
        shutil.copytree(os.path.join(root, "base"), path)
    backend.barrier()
    return path


def _damage(path, rel, how):
    if backend.rank() == 0:
        file = os.path.join(path, rel)
        if how == "delete":
            os.remove(file)
        elif how == "truncate":
            with open(file, "rb") as f:
                data = f.read()
            with open(file, "wb") as f:
                f.write(data[: len(data) // 2])
        else:
            old, new = how
            with open(file) as f:
                text = f.read()
            assert old in text, (old, file)
            with open(file, "w") as f:
                f.write(text.replace(old, new, 1))
    backend.barrier()


def damaged_cases(root):
    model = ckpt.tp2_llama()
    out = {}
    base = os.path.join(root, "base")
    nxd_hf.save_checkpoint(base, tag="older", model=model, user_content={"step": 1})
    nxd_hf.save_checkpoint(base, tag="newer", model=model, user_content={"step": 2}, side_files=_side_files)
    cases = {
        "index": ("newer/index.json", ('"dtype"', '"dtypf"')),
        "state": ("newer/state.pt", "delete"),
        "rng1": ("newer/rng/rank_00001.pt", "delete"),
        "config": ("newer/config.json", ('"rope_theta": 10000', '"rope_theta": 10001')),
        "trainer_state": ("newer/trainer_state.json", ('"global_step": 2', '"global_step": 3')),
    }
    for name, (rel, how) in cases.items():
        path = _fresh_copy(root, name)
        _damage(path, rel, how)
        out[name] = ckpt.value_error_text(lambda: nxd_hf.load_checkpoint(path, model=model))
    for name, how in {"tracker_half": "truncate", "tracker_flip": ('"newest": "newer"', '"newest": "older"')}.items():
        path = _fresh_copy(root, name)
        _damage(path, "checkpoints.json", how)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out[name] = nxd_hf.load_checkpoint(path, model=model)
        out[name + "_warning"] = " ".join(str(w.message) for w in caught)
    path = os.path.join(root, "unloadable")
    out["user_content"] = ckpt.value_error_text(lambda: nxd_hf.save_checkpoint(
        path, tag="x", model=model, user_content={"ok": 1, "sampler": torch.Generator()}))
    out["user_content_left"] = os.path.exists(os.path.join(path, "x"))
    out.update(_disk_full(root, model))
    return out


def _disk_full(root, model):
    """ENOSPC in the middle of rank 1's real write of its share (half a file written first)."""
    path, out = os.path.join(root, "full"), {}
    nxd_hf.save_checkpoint(path, tag="step1", model=model, user_content={"step": 1})
    real = writer.write_file

    def write_half_then_fail(file, tensors, **kwargs):
        os.makedirs(os.path.dirname(file), exist_ok=True)
        with open(file, "wb") as f:
            f.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), file)

    if backend.rank() == 1:
        writer.write_file = write_half_then_fail
    try:
        out["full_error"] = ckpt.value_error_text(lambda: nxd_hf.save_checkpoint(path, tag="step2", model=model))
    finally:
        writer.write_file = real
    backend.barrier()
    out["full_leftovers"] = sorted(n for n in os.listdir(path) if n.startswith("."))
    out["full_previous"] = nxd_hf.load_checkpoint(path, model=model)
    if backend.rank() == 0:  # what a save killed mid-write leaves behind
        os.makedirs(os.path.join(path, ".step5.tmp", "model"))
        with open(os.path.join(path, ".step5.tmp", "model", "rank_00000.safetensors"), "wb") as f:
            f.write(b"partial")
        with open(os.path.join(path, "checkpoints.json.tmp.12345"), "w") as f:
            f.write('{"newest"')
    backend.barrier()
    nxd_hf.save_checkpoint(path, tag="step3", model=model, user_content={"step": 3})
    out["after_next_save"] = sorted(n for n in os.listdir(path) if n.startswith(".") or ".tmp" in n)
    out["after_next_load"] = nxd_hf.load_checkpoint(path, model=model)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(damaged_cases, 2, str(tmp_path_factory.mktemp("damaged")))


@pytest.mark.parametrize("case, file", [
    ("index", "newer/index.json"), ("state", "newer/state.pt"), ("rng1", "newer/rng/rank_00001.pt"),
    ("config", "newer/config.json"), ("trainer_state", "newer/trainer_state.json"),
])
def test_damaged_file_named_with_what_to_do_on_every_rank(results, case, file):
    messages = [r[case] for r in results]
    assert messages[0] == messages[1], messages
    assert file in messages[0], messages[0]
    assert "tag='older'" in messages[0] and "--tag older" in messages[0], messages[0]


@pytest.mark.parametrize("case", ["tracker_half", "tracker_flip"])
def test_damaged_tracker_falls_back_to_newest_complete_tag(results, case):
    for r in results:
        assert r[case] == {"step": 2}
        assert "checkpoints.json" in r[case + "_warning"] and "newer" in r[case + "_warning"], r[case + "_warning"]


def test_unloadable_user_content_refused_at_save_time(results):
    for r in results:
        assert "user_content['sampler'] is a torch._C.Generator" in r["user_content"], r["user_content"]
        assert r["user_content_left"] is False


def test_disk_full_mid_save_fails_every_rank_and_leaves_nothing(results):
    for r in results:
        assert "failed on rank 1" in r["full_error"] and "No space left on device" in r["full_error"], r["full_error"]
        assert r["full_leftovers"] == []
        assert r["full_previous"] == {"step": 1}
        assert r["after_next_save"] == []
        assert r["after_next_load"] == {"step": 3}


def test_consolidate_names_damaged_config(tmp_path):
    """``nxd-hf consolidate`` copies config.json into the plain model: a changed byte is refused;
    a half-written checkpoints.json falls back to the newest tag."""
    _, model = hf_parity.build_pair("llama")
    nxd_hf.parallelize(model)
    try:
        nxd_hf.save_checkpoint(str(tmp_path), tag="a", model=model)
        nxd_hf.save_checkpoint(str(tmp_path), tag="b", model=model)
    finally:  # this process runs other in-process tests after it: leave no groups behind
        parallel_state.destroy_model_parallel()
    with open(tmp_path / "checkpoints.json", "w") as f:
        f.write('{"newest": "b", "comp')
    with pytest.warns(UserWarning, match="checkpoints.json"):
        nxd_hf.consolidate(str(tmp_path), str(tmp_path / "out"))
    assert os.path.exists(tmp_path / "out" / "config.json")
    config = tmp_path / "b" / "config.json"
    config.write_text(config.read_text().replace('"rope_theta": 10000', '"rope_theta": 10001'))
    with pytest.raises(ValueError, match=r"b/config.json does not match its checksum.*--tag a"):
        nxd_hf.consolidate(str(tmp_path), str(tmp_path / "out2"), tag="b")
