"""``nxd_hf.plan``: the search, its rejections and ranking, the cost model's pieces checked
against what torch really does (saved activations), real model configs (Llama-3.1-8B,
Mixtral-8x7B; configs only, built on the meta device), the command and the "auto" sizes.
Parameter bytes per rank against real parallel models: tests/distributed/test_plan_params.py."""

import json

import peft
import pytest
import torch
import transformers

import nxd_hf
from nxd_hf import cli
from nxd_hf.parallel_sizes import ParallelSizes
from nxd_hf.plan import Layout, parse_bytes
from nxd_hf.plan.activations import trace_activations
from nxd_hf.plan.memory import Workload, layer_activation_elements, stage_layers
from nxd_hf.plan.shapes import meta_model, model_shape, rank_params

LLAMA_8B = dict(  # meta-llama/Llama-3.1-8B config.json (the fields a model is built from)
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192, rope_type="llama3"),
    bos_token_id=128000, eos_token_id=128001, hidden_act="silu", torch_dtype="bfloat16")
MIXTRAL = dict(  # mistralai/Mixtral-8x7B-v0.1 config.json
    architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
    num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768, rope_theta=1e6,
    sliding_window=None, tie_word_embeddings=False, torch_dtype="bfloat16")
TINY = "examples/data/tiny-llama"


def _write(tmp_path, name: str, config: dict) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_parse_bytes():
    assert parse_bytes("80GB") == 80 * 10**9 and parse_bytes("24GiB") == 24 * 2**30 and parse_bytes(123) == 123
    with pytest.raises(ValueError, match="80GB"):
        parse_bytes("lots")


def test_llama_8b_params_per_rank_follow_the_sharding_rules(tmp_path):
    config = nxd_hf.plan.load_config(_write(tmp_path, "llama8b", LLAMA_8B))
    model = meta_model(config)
    assert model_shape(config, model).total_params == 8_030_261_248
    h, i, kv = 4096, 14336, 8 * 128
    for tp in (1, 2, 8):
        counts = rank_params(config, model, tp=tp)
        layer = (2 * h * h + 2 * kv * h + 3 * h * i) // tp + 2 * h  # q, o, k, v, MLP sharded; two norms replicated
        assert counts.by_place[0] == layer
        assert counts.by_place["pre"] == 128256 // tp * h  # 128256 divides by 8: no padding
        assert counts.by_place["post"] == 128256 // tp * h + h


def test_kv_replication_and_vocab_padding_in_params_per_rank():
    config = transformers.AutoConfig.from_pretrained(TINY)  # 4 heads over 2 K/V heads, vocab 301
    model = meta_model(config)
    counts = rank_params(config, model, tp=4)  # K/V heads copied twice, vocab padded to 304
    h, d = 128, 32
    assert counts.by_place["pre"] == 304 // 4 * h
    kv_rows = 2 * 2 * d // 4  # 2 K/V heads x 2 copies, split over 4 ranks
    assert counts.by_place[0] == h * h // 4 + 2 * kv_rows * h + h * h // 4 + 3 * 256 // 4 * h + 2 * h


def _saved_bytes_per_token_layer(make_config, lora_targets=()) -> float:
    """Bytes autograd saves per token and decoder layer (parameters excluded), by difference of
    one- and two-layer models, measured with saved-tensor hooks."""
    def saved(layers: int) -> int:
        config = make_config(layers)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        if lora_targets:
            import peft

            model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=list(lora_targets)))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        found = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                found[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        ids = torch.randint(0, config.vocab_size, (2, 32))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=ids)
        return sum(found.values())

    return (saved(2) - saved(1)) / (2 * 32)


@pytest.mark.parametrize("name,lora", [("llama", ()), ("qwen2", ()), ("mixtral", ()), ("llama", ("q_proj", "v_proj"))])
def test_activation_bytes_per_token_are_what_autograd_saves(name, lora):
    make_config = {
        "llama": lambda n: transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                                    num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=n),
        "qwen2": lambda n: transformers.Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96,
                                                    num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=n),
        "mixtral": lambda n: transformers.MixtralConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                                        num_attention_heads=4, num_key_value_heads=2,
                                                        num_hidden_layers=n, num_local_experts=4,
                                                        num_experts_per_tok=2),
    }[name]
    shape = model_shape(make_config(1))
    work = Workload(micro_batch_size=2, seq_len=32, global_batch_size=2, lora_r=4 if lora else 0, lora_targets=lora)
    predicted = 4 * layer_activation_elements(shape, work, Layout(sizes=ParallelSizes()), moe=name == "mixtral")
    measured = _saved_bytes_per_token_layer(make_config, lora)
    assert predicted == pytest.approx(measured, rel=0.02), (predicted, measured)
    lora_config = peft.LoraConfig(r=4, target_modules=list(lora)) if lora else None
    # the second layer: under LoRA the first one's input (frozen embeddings) needs no gradient
    trace = trace_activations(make_config(2), micro_batch_size=2, seq_len=32, lora_config=lora_config, device="cpu")
    traced = trace.place_bytes(1, tp=1, sequence_parallel=False, fractions={}) / (2 * 32)
    assert traced == pytest.approx(measured, rel=0.02), (traced, measured)


def test_traced_activations_cover_gpt2_dropout_and_math_attention():
    """GPT-2 in training saves dropout masks, and with attention dropout a CPU's SDPA takes its math
    path (seq x seq probabilities saved); a GPU's fused kernel saves none of those. The config
    formula saw neither."""
    def make_config(n):
        return transformers.GPT2Config(vocab_size=97, n_embd=64, n_inner=96, n_head=4, n_layer=n, n_positions=64)

    measured = _saved_bytes_per_token_layer(make_config)
    trace = trace_activations(make_config(1), micro_batch_size=2, seq_len=32, device="cpu")
    assert trace.place_bytes(0, tp=1, sequence_parallel=False, fractions={}) / (2 * 32) == measured
    on_gpu = trace_activations(make_config(1), micro_batch_size=2, seq_len=32, device="cuda")
    saved = on_gpu.place_bytes(0, tp=1, sequence_parallel=False, fractions={})
    assert saved < measured * 2 * 32 - 2 * 4 * 32 * 32 * 4  # no [b, heads, s, s] probabilities or their mask


def test_stage_layers_match_the_pipeline_partition():
    from nxd_hf.pipeline.partition import auto_cuts

    names = [f"layers.{i}" for i in range(10)]
    cuts = auto_cuts(names, 4)
    ends = [max(r) for r in stage_layers(10, 4)]
    assert [f"layers.{e}" for e in ends[:-1]] == cuts


def test_stage_layers_of_virtual_stages_are_the_ranks_own():
    """Interleaved: a rank holds stages r, r + pp, ... (their layers only, not the span between)."""
    from nxd_hf.pipeline.partition import auto_cuts, local_stages, stage_of_layers

    names = [f"layers.{i}" for i in range(10)]
    stage_of = stage_of_layers(names, auto_cuts(names, 4), 4)
    for rank in range(2):
        mine = local_stages(4, 2, rank, "looped")
        assert stage_layers(10, 2, 2)[rank] == tuple(i for i, n in enumerate(names) if stage_of[n] in mine)
    assert stage_layers(10, 2, 2) == [(0, 1, 4, 5, 6), (2, 3, 7, 8, 9)]


@pytest.mark.parametrize("config,macs", [
    # Conv1D: c_attn 3h^2 + c_proj h^2, MLP h x 4h twice; no down_proj to read a width from
    (transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100), 12 * 64 * 64),
    # parallel residual, dense_h_to_4h / dense_4h_to_h, fused per-head qkv
    (transformers.GPTNeoXConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                vocab_size=100), 4 * 64 * 64 + 2 * 64 * 96),
    # fused experts [E, ...] count top_k / E of their elements; the router [E, h] counts whole
    (transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=100),
     2 * 64 * 64 + 2 * 64 * 32 + 64 * 4 + 2 * 3 * 64 * 96),
])
def test_layer_multiply_adds_are_counted_on_the_model(config, macs):
    """The step time's FLOPs come from each layer's own weight matrices (the width of a GPT-2 or
    NeoX MLP was once read as 0: half their FLOPs missing from the plan's ranking)."""
    shape = model_shape(config)
    assert shape.layer_macs == (macs,) * config.num_hidden_layers


def test_rejections_say_why():
    result = nxd_hf.plan_layout(TINY, world_size=8, device_memory="1GiB", seq_len=63, micro_batch_size=1,
                                global_batch_size=8)
    reasons = {r.layout.name(): r.reason for r in result.rejected}
    assert "exceeds the 4 attention heads" in reasons["tp8 pp1 dp1 mb8"]
    assert "4 pipeline stages for 2 layers" in reasons["tp1 pp4 dp2 mb4 1f1b"]
    assert "does not divide over tp=2" in reasons["tp2 pp1 dp4 sp mb2"]
    small = nxd_hf.plan_layout(TINY, world_size=2, device_memory="2MiB", seq_len=64, micro_batch_size=1)
    assert not small.ranked and all("does not fit" in r.reason or "stages" in r.reason for r in small.rejected)
    with pytest.raises(ValueError, match="no layout of llama fits 2 ranks"):
        small.best
    odd = nxd_hf.plan_layout(TINY, world_size=4, device_memory="1GiB", seq_len=64, micro_batch_size=3,
                             global_batch_size=8)
    assert any("does not divide into dp=" in r.reason for r in odd.rejected)


def test_ranking_is_by_step_time_and_respects_slow_links(tmp_path):
    path = _write(tmp_path, "llama8b", LLAMA_8B)
    result = nxd_hf.plan_layout(path, world_size=16, nodes=2, device_memory="80GB", seq_len=4096, micro_batch_size=1,
                                global_batch_size=64, dtype="bfloat16")
    times = [p.step_time for p in result.ranked]
    assert times == sorted(times)
    assert result.best.layout.tp <= 8  # TP across the slow inter-node links is never best
    for p in result.ranked:
        assert p.memory["peak"] <= 0.9 * 80e9
        assert p.time["step"] == pytest.approx(sum(v for k, v in p.time.items() if k != "step"))


def test_recompute_and_sequence_parallel_lower_activations(tmp_path):
    path = _write(tmp_path, "llama8b", LLAMA_8B)
    result = nxd_hf.plan_layout(path, world_size=8, device_memory="1TB", seq_len=4096, micro_batch_size=1,
                                dtype="bfloat16", global_batch_size=4)

    def memory(**fields) -> dict:
        layout = Layout(sizes=ParallelSizes(tp=2, pp=1, dp=4), num_microbatches=1, **fields)
        return next(p.memory for p in result.ranked if p.layout == layout)

    plain = memory()
    assert memory(recompute=True)["activations"] < plain["activations"] / 5
    assert memory(sequence_parallel=True)["activations"] < plain["activations"]
    assert memory(zero_1=True)["optimizer_state"] < plain["optimizer_state"]


def test_llama_8b_top_layout_fits(tmp_path):
    path = _write(tmp_path, "llama8b", LLAMA_8B)
    result = nxd_hf.plan_layout(path, world_size=8, device_memory="80GB", seq_len=4096, micro_batch_size=1,
                                global_batch_size=32, dtype="bfloat16")
    assert result.best.peak_memory <= 80e9 * 0.9
    assert any(r.reason.startswith("does not fit") for r in result.rejected)  # tp1 dp8: 16 B/param does not fit


def test_mixtral_moe_plan(tmp_path):
    import peft

    path = _write(tmp_path, "mixtral", MIXTRAL)
    result = nxd_hf.plan_layout(path, world_size=8, device_memory="80GB", seq_len=4096, micro_batch_size=1,
                                dtype="bfloat16",
                                lora_config=peft.LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    assert result.shape.num_experts == 8 and result.shape.top_k == 2
    assert result.shape.total_params == 46_702_792_704
    assert result.best.peak_memory <= 80e9 * 0.9
    assert any(layout.tp > 1 and layout.ep > 1 for layout in (c.layout for c in result.ranked))  # tp x ep composes


def test_expert_params_divide_over_tp_times_ep(tmp_path):
    config = nxd_hf.plan.load_config(_write(tmp_path, "mixtral", MIXTRAL))
    model = meta_model(config)
    one, sharded = rank_params(config, model, tp=2), rank_params(config, model, tp=2, ep=4)
    experts = 8 * 3 * 4096 * 14336
    assert one.by_place[0] - sharded.by_place[0] == experts // 2 - experts // 8  # E/ep experts, I/tp of each


def test_cli_prints_a_table(capsys, tmp_path):
    assert cli.main(["plan", TINY, "--world-size", "4", "--memory", "2GiB", "--seq-len", "128", "--dtype", "float32",
                     "--json", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "peak MiB" in out and "tp1 pp1 dp4" in out and "rejected" in out
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["ranked"] and saved["rejected"]


def test_cli_on_8b_and_moe_configs(capsys, tmp_path):
    for name, config, extra in (("llama8b", LLAMA_8B, []), ("mixtral", MIXTRAL, ["--lora"])):
        path = _write(tmp_path, name, config)
        assert cli.main(["plan", path, "--world-size", "8", "--memory", "80GB", "--seq-len", "4096", *extra]) == 0
        out = capsys.readouterr().out
        assert "peak GiB" in out and out.count("\n") > 10


def test_cli_error_for_a_missing_directory(capsys, tmp_path):
    assert cli.main(["plan", str(tmp_path / "missing"), "--world-size", "2", "--memory", "1GB", "--seq-len", "8"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_auto_sizes_resolve_from_the_plan():
    args = nxd_hf.NxDTrainingArguments(output_dir="unused", tensor_parallel_size="auto",
                                       pipeline_parallel_size="1", report_to=[], per_device_train_batch_size=2)
    assert args.has_auto_sizes and args.pipeline_parallel_size == 1
    model = transformers.AutoModelForCausalLM.from_pretrained(TINY)
    sizes = nxd_hf.plan.resolve_auto_sizes(model, tensor_parallel_size=args.tensor_parallel_size,
                                           pipeline_parallel_size=args.pipeline_parallel_size,
                                           micro_batch_size=args.per_device_train_batch_size, world_size=1,
                                           device_memory=2**30, seq_len=64)
    assert sizes == ParallelSizes(tp=1, pp=1, dp=1) and args.tensor_parallel_size == "auto"  # a new value
    args.use_sizes(sizes)
    assert args.tensor_parallel_size == 1 and not args.has_auto_sizes
    # the context_parallel_size asked stays: the plan ranks the layouts with it
    sizes = nxd_hf.plan.resolve_auto_sizes(model, tensor_parallel_size="auto", pipeline_parallel_size=1,
                                           context_parallel_size=2, world_size=2, device_memory=2**30, seq_len=64)
    assert sizes == ParallelSizes(tp=1, pp=1, dp=2, cp=2)


def test_autodist_policy_returns_the_best_layout():
    model = transformers.AutoModelForCausalLM.from_pretrained(TINY)
    policy = nxd_hf.plan.autodist_policy(model, world_size=4, device_memory="1GiB", seq_len=64, micro_batch_size=2)
    best = policy["plan"].best.layout
    assert (policy["tensor_parallel_size"], policy["pipeline_parallel_size"]) == (best.tp, best.pp)
    assert policy["plan_ngpus"] == best.tp * best.pp and policy["runtime_ngpus"] == 4


def test_command_line_takes_auto_and_integers():
    parser = transformers.HfArgumentParser(nxd_hf.NxDTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", "unused", "--tensor_parallel_size", "auto",
                                                  "--pipeline_parallel_size", "1", "--report_to", "none"])
    assert args.tensor_parallel_size == "auto" and args.pipeline_parallel_size == 1 and args.has_auto_sizes
    with pytest.raises(ValueError, match="positive integer"):
        nxd_hf.NxDTrainingArguments(output_dir="unused", tensor_parallel_size="many", report_to=[])


def test_expert_parallel_layouts_are_priced_with_their_all_to_all(tmp_path):
    path = _write(tmp_path, "mixtral", MIXTRAL)
    result = nxd_hf.plan_layout(path, world_size=8, device_memory="10TB", seq_len=1024, dtype="bfloat16")
    ep = [p for p in result.ranked if p.layout.ep > 1]
    assert ep and all(any(t.op == "all_to_all" and t.axis == "ep" for t in p.comm) for p in ep)
    plain = next(p for p in result.ranked if p.layout == Layout(sizes=ParallelSizes(dp=8), num_microbatches=1))
    sharded = next(p for p in result.ranked if p.layout == Layout(sizes=ParallelSizes(dp=8, ep=8), num_microbatches=1))
    assert sharded.memory["parameters"] < plain.memory["parameters"] / 4  # experts are most of Mixtral


def test_zero1_with_expert_parallelism_shards_experts_over_expert_data(tmp_path):
    """ZeRO-1 at ep shards a rank's experts / ep over dp / ep ranks: the same state per rank as at ep=1."""
    path = _write(tmp_path, "mixtral", MIXTRAL)
    result = nxd_hf.plan_layout(path, world_size=8, device_memory="10TB", seq_len=1024, dtype="bfloat16")

    def state(ep: int = 1, **fields) -> float:
        layout = Layout(sizes=ParallelSizes(dp=8, ep=ep), num_microbatches=1, **fields)
        return next(p.memory["optimizer_state"] for p in result.ranked if p.layout == layout)

    assert state(ep=2, zero_1=True) == pytest.approx(state(zero_1=True))
    assert state(ep=8, zero_1=True) == pytest.approx(state(zero_1=True))
    assert state(ep=2, zero_1=True) < state(ep=2) / 2


def test_plan_is_a_plain_module_with_a_function():
    import types

    assert type(nxd_hf.plan) is types.ModuleType and not callable(nxd_hf.plan)
    assert nxd_hf.plan_layout is nxd_hf.plan.plan


def test_zero3_and_zero2_shard_params_grads_and_state_and_gather_layers(tmp_path):
    """FSDP2's layouts: parameters, gradients and optimizer state 1/dp of the same layout without it;
    gathered during the step: the root group (embeddings, final norm, head) and two layers (one
    prefetched in backward) under ZeRO-3, every parameter under ZeRO-2; pp = 1 only, and a fixed ``data_parallel_sharding`` is kept."""
    from nxd_hf.plan.shapes import POST, PRE

    path = _write(tmp_path, "llama", LLAMA_8B)
    result = nxd_hf.plan_layout(path, world_size=8, device_memory="10TB", seq_len=1024, dtype="bfloat16")

    def memory(**fields) -> dict:
        layout = Layout(sizes=ParallelSizes(tp=2, dp=4), num_microbatches=2, **fields)
        return next(p.memory for p in result.ranked if p.layout == layout)

    plain, zero3, zero2 = memory(), memory(data_parallel_sharding="zero3"), memory(data_parallel_sharding="zero2")
    for sharded in (zero3, zero2):
        for item in ("parameters", "gradients", "optimizer_state"):
            assert sharded[item] == pytest.approx(plain[item] / 4, abs=1), item
    counts = rank_params(transformers.AutoConfig.from_pretrained(path), meta_model(
        transformers.AutoConfig.from_pretrained(path)), tp=2)
    layer = max(v for k, v in counts.by_place.items() if isinstance(k, int))
    assert zero3["communication_buffers"] == 2 * (counts.by_place[PRE] + counts.by_place[POST] + 2 * layer)  # bf16
    assert zero2["communication_buffers"] == 2 * sum(counts.by_place.values())
    assert zero3["peak"] < zero2["peak"] < plain["peak"]
    sharded_layouts = [p.layout for p in result.ranked if p.layout.data_parallel_sharding]
    assert sharded_layouts and all(lo.pp == 1 and not lo.zero_1 for lo in sharded_layouts)
    kept = nxd_hf.plan_layout(path, world_size=8, device_memory="10TB", seq_len=1024, dtype="bfloat16",
                              fixed={"data_parallel_sharding": "zero3"})
    assert kept.ranked and {p.layout.data_parallel_sharding for p in kept.ranked} == {"zero3"}
    assert any(p.layout.dp == 1 for p in kept.ranked)  # tp x pp = 8 too: sharding over one rank is allowed


def _tiny_terms(cp: int, attention: str | None, *, recompute: bool = False):
    from nxd_hf.plan.search import predict

    config = nxd_hf.plan.load_config(TINY)
    model = meta_model(config)
    shape, counts = model_shape(config, model), rank_params(config, model, tp=1)
    work = Workload(micro_batch_size=1, seq_len=64, global_batch_size=2 // cp)
    layout = Layout(sizes=ParallelSizes(dp=2, cp=cp), context_parallel_attention=attention, recompute=recompute)
    prediction = predict(shape, counts, work, layout, nxd_hf.plan.make_cluster(world_size=2, device_memory="1GiB",
                                                                               preset="cpu"))
    return prediction, {t.phase: t for t in prediction.comm if t.axis == "cp"}


def test_context_parallel_plan_divides_activations_and_prices_attention():
    """tiny-llama (2 layers, 4 heads, 2 K/V heads of 32), one sequence of 64 tokens, fp32: at cp=2
    each rank holds 32 tokens, K/V = 2 x 32 x 2 x 32 x 4 = 16384 bytes and Q = 32 x 4 x 32 x 4 =
    16384 bytes per layer; the formulas test_context_parallel.py measures (count_comm, 1.00x)."""
    one, none = _tiny_terms(1, None)
    ring, terms = _tiny_terms(2, "ring")
    assert none == {}
    assert ring.memory["activations"] * 2 == one.memory["activations"]  # the trace's, halved
    kv, q = 16384, 16384
    assert terms["cp_fwd"].payload_bytes == 2 * (2 - 1) * kv  # L x (cp-1) K/V hops
    assert terms["cp_bwd"].payload_bytes == 2 * ((2 - 1) * kv + 2 * kv)  # and cp dK/dV hops
    assert (terms["cp_fwd"].op, terms["cp_fwd"].axis) == ("send", "cp")
    _, recomputed = _tiny_terms(2, "ring", recompute=True)
    assert recomputed["cp_fwd"].payload_bytes == 2 * terms["cp_fwd"].payload_bytes
    _, a2a = _tiny_terms(2, "all_to_all")
    assert a2a["cp_fwd"].payload_bytes == a2a["cp_bwd"].payload_bytes == 2 * (2 * q + kv)
    grads = [t for t in ring.comm if t.phase == "dp_grad"]  # averaged over dp x cp, as at cp=1
    assert grads and grads[0].payload_bytes == [t for t in one.comm if t.phase == "dp_grad"][0].payload_bytes


def test_plan_picks_context_parallelism_for_a_long_sequence():
    """4096 tokens on 2 ranks of 70 MiB: one rank's activations do not fit, two CP ranks' halves do."""
    result = nxd_hf.plan_layout(TINY, world_size=2, device_memory=70 * 2**20, seq_len=4096, memory_margin=0.0,
                                device="cpu")
    assert result.best.layout.cp == 2 and result.best.layout.name().startswith("tp1 pp1 dp2 cp2")
    reasons = {r.layout.name(): r.reason for r in result.rejected}
    assert "does not fit" in reasons["tp1 pp1 dp2 mb1"]
    pinned = nxd_hf.plan_layout(TINY, world_size=4, device_memory="1GiB", seq_len=64, fixed={"cp": 2})
    assert pinned.ranked and all(p.layout.cp == 2 and p.layout.pp == 1 for p in pinned.ranked)
    from nxd_hf.plan.search import why_not

    config = nxd_hf.plan.load_config(TINY)
    shape, work = model_shape(config, meta_model(config)), Workload(micro_batch_size=1, seq_len=64, global_batch_size=2)
    layout = Layout(sizes=ParallelSizes(tp=2, dp=4, cp=4), context_parallel_attention="all_to_all")
    assert "the 2 heads per tensor-parallel rank over cp=4" in why_not(shape, work, layout)
