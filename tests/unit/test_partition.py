"""Pipeline partition rules, stage splitting and schedule bubbles, without processes: cuts,
stage placement, which parameters each stage owns (and that the stages in sequence are the
model), and the idle slots of every schedule against the closed forms."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from support import hf_parity
from bench.pipeline import bubbles
from nxd_hf.pipeline.partition import auto_cuts, local_stages, stage_of_layers, stage_ranks
from nxd_hf.pipeline.runtime import SCHEDULES
from nxd_hf.pipeline.stages import split_stages, value_kinds
from nxd_hf.pipeline.trace import trace_hf

LAYERS = [f"model.layers.{i}" for i in range(10)]


def _stage_sizes(layer_names, cuts, num_stages):
    stages = stage_of_layers(layer_names, cuts, num_stages)
    return [list(stages.values()).count(s) for s in range(num_stages)]


# -- auto_cuts

@pytest.mark.parametrize("num_layers,num_stages,sizes", [
    (8, 4, [2, 2, 2, 2]), (10, 4, [2, 2, 3, 3]), (7, 2, [3, 4]), (10, 3, [3, 3, 4]), (4, 4, [1, 1, 1, 1]),
    (5, 1, [5]),
])
def test_auto_cuts_even_split_remainder_on_later_stages(num_layers, num_stages, sizes):
    names = LAYERS[:num_layers]
    cuts = auto_cuts(names, num_stages)
    assert len(cuts) == num_stages - 1
    assert _stage_sizes(names, cuts, num_stages) == sizes


def test_auto_cuts_one_layer_per_stage():
    assert auto_cuts(LAYERS[:4], 4) == LAYERS[:3]


def test_auto_cuts_more_stages_than_layers():
    with pytest.raises(ValueError, match="use at most 4 stages"):
        auto_cuts(LAYERS[:4], 5)


# -- stage_of_layers

def test_cut_ends_its_stage():
    stages = stage_of_layers(LAYERS[:6], ["model.layers.0", "model.layers.3"], 3)
    assert list(stages.values()) == [0, 1, 1, 1, 2, 2]


@pytest.mark.parametrize("cuts,num_stages,message", [
    (["model.layers.7"], 2, r"not transformer layers.*'model\.layers\.0' \.\.\. 'model\.layers\.5'"),
    (["layers.2"], 2, r"cuts must name layers such as 'model\.layers\.0'"),
    (["model.layers.1"], 3, "1 pipeline_cuts give 2 stages, but 3 are needed"),
    (["model.layers.1", "model.layers.2"], 2, "2 pipeline_cuts give 3 stages, but 2 are needed"),
    (["model.layers.3", "model.layers.1"], 3, "must be increasing"),
    (["model.layers.2", "model.layers.2"], 3, "must be increasing"),
    (["model.layers.2", "model.layers.5"], 3, "leave at least one layer for the last stage"),
    (["model.layers.5"], 2, "leave at least one layer for the last stage"),
])
def test_bad_cuts(cuts, num_stages, message):
    with pytest.raises(ValueError, match=message):
        stage_of_layers(LAYERS[:6], cuts, num_stages)


# -- placement

@pytest.mark.parametrize("pp_size", [2, 4])
def test_looped_placement(pp_size):
    num_stages = 2 * pp_size
    assert stage_ranks(num_stages, pp_size, "looped") == [s % pp_size for s in range(num_stages)]
    for rank in range(pp_size):
        assert local_stages(num_stages, pp_size, rank, "looped") == [rank, rank + pp_size]
    assert local_stages(pp_size, pp_size, 1, "looped") == [1]


@pytest.mark.parametrize("pp_size", [2, 4])
def test_v_shape_placement(pp_size):
    num_stages = 2 * pp_size
    ranks = stage_ranks(num_stages, pp_size, "v_shape")
    assert ranks == list(range(pp_size)) + list(reversed(range(pp_size)))
    for rank in range(pp_size):
        assert local_stages(num_stages, pp_size, rank, "v_shape") == [rank, 2 * pp_size - 1 - rank]
    # the first and last stages share rank 0: the loss is computed where the embedding lives
    assert ranks[0] == ranks[-1] == 0


# -- splitting a traced model

@pytest.fixture(scope="module")
def traced_llama():
    reference, model = hf_parity.build_pair("llama", num_hidden_layers=6)
    examples = [torch.ones(1, 8, dtype=torch.long)] * 2
    graph_module = trace_hf(model, ["input_ids", "attention_mask"], (LlamaDecoderLayer,), (), examples)
    return reference, graph_module, value_kinds(graph_module, examples)


def _owners(stage):
    """Module paths owning the stage's parameters, layers collapsed to ``model.layers.<i>``."""
    owners = set()
    for name, _ in stage.named_parameters():
        parts = name.split(".")
        owners.add(".".join(parts[:3]) if parts[1:2] == ["layers"] else name.rsplit(".", 1)[0])
    return owners


@pytest.mark.parametrize("cuts", [
    ["model.layers.2"],
    ["model.layers.1", "model.layers.3"],
    ["model.layers.0", "model.layers.4"],  # uneven: 1, 4, 1 layers
    ["model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3", "model.layers.4"],
])
def test_stage_parameters_and_sequential_logits(traced_llama, cuts):
    reference, graph_module, kinds = traced_llama
    layer_names = [f"model.layers.{i}" for i in range(6)]
    num_stages = len(cuts) + 1
    stage_of_layer = stage_of_layers(layer_names, cuts, num_stages)
    stages = split_stages(graph_module, stage_of_layer, kinds)
    assert len(stages) == num_stages
    for s, stage in enumerate(stages):
        expected = {name for name in layer_names if stage_of_layer[name] == s}
        if s == 0:
            expected.add("model.embed_tokens")
        if s == num_stages - 1:
            expected |= {"model.norm", "lm_head"}
        assert _owners(stage) == expected, f"stage {s}"
    ids, _ = hf_parity.batch(seed=4, b=2, s=8)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :2] = 0  # left padding crosses the boundaries as a materialized mask
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=attention_mask).logits
        values = stages[0](ids, attention_mask)
        for stage in stages[1:]:
            values = stage(*values)
    torch.testing.assert_close(values, expected, rtol=0, atol=1e-6)


# -- schedule bubbles (unit costs: F = I = W = 1 slot, full backward B = 2)

GRID = [(name, pp_size, num_microbatches) for name in SCHEDULES for pp_size in (2, 4, 8)
        for num_microbatches in (pp_size, 2 * pp_size)]


def _virtual(name):
    return 2 if SCHEDULES[name][2] else 1


@pytest.mark.parametrize("name,pp_size,num_microbatches", GRID)
def test_idle_slots_every_action_runs_once(name, pp_size, num_microbatches):
    v = _virtual(name)
    actions = bubbles.action_lists(name, pp_size, num_microbatches, v)
    flat = sorted(a for rank_actions in actions.values() for a in rank_actions)
    kinds = ("I", "W") if "zero_bubble" in name or name == "zbv" else ("B",)
    expected = sorted((s, k, m) for s in range(pp_size * v) for k in ("F", *kinds) for m in range(num_microbatches))
    assert flat == expected


@pytest.mark.parametrize("name,pp_size,num_microbatches", [g for g in GRID if g[0] in ("1f1b", "gpipe")])
def test_idle_slots_one_stage_per_rank(name, pp_size, num_microbatches):
    # (P - 1)(F + B) idle out of (M + P - 1)(F + B): fraction (P - 1)/(M + P - 1)
    assert bubbles.idle_slots(name, pp_size, num_microbatches) == [3 * (pp_size - 1)] * pp_size
    unit = dict(bubbles.SLOT_COSTS, B=1)  # F and B one slot each: 2(P - 1)
    assert bubbles.idle_slots(name, pp_size, num_microbatches, costs=unit) == [2 * (pp_size - 1)] * pp_size
    busy, span = bubbles.replay(bubbles.action_lists(name, pp_size, num_microbatches), pp_size)
    assert span == 3 * (num_microbatches + pp_size - 1)
    assert (span - busy[0]) / span == pytest.approx(
        bubbles.theoretical_bubble_fraction(name, pp_size, num_microbatches))


@pytest.mark.parametrize("name,pp_size,num_microbatches",
                         [g for g in GRID if g[0] in ("interleaved_1f1b", "looped_bfs")])
def test_idle_slots_interleaved(name, pp_size, num_microbatches):
    # chunks of 1/V of a stage: (P - 1)(F + B) idle out of (VM + P - 1)(F + B)
    v = 2
    assert bubbles.idle_slots(name, pp_size, num_microbatches, v) == [3 * (pp_size - 1)] * pp_size
    busy, span = bubbles.replay(bubbles.action_lists(name, pp_size, num_microbatches, v), pp_size * v)
    assert span == 3 * (v * num_microbatches + pp_size - 1)
    assert (span - busy[0]) / span == pytest.approx((pp_size - 1) / (v * num_microbatches + pp_size - 1))


@pytest.mark.parametrize("name,pp_size,num_microbatches",
                         [g for g in GRID if g[0] in ("interleaved_zero_bubble", "zbv")])
def test_idle_slots_zero_bubble(name, pp_size, num_microbatches):
    # weight gradients fill the bubble: P - 1 idle slots (F = I = W) out of 3VM + P - 1; ZBV
    # needs 2P - 1 microbatches for that and idles 2(P - 1) with M = P
    v = 2
    idle = bubbles.idle_slots(name, pp_size, num_microbatches, v)
    short = name == "zbv" and num_microbatches < 2 * pp_size - 1
    assert idle == [(2 if short else 1) * (pp_size - 1)] * pp_size
    one_f_one_b = bubbles.idle_slots("1f1b", pp_size, num_microbatches)
    assert all(z < o for z, o in zip(idle, one_f_one_b))
    fraction = bubbles.theoretical_bubble_fraction(name, pp_size, num_microbatches, v)
    assert fraction == pytest.approx(idle[0] / (3 * v * num_microbatches + idle[0]))
    assert fraction < bubbles.theoretical_bubble_fraction("interleaved_1f1b", pp_size, num_microbatches, v)


def test_idle_slots_zero_bubble_one_stage_per_rank():
    # ZB-H1: interleaved_zero_bubble with V = 1 idles P - 1 slots against 1F1B's 3(P - 1)
    for pp_size in (2, 4, 8):
        assert bubbles.idle_slots("interleaved_zero_bubble", pp_size, 2 * pp_size) == [pp_size - 1] * pp_size


def test_replay_per_stage_costs():
    # 1F1B, P = 2, M = 2, the last stage's forward twice as long: rank 0 F0 F1 . . . B0 . . B1,
    # rank 1 . F0 F0 B0 B0 F1 F1 B1 B1 -> 11 slots
    costs = {**bubbles.SLOT_COSTS, (1, "F"): 2}
    assert bubbles.replay(bubbles.action_lists("1f1b", 2, 2), 2, costs) == ([6, 8], 11)


def test_replay_per_action_costs_override_per_stage():
    # as above, but microbatch 0's forward on stage 1 takes 3 slots (the per-stage 2 elsewhere):
    # rank 1 . F0 F0 F0 B0 B0 F1 F1 B1 B1, rank 0 F0 F1 . . . . B0 B0 . . B1 B1 -> 12 slots
    costs = {**bubbles.SLOT_COSTS, (1, "F"): 2, (1, "F", 0): 3}
    assert bubbles.replay(bubbles.action_lists("1f1b", 2, 2), 2, costs) == ([6, 9], 12)


# -- values every stage recomputes instead of receiving

@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gpt_neox", "phi3", "qwen3"])
def test_boundaries_carry_only_hidden_states(model_type):
    """Position ids, the attention mask and RoPE's cos/sin are recomputed on every stage from
    the attention mask and the incoming hidden state; the stages in sequence are the model,
    with and without padding (the mask is then None: HF's unmasked causal attention)."""
    from nxd_hf.model_setup.activation_checkpoint import decoder_layer_types
    from nxd_hf.pipeline.recompute import allow_unmasked_attention, metadata_substitutes, recomputable_nodes
    from nxd_hf.pipeline.stages import boundaries

    reference, model = hf_parity.build_pair(model_type, num_hidden_layers=3)
    reference.eval(), model.eval()
    examples = [torch.ones(1, 8, dtype=torch.long)] * 2
    layer_types = decoder_layer_types(model)
    graph_module = trace_hf(model, ["input_ids", "attention_mask"], layer_types, (), examples)
    kinds = value_kinds(graph_module, examples)
    layers = [n.target for n in graph_module.graph.nodes
              if n.op == "call_module" and isinstance(graph_module.get_submodule(n.target), layer_types)]
    stage_of_layer = stage_of_layers(layers, layers[:2], 3)
    recomputed, sources = recomputable_nodes(graph_module, ["input_ids", "attention_mask"], set(layers))
    crossings = boundaries(graph_module, stage_of_layer, recomputed)
    substitutes = metadata_substitutes(crossings, sources, kinds)
    assert substitutes is not None
    assert [[n.target for n in crossing] for crossing in crossings] == [layers[:1], layers[1:2]]
    allow_unmasked_attention(graph_module, recomputed)
    assert any(getattr(m, "allow_skip", False) for m in graph_module.modules())
    stages = split_stages(graph_module, stage_of_layer, kinds, recomputed, substitutes)
    ids, _ = hf_parity.batch(seed=4, b=2, s=8)
    for pad in (0, 2):
        attention_mask = torch.ones_like(ids)
        attention_mask[1, :pad] = 0  # left padding: a materialized mask on every stage
        with torch.no_grad():
            expected = reference(input_ids=ids, attention_mask=attention_mask).logits
            values = stages[0](input_ids=ids, attention_mask=attention_mask)
            for stage in stages[1:]:
                values = stage(*values, input_ids=ids, attention_mask=attention_mask)
        torch.testing.assert_close(values, expected, rtol=1e-5, atol=1e-6)
