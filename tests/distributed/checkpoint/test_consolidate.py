"""A plain HF model out of a tp=2 checkpoint: ``consolidate`` (several output shards) and the
``nxd-hf consolidate`` command write what transformers' auto class loads with logits identical
to the unparallelized model, for llama (GQA, K/V replicated, heads padded), qwen2 (tied
embeddings, vocab 101 not divisible by tp), gpt2 (Conv1D, biases, fused c_attn), bert
(encoder, tied MLM decoder) and gpt_neox (transformers renames ``embed_out`` to ``lm_head`` on
load: stored under the on-disk name); ``nxd_hf.from_pretrained`` reads it back at tp=2."""

import os
import subprocess
import sys

import pytest
import torch
import transformers

from support import hf_parity
import nxd_hf
from nxd_hf import parallel_state

CASES = {"llama": transformers.AutoModelForCausalLM, "qwen2": transformers.AutoModelForCausalLM,
         "gpt2": transformers.AutoModelForCausalLM, "bert": transformers.AutoModelForMaskedLM,
         "gpt_neox": transformers.AutoModelForCausalLM}


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def check_consolidate(root: str, model_type: str) -> None:
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair(model_type)
    nxd_hf.parallelize(model, tensor_parallel_size=2)
    path, out = os.path.join(root, model_type, "ckpt"), os.path.join(root, model_type, "hf")
    nxd_hf.save_checkpoint(path, tag="final", model=model)
    ids, _ = hf_parity.batch()
    if torch.distributed.get_rank() == 0:
        nxd_hf.consolidate(path, out, max_shard_size="40KB")
        shards = [f for f in os.listdir(out) if f.startswith("model-")]
        assert len(shards) > 1, shards
        if model_type == "gpt_neox":
            with open(os.path.join(out, "model.safetensors.index.json")) as f:
                assert "embed_out.weight" in f.read()
        loaded = CASES[model_type].from_pretrained(out)
        torch.testing.assert_close(_logits(loaded, ids), _logits(reference, ids), rtol=0, atol=0)
    torch.distributed.barrier()
    again = nxd_hf.from_pretrained(out, auto_class=CASES[model_type], tensor_parallel_size=2, gather_logits=True)
    torch.testing.assert_close(_logits(again, ids), _logits(reference, ids), **hf_parity.TOL)


@pytest.mark.parametrize("model_type", [m for m in CASES if m != "gpt2"])  # gpt2: the command's test below
def test_consolidated_tp2_checkpoint_loads_in_transformers(ranks2, tmp_path, model_type):
    ranks2.run(check_consolidate, str(tmp_path), model_type)


def test_consolidate_command_casts_dtype_and_rejects_a_plain_directory(ranks2, tmp_path, capsys):
    ranks2.run(check_consolidate, str(tmp_path), "gpt2")
    # the console command on one of them, with a dtype cast
    out = tmp_path / "gpt2_cli"
    done = subprocess.run([sys.executable, "-m", "nxd_hf.cli", "consolidate", str(tmp_path / "gpt2" / "ckpt"),
                           str(out), "--dtype", "bfloat16"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2" / "hf")
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor.to(torch.bfloat16), rtol=0, atol=0)
    from nxd_hf.cli import main  # the command's exit code and message, without a second interpreter

    capsys.readouterr()
    assert main(["consolidate", str(tmp_path), str(out)]) == 2
    assert "not an nxd_hf checkpoint directory" in capsys.readouterr().err


def test_parse_size():
    from nxd_hf.checkpoint.consolidate import parse_size

    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 * 2**20 and parse_size(123) == 123
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("lots")


def check_async_save_then_consolidate(root: str) -> None:
    """consolidate right after save_checkpoint(async_save=True), on every rank (rank 1 sees rank 0
    finish the save on disk only), and of one checkpoint's own directory; a directory mid-save
    is named as such; the checkpoint says in its README how to open it."""
    from nxd_hf.checkpoint import writer

    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair("llama")
    nxd_hf.parallelize(model, tensor_parallel_size=2)
    path, rank = os.path.join(root, "ckpt"), torch.distributed.get_rank()
    write_share = writer.write_share

    def slow_write_share(*args):  # the save is surely still being written when consolidate starts
        import time

        time.sleep(1.0)
        write_share(*args)

    writer.write_share = slow_write_share
    try:
        nxd_hf.save_checkpoint(path, tag="checkpoint-18", model=model, async_save=True)
        nxd_hf.consolidate(path, os.path.join(root, f"hf_{rank}"))
    finally:
        writer.write_share = write_share
    nxd_hf.consolidate(os.path.join(path, "checkpoint-18"), os.path.join(root, f"hf_tag_{rank}"))
    ids, _ = hf_parity.batch()
    for out in (f"hf_{rank}", f"hf_tag_{rank}"):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(root, out))
        torch.testing.assert_close(_logits(loaded, ids), _logits(reference, ids), rtol=0, atol=0)
    with open(os.path.join(path, "checkpoint-18", "README.md")) as f:
        assert f"nxd-hf consolidate {os.path.join(path, 'checkpoint-18')} hf_model" in f.read()
    torch.distributed.barrier()
    mid_save = os.path.join(root, f"mid_save_{rank}")
    os.makedirs(os.path.join(mid_save, ".step5.tmp"))  # what a save in progress (or killed) leaves
    for tag in (None, "step5"):
        with pytest.raises(ValueError, match=r"a save into .*\.step5\.tmp is in progress or was interrupted"):
            nxd_hf.consolidate(mid_save, os.path.join(root, "never"), tag=tag)


def test_consolidate_waits_for_an_async_save_and_takes_a_checkpoint_directory(ranks2, tmp_path):
    ranks2.run(check_async_save_then_consolidate, str(tmp_path))
