"""``nxd_hf.plan``'s parameters per rank equal, byte for byte, what ``nxd_hf.parallelize`` leaves
on each rank of a real parallel model: padded heads and vocab, replicated K/V heads, tied
embeddings held by two pipeline stages, fused projections, per-head norms, LoRA adapters."""

import pytest

import plan_cases
from nxd_hf.plan.memory import stage_layers
from nxd_hf.plan.shapes import meta_model, rank_params


def predicted_bytes(model_type: str, tp: int, pp: int, pp_rank: int, lora: bool) -> tuple[int, int]:
    config = plan_cases.tiny_config(model_type)
    counts = rank_params(config, meta_model(config), tp=tp, lora_config=plan_cases.lora_config() if lora else None)
    layers = stage_layers(config.num_hidden_layers, pp)[pp_rank]
    first, last = pp_rank == 0, pp_rank == pp - 1
    base = counts.stage(layers, first=first, last=last) * 4
    adapters = counts.stage(layers, first=first, last=last, lora=True) * 4
    return base + adapters, adapters


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (4, 1), (2, 2), (1, 2)])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt2", "gpt_neox", "qwen3", "phi3"])
def test_param_bytes_per_rank_equal_the_plan(ranks4, model_type, tp, pp):
    for rank in ranks4.run(plan_cases.local_param_bytes, model_type, model_parallel=(tp, pp)):
        expected, _ = predicted_bytes(model_type, tp, pp, rank["pp_rank"], lora=False)
        assert rank["param_bytes"] == expected, (model_type, tp, pp, rank)


@pytest.mark.parametrize("tp,pp", [(2, 1), (4, 1), (2, 2)])
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_lora_param_bytes_per_rank_equal_the_plan(ranks4, model_type, tp, pp):
    for rank in ranks4.run(plan_cases.local_param_bytes, model_type, lora=True, model_parallel=(tp, pp)):
        expected, adapters = predicted_bytes(model_type, tp, pp, rank["pp_rank"], lora=True)
        assert (rank["param_bytes"], rank["lora_bytes"]) == (expected, adapters), (model_type, tp, pp, rank)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_recompute_comm_bytes_equal_the_plan(ranks2, sequence_parallel):
    """Activation checkpointing re-runs each layer's forward collectives up to its last saved tensor
    (torch's non-reentrant checkpoint stops early): the plan counts them as measured."""
    for result in ranks2.run(plan_cases.recompute_comm_bytes, sequence_parallel):
        assert result["measured"] == result["predicted"], result


@pytest.mark.parametrize("model_type,sequence_parallel,overrides", [
    ("gpt2", False, dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)),  # Conv1D, dropout masks, math SDPA
    ("phi3", True, {}),  # fused qkv/gate_up, each column layer's own gathered input
    ("llama", True, {}),  # GQA, biases
])
def test_saved_activation_bytes_per_layer_equal_the_plan(ranks2, model_type, sequence_parallel, overrides):
    """The plan's trace (one unsharded meta-device forward) priced at tp=2 equals, byte for byte,
    what autograd saves in each decoder layer of a real tp=2 rank."""
    for result in ranks2.run(plan_cases.saved_activation_bytes, model_type, sequence_parallel, overrides):
        assert result["measured"] == result["predicted"], result


def test_parallelize_takes_auto_sizes(ranks2):
    sizes = ranks2.run(plan_cases.parallelize_with_auto_sizes)
    assert sizes[0] == sizes[1] and 2 % (sizes[0]["tp"] * sizes[0]["pp"]) == 0, sizes


def test_trainer_resolves_auto_tensor_parallel_size(ranks2, tmp_path):
    results = ranks2.run(plan_cases.train_with_auto_sizes, str(tmp_path))
    assert all(r["tp"] == r["groups_tp"] for r in results)  # the chosen size is the one the model runs at
    assert results[0]["tp"] in (1, 2) and len({r["tp"] for r in results}) == 1
