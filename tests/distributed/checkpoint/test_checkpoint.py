"""save_checkpoint / load_checkpoint: round trips into a freshly built model and optimizer (built
before loading, as NxD users do) at (tp, pp, dp) = (2,1,1), (1,2,1), (1,1,2)+ZeRO-1 on 2 ranks
and (2,2,1), (2,1,2)+ZeRO-1 on 4; resharding (2,1,1) -> (1,1,1); every bad input a ValueError
raised on every rank; num_kept_ckpts, re-saving a tag, async_save; phi3 at tp=4 (fused QKV,
padded query heads, replicated K/V) saved, consolidated and reloaded exactly. A round trip compares the
whole model and optimizer state (gathered: identical tensors, bit for bit) and two further
training steps (identical losses) with the model that was saved."""

import json
import os
import shutil

import pytest
import torch

import nxd_hf
from nxd_hf.testing import run_distributed
from support import hf_parity
from support.ckpt import assert_snapshots_equal, batch, build, snapshot, train


def eval_loss(model) -> torch.Tensor:
    ids, labels = batch(1000)
    model.eval()
    return model.run_eval(input_ids=ids, labels=labels)


def check_round_trip(path, tp=1, pp=1, zero1=False, *, reload_tp=None, reload_pp=None, reload_zero1=None, **options):
    model, optimizer, scheduler, _ = build(tp=tp, pp=pp, zero1=zero1, **options)
    train(model, optimizer, scheduler, 2)
    saved = snapshot(model, optimizer)
    nxd_hf.save_checkpoint(path, tag="step2", model=model, optimizer=optimizer, scheduler=scheduler,
                           user_content={"step": 2, "sampler": [1, 2]})
    expected = train(model, optimizer, scheduler, 2, start=2)
    model, optimizer, scheduler, _ = build(tp=reload_tp or tp, pp=reload_pp or pp,
                                             zero1=zero1 if reload_zero1 is None else reload_zero1, seed=7, **options)
    assert nxd_hf.load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler) == {
        "step": 2, "sampler": [1, 2]}
    loaded = snapshot(model, optimizer)
    if loaded is not None:
        assert_snapshots_equal(saved, loaded)
    got = train(model, optimizer, scheduler, 2, start=2)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), **hf_parity.TOL)
    return saved, expected


def check_master_weights_in_ckpt(path):
    """bf16 training with use_master_weights_in_ckpt: the model tensors on disk are the fp32
    masters, and a bf16 run resumes from them (masters restored bit for bit)."""
    saved, _ = check_round_trip(path, tp=2, dtype=torch.bfloat16, master_in_ckpt=True)
    with open(os.path.join(path, "step2", "index.json")) as f:
        index = json.load(f)
    assert {e["dtype"] for e in index["tensors"]["model"].values()} == {"float32"}
    masters = {n.split("::")[0]: t for n, t in (saved or {}).get("optim", {}).items() if n.endswith("::master")}
    assert saved is None or len(masters) == len(saved["params"])
    model, _, _, _ = build(tp=2, dtype=torch.bfloat16)
    nxd_hf.load_checkpoint(path, model=model)  # model only: rounded from the fp32 masters
    full = nxd_hf.full_state_dict(model)
    for name, master in masters.items():
        assert torch.equal(full[name], master.to(torch.bfloat16)), name


def _raises_everywhere(message, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=message):
        fn(*args, **kwargs)


def check_bad_inputs(root):
    """Each problem is the same ValueError on every rank, naming what is wrong."""
    model, optimizer, scheduler, _ = build(tp=2)
    train(model, optimizer, scheduler, 1)
    path = os.path.join(root, "bad")
    nxd_hf.save_checkpoint(path, tag="good", model=model, optimizer=optimizer)
    load = nxd_hf.load_checkpoint
    rank = torch.distributed.get_rank()
    _raises_everywhere("no checkpoint with tag 'nope'", load, path, tag="nope", model=model)
    _raises_everywhere("does not exist", load, os.path.join(root, "missing"), model=model)
    os.makedirs(os.path.join(root, "plain"), exist_ok=True)
    _raises_everywhere("not an nxd_hf checkpoint directory", load, os.path.join(root, "plain"), model=model)
    # another vocabulary / architecture
    other_vocab = nxd_hf.parallelize(hf_parity.build_pair("llama", vocab_size=103, num_hidden_layers=4,
                                                            attention_bias=False)[1], tensor_parallel_size=2)
    _raises_everywhere("vocab_size is 101, this model's is 103", load, path, model=other_vocab)
    qwen = nxd_hf.parallelize(hf_parity.build_pair("qwen2")[1], tensor_parallel_size=2)
    _raises_everywhere("holds a 'llama' model, this model is 'qwen2'", load, path, model=qwen)
    # strict: a 2-layer model misses nothing but layers 2-3 are unexpected; strict=False loads
    short = nxd_hf.parallelize(hf_parity.build_pair("llama", num_hidden_layers=2, attention_bias=False)[1],
                               tensor_parallel_size=2)
    _raises_everywhere("unexpected key: model.layers.2", load, path, model=short)
    load(path, tag="good", model=short, strict=False)
    deep = nxd_hf.parallelize(hf_parity.build_pair("llama", num_hidden_layers=5, attention_bias=False)[1],
                              tensor_parallel_size=2)
    _raises_everywhere("missing key: model.layers.4", load, path, model=deep)
    # corrupted, truncated, missing files and an unfinished checkpoint (copies of the good one)
    damaged = {"flipped": "model/rank_00001.safetensors", "truncated": "optim/rank_00000.safetensors",
               "lost": "model/rank_00000.safetensors", "unfinished": "done"}
    if rank == 0:
        for tag, rel in damaged.items():
            shutil.copytree(os.path.join(path, "good"), os.path.join(path, tag))
            target = os.path.join(path, tag, rel)
            if tag == "flipped":
                with open(target, "r+b") as f:
                    f.seek(os.path.getsize(target) - 3)
                    byte = f.read(1)
                    f.seek(-1, 1)
                    f.write(bytes([byte[0] ^ 0x10]))
            elif tag == "truncated":
                os.truncate(target, os.path.getsize(target) - 100)
            else:
                os.remove(target)
    torch.distributed.barrier()
    _raises_everywhere(r"flipped/model/rank_00001.safetensors tensor \S+ does not match its checksum", load, path,
                       tag="flipped", model=model)
    _raises_everywhere(r"truncated/optim/rank_00000.safetensors has \d+ bytes", load, path, tag="truncated",
                       model=model, optimizer=optimizer)
    _raises_everywhere(r"lost/model/rank_00000.safetensors is missing", load, path, tag="lost", model=model)
    _raises_everywhere("is incomplete", load, path, tag="unfinished", model=model)
    _raises_everywhere("plain directory name", nxd_hf.save_checkpoint, path, tag="../x", model=model)


def check_tags(root):
    """num_kept_ckpts keeps the newest complete ones; re-saving a tag replaces it; tag=None is
    the newest; async_save finishes in the background; tag "" is stored as 'default'."""
    model, optimizer, scheduler, _ = build(tp=2)
    path = os.path.join(root, "tags")
    for i, tag in enumerate(["a", "b", "c"]):
        nxd_hf.save_checkpoint(path, tag=tag, model=model, user_content=i, num_kept_ckpts=2)
    assert sorted(os.listdir(path)) == ["b", "c", "checkpoints.json", "owner.json"]
    assert nxd_hf.load_checkpoint(path, model=model) == 2
    nxd_hf.save_checkpoint(path, tag="b", model=model, user_content="b again", num_kept_ckpts=2)
    with open(os.path.join(path, "checkpoints.json")) as f:
        assert {k: v for k, v in json.load(f).items() if k != "crc32"} == {"newest": "b", "complete": ["c", "b"]}
    assert nxd_hf.load_checkpoint(path, model=model) == "b again"
    with pytest.warns(UserWarning, match="use_xser is ignored"):
        nxd_hf.save_checkpoint(path, model=model, optimizer=optimizer, user_content="async", async_save=True,
                               use_xser=True)
    nxd_hf.wait_for_checkpoint()
    torch.distributed.barrier()
    assert os.path.exists(os.path.join(path, "default", "done"))
    assert nxd_hf.load_checkpoint(path, model=model, optimizer=optimizer) == "async"


def check_save_pretrained_pp(root):
    """save_pretrained of an NxDPPModel (pp=2, tied embeddings across stages) and of the config
    API's model writes the plain HF format."""
    import transformers

    reference, model = hf_parity.build_pair("qwen2")
    nxd_hf.parallel_state.destroy_model_parallel()
    pipelined = nxd_hf.parallelize(model, pipeline_parallel_size=2, num_microbatches=2)
    pipelined.save_pretrained(os.path.join(root, "pp_pretrained"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(root, "pp_pretrained"))
    ids, _ = hf_parity.batch()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=0)
    cfg_model, _, _, _ = build(tp=2)
    cfg_model.save_pretrained(os.path.join(root, "cfg_pretrained"))
    full = nxd_hf.full_state_dict(cfg_model)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(root, "cfg_pretrained"))
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, full[name], rtol=0, atol=0)


def round_trip(path, **kwargs) -> None:
    """check_round_trip, as a case run on the pool (its expected tensors stay on the ranks)."""
    check_round_trip(path, **kwargs)


ROUND_TRIPS_WORLD2 = {
    "tp2": dict(tp=2), "pp2": dict(pp=2), "dp2_zero1": dict(zero1=True),
    "dp2_zero1_to_plain_optimizer": dict(zero1=True, reload_zero1=False),
    "tp2_to_pp2": dict(tp=2, reload_tp=1, reload_pp=2),
}
ROUND_TRIPS_WORLD4 = {
    "tp2_pp2": dict(tp=2, pp=2), "tp2_dp2_zero1": dict(tp=2, zero1=True),
    "tp2_dp2_zero1_to_dp4": dict(tp=2, zero1=True, reload_tp=1),
}


@pytest.mark.parametrize("layout", list(ROUND_TRIPS_WORLD2))
def test_round_trip_world2(ranks2, tmp_path, layout):
    ranks2.run(round_trip, str(tmp_path / layout), **ROUND_TRIPS_WORLD2[layout])


def test_bf16_master_weights_in_checkpoint(ranks2, tmp_path):
    ranks2.run(check_master_weights_in_ckpt, str(tmp_path / "bf16_masters"))


def test_bad_inputs_raise_on_every_rank(ranks2, tmp_path):
    ranks2.run(check_bad_inputs, str(tmp_path))


def test_num_kept_ckpts_resave_and_async_save(ranks2, tmp_path):
    ranks2.run(check_tags, str(tmp_path))


def test_save_pretrained_from_pipeline_and_config_api_models(ranks2, tmp_path):
    ranks2.run(check_save_pretrained_pp, str(tmp_path))


def save_tp2_for_world1(root):
    expected = check_round_trip(os.path.join(root, "tp2_for_world1"), tp=2)
    if torch.distributed.get_rank() == 0:  # tensors do not travel through the result queue
        torch.save(expected, os.path.join(root, "expected.pt"))


def test_tp2_checkpoint_loads_on_one_process(ranks2, tmp_path):
    ranks2.run(save_tp2_for_world1, str(tmp_path))
    run_distributed(run_world1, 1, str(tmp_path))


def run_world1(root):
    """(2,1,1) -> (1,1,1): the checkpoint saved on 2 ranks loads on one."""
    expected = torch.load(os.path.join(root, "expected.pt"))
    model, optimizer, scheduler, _ = build(seed=9)
    nxd_hf.load_checkpoint(os.path.join(root, "tp2_for_world1"), model=model, optimizer=optimizer,
                           scheduler=scheduler)
    assert_snapshots_equal(expected[0], snapshot(model, optimizer))
    got = train(model, optimizer, scheduler, 2, start=2)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected[1]), **hf_parity.TOL)


def check_fused_qkv_padded_replicated(root):
    """phi3 at tp=4: fused qkv_proj (strided), 6 query heads padded to 8, 2 K/V heads copied
    twice. The checkpoint holds each logical row once; consolidated it is the original model,
    and it loads back into another tp=4 model."""
    import transformers

    reference, model = hf_parity.build_pair("phi3")
    nxd_hf.parallel_state.destroy_model_parallel()
    nxd_hf.parallelize(model, tensor_parallel_size=4)
    path = os.path.join(root, "phi3")
    nxd_hf.save_checkpoint(path, model=model)
    if torch.distributed.get_rank() == 0:
        nxd_hf.consolidate(path, os.path.join(root, "phi3_hf"))
        loaded = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(root, "phi3_hf"))
        expected = reference.state_dict()
        assert set(loaded.state_dict()) == set(expected)
        for name, tensor in loaded.state_dict().items():
            torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    other = nxd_hf.parallelize(hf_parity.build_pair("phi3", seed=3)[1], tensor_parallel_size=4)
    nxd_hf.load_checkpoint(path, model=other)
    full, expected = nxd_hf.full_state_dict(other), reference.state_dict()
    for name, tensor in full.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_phi3_tp4_fused_qkv_padded_replicated_saves_consolidates_and_reloads_exactly(ranks4, tmp_path):
    ranks4.run(check_fused_qkv_padded_replicated, str(tmp_path))


@pytest.mark.parametrize("layout", list(ROUND_TRIPS_WORLD4))
def test_round_trip_world4(ranks4, tmp_path, layout):
    ranks4.run(round_trip, str(tmp_path / layout), **ROUND_TRIPS_WORLD4[layout])
