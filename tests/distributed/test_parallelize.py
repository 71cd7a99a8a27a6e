"""parallelize() on every registered architecture: parity with the unpatched HF model (decoders
with SP on and off, encoder task models), and GPT-2 training with dropout, on a pool of 4 ranks."""

import pytest
import torch
import torch.distributed as dist
import transformers

from support import hf_parity
import nxd_hf
from nxd_hf import parallel_state
from nxd_hf.parallel_layers.random import model_parallel_manual_seed
from nxd_hf.parallel_layers.sharding import is_sharded
from nxd_hf import tp
from nxd_hf.tp.derive import patch_from_hf_plan


def check_dropout_training_keeps_tp_replicas_equal(model_type: str, tp: int, sp: bool) -> None:
    """Two AdamW steps with dropout 0.1 everywhere: replicated parameters (norms, position
    embeddings, row-parallel biases) stay bitwise equal across the TP group."""
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair(model_type, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    nxd_hf.parallelize(model, tensor_parallel_size=tp, sequence_parallel=sp)
    model_parallel_manual_seed(1234)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, labels = hf_parity.batch()
    model.train()
    for _ in range(2):
        loss = model(input_ids=ids, labels=labels).loss
        assert torch.isfinite(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    replicated = {name: p for name, p in model.named_parameters() if not is_sharded(p)}
    assert "transformer.wpe.weight" in replicated and "transformer.h.0.ln_1.weight" in replicated
    for name, param in replicated.items():
        copies = [torch.empty_like(param) for _ in range(tp)]
        dist.all_gather(copies, param.detach().contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        assert all(torch.equal(c, copies[0]) for c in copies), f"{name} differs across TP ranks (sp={sp})"


TP = pytest.mark.parametrize("tp", [1, 2, 4], ids=lambda tp: f"tp{tp}")
SP = pytest.mark.parametrize("sp", [False, True], ids=["no_sp", "sequence_parallel"])


@SP
@TP
@pytest.mark.parametrize("model_type", hf_parity.DECODERS)
def test_parallelized_decoder_matches_hf(ranks4, model_type, tp, sp):
    ranks4.run(hf_parity.check_parity, model_type, tp, sp)


@TP
@pytest.mark.parametrize("model_type,model_cls", [(t, cls) for t, classes in hf_parity.ENCODER_TASKS.items()
                                                  for cls in classes], ids=lambda v: getattr(v, "__name__", v))
def test_parallelized_encoder_task_model_matches_hf(ranks4, model_type, model_cls, tp):
    ranks4.run(hf_parity.check_encoder_parity, model_type, tp, model_cls)


@SP
def test_dropout_training_keeps_tp_replicas_equal(ranks4, sp):
    ranks4.run(check_dropout_training_keeps_tp_replicas_equal, "gpt2", 2, sp)


# --- registry and plan derivation: single process ---


def test_register_patch_duplicate_model_type_raises():
    tp.registered_model_types()  # bundled patches registered
    with pytest.raises(ValueError, match="'llama' is already registered"):
        nxd_hf.register_patch(nxd_hf.ModelPatch(model_type="llama", plan={}))


def test_get_patch_unknown_model_type_without_hf_plan_lists_supported():
    config = transformers.PretrainedConfig()
    config.model_type = "made_up_arch"
    with pytest.raises(ValueError, match="made_up_arch") as info:
        tp.get_patch(config)
    assert "llama, " in str(info.value) and "qwen3" in str(info.value) and "register_patch" in str(info.value)


def test_patch_from_hf_plan_unknown_style_raises():
    with pytest.raises(ValueError, match="'diagonalwise'"):
        patch_from_hf_plan("x", {"layers.*.mlp.up_proj": "diagonalwise"})


def test_derived_phi_patch_maps_styles_by_module_name():
    patch = tp.get_patch(transformers.PhiConfig())
    assert patch.decoder_layers == "layers"
    assert patch.plan["embed_tokens"] == tp.Embedding()
    assert isinstance(patch.plan["layers.*.self_attn"], tp.Attention)
    assert patch.plan["layers.*.self_attn.q_proj"] == tp.Column(heads="q")
    assert patch.plan["layers.*.self_attn.v_proj"] == tp.Column(heads="kv")
    assert patch.plan["layers.*.self_attn.dense"] == tp.Row(heads="q")  # output projection: sibling of q_proj
    assert patch.plan["layers.*.mlp"] == tp.ParallelRegion()
    assert patch.plan["layers.*.mlp.fc1"] == tp.Column() and patch.plan["layers.*.mlp.fc2"] == tp.Row()


def test_derived_patch_hf_style_variants():
    plan = patch_from_hf_plan("x", {
        "layers.*.attn.query": "local_colwise", "layers.*.attn.key": "colwise", "layers.*.attn.out": "local_rowwise",
        "layers.*.norm": "sequence_parallel", "layers.*.attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.mlp.gate_up_proj": "packed_colwise", "layers.*.mlp.down_proj": "rowwise_rep",
        "layers.*.head": "colwise_rep",
    }).plan
    assert plan["layers.*.attn.query"] == tp.Column(heads="q") and plan["layers.*.attn.key"] == tp.Column(heads="kv")
    assert plan["layers.*.attn.out"] == tp.Row(heads="q")
    assert "layers.*.norm" not in plan and plan["layers.*.attn.q_norm"] == tp.PerHeadNorm()
    assert plan["layers.*.mlp.gate_up_proj"] == tp.Column(stride=2)
    assert plan["layers.*.mlp.down_proj"] == tp.Row(input_is_parallel=False)
    assert plan["layers.*.head"] == tp.Column(gather_output=True) and "layers.*" not in plan  # no region: the layer


def test_derived_patch_with_gathered_projections_has_no_sequence_parallel():
    # OLMo-2 gathers q/k/v (its q_norm spans all heads) and splits o_proj's input
    assert patch_from_hf_plan("llama", transformers.LlamaConfig.base_model_tp_plan).sequence_parallel
    assert not patch_from_hf_plan("olmo2", transformers.Olmo2Config.base_model_tp_plan).sequence_parallel


def test_derived_cohere_with_per_head_qk_norm_raises():
    with pytest.raises(ValueError, match="use_qk_norm=True"):
        tp.get_patch(transformers.CohereConfig(use_qk_norm=True))
