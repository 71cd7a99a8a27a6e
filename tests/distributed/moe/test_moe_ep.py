"""Expert parallelism: experts split over the expert-parallel group carved
from data parallelism, tokens dispatched by all-to-all, exact against the unparallelized HF
model."""

import pytest
import torch
import transformers

from nxd_hf import backend, parity
from support import moe
from support.moe_ep import (
    batch, build_pair, check_checkpoint_reshard, check_trainer_matches, config, expert_params, global_batch,
    rank_batch, TOL, VOCAB,
)


STEPS = 3


def check_ep_training(model_type: str, ep: int, steps: int = STEPS, starve: bool = False) -> None:
    """Losses, gathered gradients and parameters after ``steps`` SGD steps at ``ep`` (DP = world)
    equal the single-process HF model on the concatenated batches. ``starve``: every token goes to
    the first rank's experts (the others get no rows, and still join every exchange)."""
    import nxd_hf
    from nxd_hf import parallel_state
    from nxd_hf.parity import gathered_grad

    parallel_state.destroy_model_parallel()
    reference, model = build_pair(model_type)
    if starve:
        for m in (reference, model):
            moe.route_to_first_experts(m, config(model_type).num_local_experts // ep)
    nxd_hf.parallelize(model, expert_parallel_size=ep)
    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    assert parallel_state.get_expert_parallel_size() == ep and len(expert_params(model)) > 0
    for name, param in expert_params(model).items():
        assert param.shape[0] == dict(reference.named_parameters())[name].shape[0] // ep, name
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_params = dict(reference.named_parameters())
    for step in range(steps):
        ids, labels = global_batch(step, dp)
        ref_loss = reference(input_ids=ids, labels=labels).loss
        ref_loss.backward()
        ids, labels = rank_batch(step, dp_rank)
        with backend.count_comm() as records:
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
        tags = {r.tag for r in records if r.op == "all_to_all"}
        assert {"ep_dispatch", "ep_combine", "ep_dispatch.backward", "ep_combine.backward"} <= tags, tags
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean, group=parallel_state.get_data_parallel_group())
        torch.testing.assert_close(mean / dp, ref_loss.detach(), **TOL)
        for name, param in model.named_parameters():
            torch.testing.assert_close(gathered_grad(param), ref_params[name].grad, **TOL,
                                       msg=lambda m: f"step {step} grad {name}: {m}")
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    from nxd_hf.parallel_layers.sharding import full_tensor

    for name, param in model.named_parameters():
        torch.testing.assert_close(full_tensor(param), ref_params[name].detach(), **TOL, msg=lambda m: f"{name}: {m}")


def check_from_pretrained_and_save(model_type: str, path: str, ep: int) -> None:
    """transformers' own save_pretrained (per-expert names) -> nxd_hf.from_pretrained at ``ep``:
    each rank reads only its experts, logits equal; nxd's save_pretrained at ``ep`` writes the keys
    transformers writes, and plain transformers loads it with the same logits."""
    import os

    import safetensors.torch
    import transformers

    import nxd_hf
    from nxd_hf import parallel_state

    parallel_state.destroy_model_parallel()
    reference, _ = build_pair(model_type)
    reference.eval()
    source, out = os.path.join(path, "hf"), os.path.join(path, "nxd")
    if torch.distributed.get_rank() == 0:
        reference.save_pretrained(source)
    torch.distributed.barrier()
    model = nxd_hf.from_pretrained(source, expert_parallel_size=ep)
    ids, _ = batch(seed=7)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, expected, **TOL)
    local = sum(p.numel() * p.element_size() for p in model.parameters())
    whole = sum(p.numel() * p.element_size() for p in reference.parameters())
    assert model.nxd.load_report.bytes_read == local, (model.nxd.load_report.bytes_read, local)
    assert len(expert_params(model)) == 2 * model.config.num_hidden_layers and (ep == 1 or local < whole)
    fused = os.path.join(path, "fused")  # the in-memory (fused) names, as older consolidations wrote them
    if torch.distributed.get_rank() == 0:
        reference.config.save_pretrained(fused)
        safetensors.torch.save_file({k: v.contiguous() for k, v in reference.state_dict().items()},
                                    os.path.join(fused, "model.safetensors"))
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    from_fused = nxd_hf.from_pretrained(fused, expert_parallel_size=ep)
    with torch.no_grad():
        torch.testing.assert_close(from_fused(input_ids=ids).logits, expected, **TOL)
    assert from_fused.nxd.load_report.bytes_read == local, (from_fused.nxd.load_report.bytes_read, local)
    model.save_pretrained(out)
    if torch.distributed.get_rank() == 0:
        def keys(directory):
            return {k for f in os.listdir(directory) if f.endswith(".safetensors")
                    for k in safetensors.torch.load_file(os.path.join(directory, f))}
        assert keys(out) == keys(source), keys(out) ^ keys(source)
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, **TOL)
    torch.distributed.barrier()


def check_refusals() -> None:
    """What expert parallelism cannot do yet is a ValueError naming the fix, on every rank."""
    import pytest

    import nxd_hf
    from nxd_hf import parallel_state
    from nxd_hf.optim import NeuronZero1Optimizer

    world = torch.distributed.get_world_size()
    cases = [
        (dict(expert_parallel_size=2 * world), "must divide the data-parallel size"),
        (dict(expert_parallel_size=0), "expert_parallel_size must be an int"),
    ]
    for kwargs, message in cases:
        if world < 2 * kwargs.get("tensor_parallel_size", 1) * kwargs.get("pipeline_parallel_size", 1):
            continue
        parallel_state.destroy_model_parallel()
        _, model = build_pair("mixtral")
        with pytest.raises(ValueError, match=message):
            nxd_hf.parallelize(model, **kwargs)
    parallel_state.destroy_model_parallel()
    _, model = build_pair("mixtral", num_local_experts=6)
    if world == 4:
        with pytest.raises(ValueError, match="6 experts, not divisible by expert_parallel_size=4"):
            nxd_hf.parallelize(model, expert_parallel_size=4)
    parallel_state.destroy_model_parallel()
    _, model = parity.build_pair(transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                                          num_hidden_layers=1, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="has no mixture-of-experts layer"):
        nxd_hf.parallelize(model, expert_parallel_size=2)
    parallel_state.destroy_model_parallel()
    _, model = build_pair("mixtral")
    nxd_hf.parallelize(model, expert_parallel_size=2)
    with pytest.raises(ValueError, match="leave sharding_groups=None"):
        NeuronZero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3,
                             sharding_groups=parallel_state.get_expert_data_parallel_group())
    parallel_state.destroy_model_parallel()


def check_bench_moe_figures(ep: int) -> None:
    """``bench.moe``'s per-rank figures: the token all-to-alls hand exactly tokens x top-k x hidden x
    4 bytes per direction, and a rank holds its experts / ep plus the replicated parameters."""
    from bench.moe.measure import MoEConfig, measure_rank

    config = MoEConfig(layers=1, batch=2, seq=8)
    r = measure_rank(config, ep)
    minimum = r["tokens"] * config.top_k * config.layers * config.hidden * 4
    assert r["bytes_by_tag"]["ep_dispatch"] == r["bytes_by_tag"]["ep_combine.backward"] == minimum, r
    received = r["bytes_by_tag"]["ep_combine"]  # the rows this rank's experts got, sent back
    assert received == r["bytes_by_tag"]["ep_dispatch.backward"] and received % (config.hidden * 4) == 0, r
    assert r["param_bytes"] == r["expert_total_bytes"] // ep + r["replicated_bytes"], r


def check_sweep_case(model_type: str, tp: int, ep: int) -> tuple[str, str]:
    """The architecture sweep's case at ``tp`` x ``ep`` (``nxd_hf.parity.run_case``) on the sweep's tiny config."""
    from bench.architectures.run import tiny_config
    from nxd_hf.parity.cases import run_case

    case = run_case(tiny_config(model_type), tensor_parallel_size=tp, expert_parallel_size=ep)
    return case.status, case.message


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_ep2_world2_matches_hf(ranks2, model_type):
    ranks2.run(check_ep_training, model_type, 2)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_ep2_dp4_matches_hf(ranks4, model_type):
    ranks4.run(check_ep_training, model_type, 2)


@pytest.mark.parametrize("save_ep,load_ep", [(2, 1), (1, 2)], ids=["ep2_to_ep1dp2", "ep1dp2_to_ep2"])
def test_checkpoint_reshards_across_ep(ranks2, tmp_path, save_ep, load_ep):
    ranks2.run(check_checkpoint_reshard, "mixtral", str(tmp_path / "ckpt"), save_ep, load_ep)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_from_pretrained_reads_local_experts_and_save_pretrained_writes_hf(ranks2, tmp_path, model_type):
    ranks2.run(check_from_pretrained_and_save, model_type, str(tmp_path), 2)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_nxd_trainer_at_ep2_matches_trainer(ranks2, tmp_path, accumulate):
    ranks2.run(check_trainer_matches, "mixtral", str(tmp_path), 2, accumulate)


def test_refusals_world2(ranks2):
    ranks2.run(check_refusals)


def test_refusals_world4(ranks4):
    ranks4.run(check_refusals)


def test_bench_moe_figures(ranks2):
    ranks2.run(check_bench_moe_figures, 2)


@pytest.mark.parametrize("model_type", ["mixtral", "phimoe"])  # phimoe: a router that samples in training
def test_sweep_ep2_layout_passes(ranks2, model_type):
    status, message = ranks2.run(check_sweep_case, model_type, 1, 2)[0]
    assert status == "pass", message


def test_sweep_tp2_ep2_layout_passes(ranks4):
    status, message = ranks4.run(check_sweep_case, "mixtral", 2, 2)[0]
    assert status == "pass", (status, message)


def test_check_command_at_ep2(tmp_path, capsys):
    import transformers

    from nxd_hf.cli import main

    transformers.Qwen3MoeConfig(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=16,
                                num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2,
                                num_hidden_layers=4, vocab_size=500).save_pretrained(tmp_path)
    assert main(["check", str(tmp_path), "--tp", "1", "--ep", "2"]) == 0
    assert "(tp=1 pp=1 ep=2): pass" in capsys.readouterr().out


def test_checkpoint_reshards_ep2_dp4_to_ep1_dp4(ranks4, tmp_path):
    ranks4.run(check_checkpoint_reshard, "qwen3_moe", str(tmp_path / "ckpt"), 2, 1)


def test_ep2_rank_without_tokens_matches_hf(ranks2):
    ranks2.run(check_ep_training, "mixtral", 2, starve=True)
