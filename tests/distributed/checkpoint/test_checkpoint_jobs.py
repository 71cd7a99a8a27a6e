"""Two jobs writing one checkpoint directory (two launches with the same output_dir): the second
job's first save is refused on every rank; a save whose temporary directory received another
job's files (rank 1 of the other job writing after this job's rank 1) is refused instead of
leaving a tag that loads without an error holding neither job's weights; resuming a job's
directory takes it over; a finished job's directory is free. Simulated in one 2-rank pool: each
"job" is a ``job_id``."""

import json
import os
import shutil

import torch

from support import ckpt
import nxd_hf
from nxd_hf import backend
from nxd_hf.checkpoint import owner, store, writer


def _shifted(model, by: float) -> None:
    with torch.no_grad():
        for param in model.parameters():
            param.add_(by)


def interleaved_saves(root: str) -> dict:
    """Job b saves tag "t" (its weights shifted by 1); then job a saves "t" into another directory
    while job b's rank 1 writes its share there after job a's rank 1 (files and record), as two
    launches racing on one directory do. The tag must not load."""
    model, out = ckpt.tp2_llama(), {}
    scratch, path = os.path.join(root, "job_b"), os.path.join(root, "shared")
    _shifted(model, 1.0)
    nxd_hf.save_checkpoint(scratch, tag="t", model=model, user_content="b")
    _shifted(model, -1.0)
    real = writer.write_share

    def and_job_b_after(tmp, rank, *args, **kwargs):
        real(tmp, rank, *args, **kwargs)
        for rel in ("model/rank_00001.safetensors", "rng/rank_00001.pt", "records/rank_00001.json"):
            shutil.copyfile(os.path.join(scratch, "t", rel), os.path.join(tmp, rel))

    if backend.rank() == 1:
        writer.write_share = and_job_b_after
    try:
        out["save"] = ckpt.value_error_text(lambda: nxd_hf.save_checkpoint(path, tag="t", model=model, user_content="a"))
    finally:
        writer.write_share = real
    out["load"] = ckpt.value_error_text(lambda: nxd_hf.load_checkpoint(path, tag="t", model=model))
    # both jobs' rank 0 finishing one temporary directory: job b's index under job a's marker
    nxd_hf.save_checkpoint(path, tag="u", model=model)
    if backend.rank() == 0:
        shutil.copyfile(os.path.join(scratch, "t", "index.json"), os.path.join(path, "u", "index.json"))
        with open(os.path.join(path, "u", "done")) as f:
            lines = f.read().splitlines()
        lines[1] = json.dumps(store._index_checksum(os.path.join(path, "u")))  # as job a's finalize computes it
        with open(os.path.join(path, "u", "done"), "w") as f:
            f.write("\n".join(lines) + "\n")
    backend.barrier()
    out["marker"] = ckpt.value_error_text(lambda: nxd_hf.load_checkpoint(path, tag="u", model=model))
    return out


def owners(root: str) -> dict:
    model, out = ckpt.tp2_llama(), {}
    path = os.path.join(root, "out")
    nxd_hf.save_checkpoint(path, tag="s1", model=model, job_id="job-a")
    out["second_job"] = ckpt.value_error_text(lambda: nxd_hf.save_checkpoint(path, tag="s2", model=model, job_id="job-b"))
    out["second_job_left"] = sorted(os.listdir(path))
    nxd_hf.save_checkpoint(path, tag="s2", model=model, job_id="job-a")  # the owner goes on
    # job c (job a was killed) resumes from the directory: it takes it over
    nxd_hf.load_checkpoint(path, model=model)
    nxd_hf.save_checkpoint(path, tag="s3", model=model, job_id="job-c", user_content="c")
    out["job_a_after_takeover"] = ckpt.value_error_text(lambda: nxd_hf.save_checkpoint(path, tag="s4", model=model, job_id="job-a"))
    if backend.rank() == 0:
        owner.release()  # job c ends
    backend.barrier()
    nxd_hf.save_checkpoint(path, tag="s4", model=model, job_id="job-d", user_content="d")  # a fresh job: free
    out["after_finished"] = nxd_hf.load_checkpoint(path, model=model)
    return out


def test_interleaved_saves_of_two_jobs_never_load(ranks2, tmp_path):
    results = ranks2.run(interleaved_saves, str(tmp_path))
    for r in results:
        assert "holds files of another save" in r["save"] and "two jobs are saving" in r["save"], r["save"]
        assert "cannot load checkpoint" in r["load"] and "no checkpoint with tag 't'" in r["load"], r["load"]
        assert "u/done was written by save" in r["marker"] and "two jobs wrote into" in r["marker"], r["marker"]


def test_second_job_refused_resume_and_finished_job_free(ranks2, tmp_path):
    results = ranks2.run(owners, str(tmp_path))
    for r in results:
        assert results[0] == r
        assert "two jobs share the checkpoint directory" in r["second_job"], r["second_job"]
        assert "in use by job 'job-a'" in r["second_job"] and "job-b" in r["second_job"], r["second_job"]
        assert r["second_job_left"] == ["checkpoints.json", "owner.json", "s1"]
        assert "in use by job 'job-c'" in r["job_a_after_takeover"], r["job_a_after_takeover"]
        assert r["after_finished"] == "d"
