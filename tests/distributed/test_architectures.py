"""A fixed subset of the architecture sweep (``python -m bench.architectures``), one case per fixed class:
scaled embedding (gemma), learnable activation scalar (apertus), fused gated query
(qwen3_5_text), per-layer head_dim (gemma4_unified_text), exact statistics over sharded units
(gemma3n_text), attention sinks (granite_swa), a rowwise layer over the value heads (doge's
dt_proj: ``nxd_hf/model_patches/doge.py``); a mask the model asks materialized (AXK2's DSA indexer) at pp=2; the
config shrinking keeps head ratios and per-layer kinds; a parallelize or a pipeline step that fails on one
rank only fails promptly on every rank; ``nxd-hf check`` on a saved config."""

import time

import pytest
import torch.distributed as dist
import transformers
from packaging.version import Version
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from nxd_hf.testing import DistributedTestError, run_distributed


# model_type -> (expected status, sequence_parallel too)
CASES = {
    "gemma": ("pass", True), "apertus": ("pass", True), "qwen3_5_text": ("pass", False),
    "gemma4_unified_text": ("pass", True), "gemma3n_text": ("pass", False), "doge": ("pass", False),
    "granite_swa": ("pass", True),  # attention sinks, one per query head
    "apertus1p5_text": ("pass", False),  # reads lm_head.out_features (the whole layer's, as nn.Linear's)
    "minicpm5_moe": ("pass", True),  # HF's "unit_colwise" K/V; a fused per-head [query; gate] q_gate_proj
    "inkling_text": ("pass", False),  # passes its loss vocab_size=logits.shape[-1], this rank's shard (hidden: fused)
}


# cases whose plan (or type) transformers 5.25 brought
SINCE_5_25 = {"minicpm5_moe": "no such model type", "inkling_text": "refused: its plan all-reduces the shared experts"}
BEFORE_5_25 = Version(transformers.__version__) < Version("5.25")


def _tiny(model_type: str):
    from nxd_hf.parity.shrink import shrink_config

    return shrink_config(transformers.AutoConfig.for_model(model_type))


class _FailsOnRank1(transformers.LlamaForCausalLM):
    """parallelize raises on rank 1 only (while swapping layers), as a rank-local bug would."""

    def set_submodule(self, target, module, strict=False):
        if dist.get_rank() == 1:
            raise RuntimeError("injected failure on rank 1")
        return super().set_submodule(target, module, strict)


class _FailsInPipelineStepOnRank0(transformers.LlamaForCausalLM):
    """The first layer raises on rank 0 when it runs a real microbatch of the pipeline (2 rows; the
    reference runs the whole batch of 4, the tracer fake tensors)."""

    def __init__(self, config):
        super().__init__(config)
        self.model.layers[0].register_forward_hook(_fail_on_rank0_microbatch)


def _fail_on_rank0_microbatch(module, args, output):
    hidden = args[0]
    if dist.get_rank() == 0 and hidden.shape[0] == 2 and not isinstance(hidden, FakeTensor):
        raise RuntimeError("injected failure in the pipeline step on rank 0")


def architecture_case(model_type: str, sp: bool, model_cls=None, tp: int = 2, pp: int = 1, fused_loss: bool = False):
    """run_case at tp x pp (default tp=2) on a shrunk config of ``model_type``; with its wall time."""
    from nxd_hf.parity.cases import run_case

    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    result = run_case(_tiny(model_type), tensor_parallel_size=tp, pipeline_parallel_size=pp, sequence_parallel=sp,
                      model_cls=model_cls, fused_loss=fused_loss)
    return result, time.perf_counter() - start


@pytest.mark.parametrize("model_type,sp", [(t, sp) for t, (_, with_sp) in CASES.items()
                                           for sp in ((False, True) if with_sp else (False,))],
                         ids=lambda v: v if isinstance(v, str) else ("sequence_parallel" if v else "no_sp"))
def test_fixed_architecture_classes(ranks2, model_type, sp):
    if model_type in SINCE_5_25 and BEFORE_5_25:
        pytest.skip(f"{model_type}: {SINCE_5_25[model_type]} before transformers 5.25")
    expected, _ = CASES[model_type]
    results = [result for result, _ in ranks2.run(architecture_case, model_type, sp)]
    assert results[0] == results[1], "the ranks must agree on the outcome"
    assert results[0].status == expected, f"{model_type} sp={sp}: {results[0].message}"


def test_loss_vocab_from_the_logits_shape_with_the_fused_loss(ranks2):
    """Inkling's forward passes vocab_size=logits.shape[-1]: with fused_loss=True that is the hidden size."""
    if BEFORE_5_25:
        pytest.skip(f"inkling_text: {SINCE_5_25['inkling_text']} before transformers 5.25")
    result, _ = ranks2.run(architecture_case, "inkling_text", False, fused_loss=True)[0]
    assert result.status == "pass", result.message


class _LlamaWithConv(transformers.LlamaForCausalLM):
    """A user's decoder layer holding a causal depthwise convolution over the sequence (kernel 3)."""

    def __init__(self, config):
        super().__init__(config)
        size = config.hidden_size
        self.model.layers[0].short_conv = nn.Conv1d(size, size, 3, padding=2, groups=size)


def test_a_convolution_over_the_sequence_refuses_sequence_parallelism(ranks2):
    """A replicated conv1d over the sequence in a decoder layer would see one rank's chunk of it
    under sequence parallelism: refused, naming it; Jamba's Mamba mixer (whose attention 5.25's plan
    shards, so that nothing else refuses it) is refused too."""
    result, _ = ranks2.run(architecture_case, "llama", True, _LlamaWithConv)[0]
    assert result.status == "refused" and "'model.layers.0.short_conv' is a convolution over the sequence" in \
        result.message, result.message
    result, _ = ranks2.run(architecture_case, "jamba", True)[0]
    assert result.status == "refused", result.message


# a persistent buffer (checkpoint state, no value in the config): refused on the meta device, with the fix
META_REFUSED = {"phi4_multimodal": "global_mean"}


def _reset_parameters(module) -> None:
    """NxD's usual ``param_init_fn`` (HF's ``_init_weights`` is not: Gemma3n's reads an attribute the
    causal-LM class lacks)."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def meta_init_case(types: list[str] | None = None) -> dict[str, str]:
    """Every sweep architecture at tp=2 built on the meta device and materialized with a
    ``param_init_fn``: no meta tensor is left, and every buffer (RoPE's ``inv_freq``, Gemma's
    ``embed_scale``, routers' correction biases, xIELU's constants) equals the one of the same model
    built on the CPU. Types that parallelize refuses on the CPU are refused the same way from meta."""
    import torch

    import nxd_hf
    from bench.architectures.run import model_types
    from nxd_hf import parallel_state
    from nxd_hf.parity.cases import causal_lm_class

    transformers.logging.set_verbosity_error()
    problems = {}
    for model_type in types or model_types():
        try:
            config = _tiny(model_type)
            causal_lm_class(config)(config)
        except Exception:  # noqa: BLE001  a model transformers itself cannot build shrunk: the sweep reports it
            continue
        outcomes = []
        for device in ("cpu", "meta"):
            parallel_state.destroy_model_parallel()
            torch.manual_seed(0)
            try:
                with torch.device(device):
                    model = causal_lm_class(config)(config)
                nxd_hf.parallelize(model, tensor_parallel_size=2, param_init_fn=_reset_parameters)
                outcomes.append({n: b for n, b in model.named_buffers()})
            except ValueError as error:
                outcomes.append(str(error))
        cpu, meta = outcomes
        if model_type in META_REFUSED:
            if not (isinstance(meta, str) and META_REFUSED[model_type] in meta):
                problems[model_type] = f"expected the refusal naming {META_REFUSED[model_type]}, got {meta!r:.200}"
            continue
        if isinstance(cpu, str) or isinstance(meta, str):
            if cpu != meta:
                problems[model_type] = f"cpu: {cpu!r:.200}, meta: {meta!r:.200}"
            continue
        left = [n for n, t in (*model.named_parameters(), *meta.items()) if t.is_meta]
        differ = [n for n in cpu if n not in meta or not torch.equal(cpu[n], meta[n])]
        if left or differ or set(cpu) != set(meta):
            problems[model_type] = f"meta tensors left {left}, buffers differing {differ}"
    return problems


# one type per way a buffer is made: RoPE from the config (llama), a scalar kept beside it (gemma's
# embed_scale, apertus' xIELU), a router's correction bias (deepseek_v3), RoPE built from sizes
# (gptj, codegen), a buffer of the base model itself (gemma3n_text), a refused persistent one;
# ``meta_init_case()`` with no argument runs every type of the sweep (3 minutes here)
META_TYPES = ["llama", "gemma", "apertus", "deepseek_v3", "gptj", "codegen", "gemma3n_text", "phi4_multimodal", "lfm2"]


def test_meta_init_of_the_sweep_architectures_buffer_kinds(ranks2):
    problems = ranks2.run(meta_init_case, META_TYPES, timeout_s=300)
    assert problems[0] == {}, problems[0]


def test_failing_rank_fails_promptly_on_every_rank(ranks2):
    """parallelize agrees on success before any collective: both ranks raise rank 1's error."""
    for result, seconds in ranks2.run(architecture_case, "llama", False, _FailsOnRank1):
        assert result.status == "refused"
        assert "failed on rank 1" in result.message
        assert "injected failure on rank 1" in result.message
        assert seconds < 30


def test_materialized_mask_of_a_dsa_indexer_at_pp2(ranks2):
    """AXK2 asks create_causal_mask for a tensor (allow_is_causal_skip=False: its indexer slices the
    mask); the stages that recompute the mask gave it None for an all-ones mask, stage 0 failed and
    stage 1 waited on it for good. A short timeout: a regression fails instead of hanging the suite."""
    results = [result for result, _ in ranks2.run(architecture_case, "axk2", False, None, 1, 2, timeout_s=150)]
    assert [r.status for r in results] == ["pass", "pass"], results[0].message  # each stage checks its own grads


def test_failed_pipeline_step_fails_promptly_on_every_rank():
    """A pipeline step that fails on one stage closes the process groups: run_case raises on every
    rank (it cannot agree on an outcome any more) instead of waiting in its agreement forever."""
    start = time.perf_counter()
    with pytest.raises(DistributedTestError) as error:
        run_distributed(architecture_case, 2, "llama", False, _FailsInPipelineStepOnRank0, 1, 2, timeout_s=90)
    message = str(error.value)
    assert "timed out" not in message, message
    assert "run_train failed on rank 0" in message and "injected failure in the pipeline step" in message, message
    assert time.perf_counter() - start < 60


def test_shrink_keeps_head_ratio_and_one_layer_per_kind():
    from nxd_hf.parity.shrink import shrink_config

    small = shrink_config(transformers.AutoConfig.for_model("seed_oss"))  # 80 heads, 8 K/V heads
    assert (small.num_attention_heads, small.num_key_value_heads) == (20, 2)
    small = shrink_config(transformers.AutoConfig.for_model("qwen3"))  # 32 / 32: multi-head
    assert small.num_attention_heads == small.num_key_value_heads == 6
    small = shrink_config(transformers.AutoConfig.for_model("gemma4_unified_text"))
    assert small.layer_types == ["sliding_attention", "full_attention"]
    assert small.per_layer_config[1].head_dim == 2 * small.per_layer_config[0].head_dim  # 512 vs 256, shrunk


def test_mla_planned_by_heads_and_fused_experts_folded():
    from nxd_hf.tp.derive import patch_from_hf_plan
    from nxd_hf.tp.mla import LatentAttention
    from nxd_hf.tp.plan import Experts

    config = transformers.AutoConfig.for_model("minicpm3")  # parity: tests/distributed/test_mla.py
    plan = patch_from_hf_plan("minicpm3", config.base_model_tp_plan, config=config).plan
    assert isinstance(plan["layers.*.self_attn"], LatentAttention)
    config = transformers.AutoConfig.for_model("mixtral")
    plan = patch_from_hf_plan("mixtral", config.base_model_tp_plan, config=config).plan
    assert plan["layers.*.mlp.experts"] == Experts()
    assert not any(pattern.startswith("layers.*.mlp.experts.") for pattern in plan)  # its 3-D params are folded in


def test_fused_experts_named_by_either_plan():
    """transformers <5.25 names fused experts in base_model_tp_plan ("moe_tp_experts"), 5.25 only in
    base_model_ep_plan ("ep_dispatch_experts"): either way they shard over TP as one Experts style."""
    from nxd_hf.tp.derive import patch_from_hf_plan
    from nxd_hf.tp.plan import Experts

    config = transformers.AutoConfig.for_model("mixtral")
    dense = {p: s for p, s in config.base_model_tp_plan.items() if ".experts" not in p}
    in_tp_plan = {**dense, "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                  "layers.*.mlp.experts.down_proj": "rowwise", "layers.*.mlp.experts": "moe_tp_experts"}
    in_ep_plan = {"layers.*.mlp.experts.gate_up_proj": "grouped_gemm", "layers.*.mlp.experts.down_proj": "grouped_gemm",
                  "layers.*.mlp.experts": "ep_dispatch_experts"}
    for tp_plan, ep_plan in ((in_tp_plan, {}), (in_tp_plan, in_ep_plan), (dense, in_ep_plan)):
        object.__setattr__(config, "base_model_ep_plan", ep_plan)
        plan = patch_from_hf_plan("mixtral", tp_plan, config=config).plan
        assert plan["layers.*.mlp.experts"] == Experts(), (tp_plan, ep_plan)
        assert not any(pattern.startswith("layers.*.mlp.experts.") for pattern in plan)
    object.__setattr__(config, "base_model_ep_plan", {})
    assert "layers.*.mlp.experts" not in patch_from_hf_plan("mixtral", dense, config=config).plan


def test_check_command_on_saved_config(tmp_path, capsys):
    from nxd_hf.cli import main

    transformers.Qwen3Config(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                             num_hidden_layers=12, vocab_size=1000).save_pretrained(tmp_path)
    assert main(["check", str(tmp_path), "--tp", "2", "--sp"]) == 0
    assert "pass" in capsys.readouterr().out
