"""A fixed subset of the architecture sweep (``python -m bench.architectures``), one case per fixed class:
scaled embedding (gemma), learnable activation scalar (apertus), fused gated query
(qwen3_5_text), per-layer head_dim (gemma4_unified_text), exact statistics over sharded units
(gemma3n_text), attention sinks (granite_swa), a rowwise layer over the value heads (doge's
dt_proj: ``model_patches/doge.py``); a mask the model asks materialized (AXK2's DSA indexer) at pp=2; the
config shrinking keeps head ratios and per-layer kinds; a parallelize or a pipeline step that fails on one
rank only fails promptly on every rank; ``nxd-hf check`` on a saved config."""

import time

import pytest
import torch.distributed as dist
import transformers
from torch._subclasses.fake_tensor import FakeTensor

from nxd_hf.testing import DistributedTestError, run_distributed


# model_type -> (expected status, sequence_parallel too)
CASES = {
    "gemma": ("pass", True), "apertus": ("pass", True), "qwen3_5_text": ("pass", False),
    "gemma4_unified_text": ("pass", True), "gemma3n_text": ("pass", False), "doge": ("pass", False),
    "granite_swa": ("pass", True),  # attention sinks, one per query head
}


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


def architecture_case(model_type: str, sp: bool, model_cls=None, tp: int = 2, pp: int = 1):
    """run_case at tp x pp (default tp=2) on a shrunk config of ``model_type``; with its wall time."""
    from nxd_hf.parity.cases import run_case

    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    result = run_case(_tiny(model_type), tensor_parallel_size=tp, pipeline_parallel_size=pp, sequence_parallel=sp,
                      model_cls=model_cls)
    return result, time.perf_counter() - start


@pytest.mark.parametrize("model_type,sp", [(t, sp) for t, (_, with_sp) in CASES.items()
                                           for sp in ((False, True) if with_sp else (False,))],
                         ids=lambda v: v if isinstance(v, str) else ("sequence_parallel" if v else "no_sp"))
def test_fixed_architecture_classes(ranks2, model_type, sp):
    expected, _ = CASES[model_type]
    results = [result for result, _ in ranks2.run(architecture_case, model_type, sp)]
    assert results[0] == results[1], "the ranks must agree on the outcome"
    assert results[0].status == expected, f"{model_type} sp={sp}: {results[0].message}"


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


def test_check_command_on_saved_config(tmp_path, capsys):
    from nxd_hf.cli import main

    transformers.Qwen3Config(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                             num_hidden_layers=12, vocab_size=1000).save_pretrained(tmp_path)
    assert main(["check", str(tmp_path), "--tp", "2", "--sp"]) == 0
    assert "pass" in capsys.readouterr().out
