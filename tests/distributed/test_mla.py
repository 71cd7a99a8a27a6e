"""Multi-head latent attention (``nxd_hf.tp.mla``) on tiny MiniCPM3- and dense DeepSeek-V2/V3-shaped
models against the unparallelized HF model: training parity at tp=2 and tp=4 (6 heads: padded to
8), with and without SP, and through the pipeline (pp=2, tp=2 x pp=2); a tp=2 checkpoint loaded
at tp=1; ``save_pretrained``/``consolidate`` loading in plain transformers and back through
``from_pretrained``; LoRA on every MLA projection against plain peft; the other MLA architectures
(indexers, gates, sinks) in dense variants; an unplanned child refused at tp > 1. Also HRM's two layer stacks, the dense Llama-4 attention with its parameter-free q/k norm,
and Doge's dynamic-mask projection."""

import os

from support import ckpt
from support import lora
import pytest
import torch
import transformers

import nxd_hf
from nxd_hf import parallel_state
from nxd_hf.checkpoint import full_optimizer_state
from nxd_hf.parallel_layers import ColumnParallelLinear, RowParallelLinear
from nxd_hf.parallel_layers.sharding import full_tensor
from support import hf_parity


VOCAB = hf_parity.VOCAB
_MLA = dict(hidden_size=48, intermediate_size=64, num_attention_heads=6, num_key_value_heads=6, num_hidden_layers=2,
            vocab_size=VOCAB, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
            tie_word_embeddings=False)
_DENSE = dict(first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)

# model_type -> (config class, task model class, config kwargs), in hf_parity.TINY's shape.
TINY = {
    "minicpm3": (transformers.MiniCPM3Config, transformers.MiniCPM3ForCausalLM, dict(
        _MLA, q_lora_rank=16, attention_bias=True)),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(
        _MLA, **_DENSE, q_lora_rank=16, n_shared_experts=1, n_group=1, topk_group=1)),
    "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM, dict(  # q_proj (no q LoRA)
        _MLA, **_DENSE, q_lora_rank=None, n_shared_experts=1)),
}
hf_parity.TINY.update(TINY)  # hf_parity.build_pair / support.lora then build these too

TOL = hf_parity.TOL
STEPS = 3
LORA_TARGETS = ["q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.train()
    return logits


def _assert_sharded_by_heads(model, model_type: str, tp: int) -> None:
    """The up-projections and o_proj are parallel layers holding this rank's (padded) heads."""
    config = model.config
    local = -(-config.num_attention_heads // tp)
    attention = model.model.layers[0].self_attn
    up = attention.q_b_proj if getattr(config, "q_lora_rank", None) else attention.q_proj
    assert attention.num_heads == local, (model_type, attention.num_heads, local)
    assert isinstance(up, ColumnParallelLinear) and up.weight.shape[0] == local * attention.qk_head_dim
    kv_width = attention.qk_nope_head_dim + attention.v_head_dim
    assert isinstance(attention.kv_b_proj, ColumnParallelLinear) and attention.kv_b_proj.weight.shape[0] == local * kv_width
    assert isinstance(attention.o_proj, RowParallelLinear) and attention.o_proj.weight.shape[1] == local * attention.v_head_dim
    assert isinstance(attention.kv_a_proj_with_mqa, torch.nn.Linear), "the down-projection stays whole"


def check_training(model_type: str, tp: int, sp: bool) -> None:
    """Loss, logits, every gathered gradient and the parameters after ``STEPS`` AdamW steps equal
    the unparallelized model's."""
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair(model_type)
    nxd_hf.parallelize(model, tensor_parallel_size=tp, sequence_parallel=sp, gather_logits=True)
    _assert_sharded_by_heads(model, model_type, tp)
    what = f"{model_type} tp={tp} sp={sp}"
    ids, _ = hf_parity.batch(seed=99)
    torch.testing.assert_close(_logits(model, ids), _logits(reference, ids), **TOL, msg=lambda m: f"{what} logits: {m}")
    # gradients are compared before each step; the parameters after hold on any CPU's kernels at
    # lr 1e-3: Adam's sign-like step on a gradient that is rounding noise moves it by ~1e-6 over a
    # few steps, a tenth of atol (lr 1e-2: up to 1.1e-5, see test_lightning.py)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_params = dict(reference.named_parameters())
    for step in range(STEPS):
        ids, labels = hf_parity.batch(seed=10 + step)
        ref_loss = reference(input_ids=ids, labels=labels).loss
        loss = model(input_ids=ids, labels=labels).loss
        ref_loss.backward()
        loss.backward()
        torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m: f"{what} step {step} loss: {m}")
        for name, param in model.named_parameters():
            torch.testing.assert_close(hf_parity.gathered_grad(param), ref_params[name].grad, **TOL,
                                       msg=lambda m: f"{what} step {step} grad {name}: {m}")
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    for name, param in model.named_parameters():
        torch.testing.assert_close(full_tensor(param), ref_params[name].detach(), **TOL,
                                   msg=lambda m: f"{what} after {STEPS} steps {name}: {m}")


def check_checkpoint_reshards(root: str, model_type: str) -> None:
    """``save_checkpoint`` at tp=2 (after a step), ``load_checkpoint`` into a fresh model at tp=1:
    every model and optimizer tensor equal; the next loss equals the tp=2 model's."""
    path = os.path.join(root, "ckpt")
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair(model_type)
    nxd_hf.parallelize(model, tensor_parallel_size=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, labels = hf_parity.batch(seed=5)
    model(input_ids=ids, labels=labels).loss.backward()
    opt.step(), opt.zero_grad()
    nxd_hf.save_checkpoint(path, tag="step1", model=model, optimizer=opt)
    saved = {"params": nxd_hf.full_state_dict(model), "optim": full_optimizer_state(model, opt)}
    ids, labels = hf_parity.batch(seed=6)
    loss_tp2 = model(input_ids=ids, labels=labels).loss.detach()
    parallel_state.destroy_model_parallel()
    _, fresh = hf_parity.build_pair(model_type, seed=3)
    nxd_hf.parallelize(fresh, tensor_parallel_size=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    nxd_hf.load_checkpoint(path, tag="step1", model=fresh, optimizer=fresh_opt)
    loaded = {"params": nxd_hf.full_state_dict(fresh), "optim": full_optimizer_state(fresh, fresh_opt)}
    ckpt.assert_snapshots_equal(loaded, saved)  # model and Adam moments, exactly
    torch.testing.assert_close(fresh(input_ids=ids, labels=labels).loss.detach(), loss_tp2, **TOL)


def check_plain_transformers_loads(root: str, model_type: str) -> None:
    """``save_pretrained`` and ``consolidate`` of a tp=2 MLA model load in plain transformers with
    the unparallelized model's logits; ``nxd_hf.from_pretrained`` reads it back at tp=2 (each rank
    its heads' rows of the files)."""
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair(model_type)
    nxd_hf.parallelize(model, tensor_parallel_size=2)
    pretrained, ckpt, consolidated = (os.path.join(root, d) for d in ("pretrained", "ckpt", "hf"))
    model.save_pretrained(pretrained)
    nxd_hf.save_checkpoint(ckpt, tag="final", model=model)
    ids, _ = hf_parity.batch()
    expected = _logits(reference, ids)
    if torch.distributed.get_rank() == 0:
        nxd_hf.consolidate(ckpt, consolidated)
        for directory in (pretrained, consolidated):
            loaded = transformers.AutoModelForCausalLM.from_pretrained(directory)
            torch.testing.assert_close(_logits(loaded, ids), expected, rtol=0, atol=0, msg=lambda m: f"{directory}: {m}")
    torch.distributed.barrier()
    again = nxd_hf.from_pretrained(consolidated, tensor_parallel_size=2, gather_logits=True)
    _assert_sharded_by_heads(again, model_type, 2)
    torch.testing.assert_close(_logits(again, ids), expected, **TOL)


def check_lora(model_type: str, tp: int, sp: bool = False) -> None:
    """LoRA on every MLA projection (down, up and output) at ``tp``: plain peft's losses, adapters
    after five steps, logits and merged logits (``lora.check_training``)."""
    config = TINY[model_type][0](**TINY[model_type][2])
    targets = [t for t in LORA_TARGETS if t != ("q_b_proj" if config.q_lora_rank is None else "q_proj")
               and (t != "q_a_proj" or config.q_lora_rank is not None)]
    lora.check_training(model_type, tp, sp=sp, target_modules=targets)


def check_unplanned_child_refused(tp: int) -> None:
    """A parameterized module inside MLA attention that the plan does not place is refused at
    tp > 1 with the reason on every rank; at tp=1 (nothing sharded) it is kept as is."""
    import pytest

    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("minicpm3")
    for layer in model.model.layers:
        layer.self_attn.extra = torch.nn.Linear(4, 4)
    if tp > 1:
        with pytest.raises(ValueError, match="self_attn.extra.*does not place"):
            nxd_hf.parallelize(model, tensor_parallel_size=tp)
    else:
        nxd_hf.parallelize(model, tensor_parallel_size=1)


def _dense_variant(model_type: str):
    """transformers' default config of ``model_type``, shrunk (``nxd_hf.parity.shrink``) to two layers,
    both dense (MoE experts under TP are another branch's work)."""
    from nxd_hf.parity.shrink import shrink_config

    config = transformers.AutoConfig.for_model(model_type).get_text_config()
    overrides = {key: 2 for key in ("first_k_dense_replace", "num_dense_layers") if hasattr(config, key)}
    if getattr(config, "mlp_layer_types", None) is not None:
        overrides["mlp_layer_types"] = ["dense", "dense"]
    return shrink_config(config, num_layers=2, overrides={"num_hidden_layers": 2, **overrides})


def dense_variant_case(model_type: str, tp: int, sp: bool):
    """``run_case`` on ``_dense_variant(model_type)``: its agreed ``CaseResult``."""
    from nxd_hf.parity.cases import run_case

    transformers.logging.set_verbosity_error()
    return run_case(_dense_variant(model_type), tensor_parallel_size=tp, sequence_parallel=sp)


def hrm_case(tp: int, pp: int, sp: bool):
    """``nxd_hf.parity.run_case`` on a shrunk HRM (two layer stacks run in cycles, a per-head output
    gate, 6 heads): its agreed ``CaseResult``."""
    from nxd_hf.parity.cases import run_case
    from nxd_hf.parity.shrink import shrink_config

    config = shrink_config(transformers.HrmTextConfig())
    assert config.num_attention_heads == 6
    return run_case(config, tensor_parallel_size=tp, pipeline_parallel_size=pp, sequence_parallel=sp)


def llama4_dense_qk_norm_case(tp: int, sp: bool):
    """A dense Llama-4 text model (``moe_layers=[]``) with ``use_qk_norm=True`` (a parameter-free L2
    norm per head) and 6 heads over 2 K/V heads: ``run_case``'s agreed ``CaseResult``."""
    from nxd_hf.parity.cases import run_case

    config = transformers.Llama4TextConfig(
        hidden_size=48, intermediate_size=64, intermediate_size_mlp=64, num_attention_heads=6, num_key_value_heads=2,
        head_dim=8, num_hidden_layers=2, moe_layers=[], vocab_size=VOCAB, use_qk_norm=True, no_rope_layers=[1, 0])
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.parity.build_pair(config)  # Llama4ForCausalLM: its base model is .model
    nxd_hf.parallelize(model, tensor_parallel_size=tp)
    attention = model.model.layers[0].self_attn
    assert isinstance(attention.q_proj, ColumnParallelLinear) and isinstance(attention.o_proj, RowParallelLinear)
    return run_case(config, tensor_parallel_size=tp, sequence_parallel=sp)


def doge_case(tp: int, pp: int = 1, num_key_value_heads: int = 6):
    """``run_case`` on a shrunk Doge (6 heads; dt_proj and o_proj biases; a keep window of 4 keys
    of 8, so the dynamic mask drops keys): its agreed ``CaseResult``."""
    from nxd_hf.parity.cases import run_case
    from nxd_hf.parity.shrink import shrink_config

    config = shrink_config(transformers.DogeConfig(), overrides=dict(
        attention_bias=True, keep_window_size=4, num_key_value_heads=num_key_value_heads))
    assert config.num_attention_heads == 6 and config.num_key_value_heads == num_key_value_heads
    return run_case(config, tensor_parallel_size=tp, pipeline_parallel_size=pp)


def pipeline_case(model_type: str, tp: int, pp: int):
    """``run_case`` (tp x pp, the pipeline's own schedule) on ``TINY[model_type]``'s config."""
    from nxd_hf.parity.cases import run_case

    config_cls, model_cls, kwargs = TINY[model_type]
    return run_case(config_cls(**kwargs), tensor_parallel_size=tp, pipeline_parallel_size=pp, model_cls=model_cls)


TYPES = list(TINY)


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("model_type", TYPES)
def test_training_tp2(ranks2, model_type, sp):
    ranks2.run(check_training, model_type, 2, sp)


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("model_type", TYPES)
def test_training_tp4_padded_heads(ranks4, model_type, sp):
    ranks4.run(check_training, model_type, 4, sp)


@pytest.mark.parametrize("model_type", ["minicpm3", "deepseek_v2"])
def test_checkpoint_tp2_loads_at_tp1(ranks2, tmp_path, model_type):
    ranks2.run(check_checkpoint_reshards, str(tmp_path), model_type)


@pytest.mark.parametrize("model_type", ["minicpm3", "deepseek_v3"])
def test_save_pretrained_and_consolidate_load_in_transformers(ranks2, tmp_path, model_type):
    ranks2.run(check_plain_transformers_loads, str(tmp_path), model_type)


@pytest.mark.parametrize("model_type, sp", [("minicpm3", False), ("deepseek_v3", False), ("deepseek_v2", True)])
def test_lora_matches_plain_peft_tp2(ranks2, model_type, sp):
    ranks2.run(check_lora, model_type, 2, sp)


@pytest.mark.parametrize("tp", [1, 2])
def test_unplanned_child_of_mla_refused_at_tp2(ranks2, tp):
    ranks2.run(check_unplanned_child_refused, tp)


# every other MLA architecture of transformers 5.23 (shrunk, its layers dense): DeepSeek sparse
# attention's indexer (deepseek_v32, glm_moe_dsa, hy_v4 with sinks and a per-head gate, dots3_note
# with a per-head gate and a rope-key norm, axk2 with a fused query+gate projection)
DENSE_VARIANTS = ["glm4_moe_lite", "deepseek_v32", "glm_moe_dsa", "hy_v4", "dots3_note_text", "axk2"]


@pytest.mark.parametrize("model_type", DENSE_VARIANTS)
def test_dense_variants_tp2_sequence_parallel(ranks2, model_type):
    result = ranks2.run(dense_variant_case, model_type, 2, True)[0]
    assert result.status == "pass", result.message


@pytest.mark.parametrize("model_type", ["deepseek_v32", "hy_v4"])
def test_dense_variants_tp4(ranks4, model_type):
    result = ranks4.run(dense_variant_case, model_type, 4, False)[0]
    assert result.status == "pass", result.message


@pytest.mark.parametrize("tp, pp, sp, expected", [
    (2, 1, False, "pass"), (2, 1, True, "sequence_parallel=True is not supported"),
    (1, 2, False, "pipeline_parallel_size=2 is not supported")])
def test_hrm_two_layer_stacks_world2(ranks2, tp, pp, sp, expected):
    results = ranks2.run(hrm_case, tp, pp, sp)
    assert results[0] == results[1]
    assert (results[0].status if expected == "pass" else results[0].message).find(expected) >= 0, results[0]


def test_hrm_padded_heads_tp4(ranks4):
    result = ranks4.run(hrm_case, 4, 1, False)[0]
    assert result.status == "pass", result.message


@pytest.mark.parametrize("sp", [False, True])
def test_llama4_dense_attention_with_qk_norm_tp2(ranks2, sp):
    result = ranks2.run(llama4_dense_qk_norm_case, 2, sp)[0]
    assert result.status == "pass", result.message


def test_llama4_dense_attention_with_qk_norm_tp4(ranks4):
    result = ranks4.run(llama4_dense_qk_norm_case, 4, False)[0]
    assert result.status == "pass", result.message


@pytest.mark.parametrize("kv_heads", [6, 2])
def test_doge_dynamic_mask_projection_tp2(ranks2, kv_heads):
    result = ranks2.run(doge_case, 2, 1, kv_heads)[0]
    assert result.status == "pass", result.message


def test_doge_pipeline_pp2(ranks2):
    """Doge asks create_causal_mask for a tensor (its dynamic mask is added onto it): the stages
    that recompute the mask once gave None for an all-ones mask, so attention was not causal."""
    result = ranks2.run(doge_case, 1, 2, timeout_s=150)[0]
    assert result.status == "pass", result.message


@pytest.mark.parametrize("kv_heads, expected", [(6, "pass"), (2, "refused")])
def test_doge_tp4_padded_heads_or_replicated_kv_refused(ranks4, kv_heads, expected):
    result = ranks4.run(doge_case, 4, 1, kv_heads)[0]
    assert result.status == expected, result.message
    assert expected == "pass" or "dt_proj reads every value head" in result.message


@pytest.mark.parametrize("model_type", TYPES)
def test_pipeline_pp2(ranks2, model_type):
    result = ranks2.run(pipeline_case, model_type, 1, 2)[0]
    assert result.status == "pass", result.message


@pytest.mark.parametrize("model_type", ["minicpm3", "deepseek_v3"])
def test_tp2_pp2(ranks4, model_type):
    result = ranks4.run(pipeline_case, model_type, 2, 2)[0]
    assert result.status == "pass", result.message
