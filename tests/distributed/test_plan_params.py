"""``nxd_hf.plan``'s parameters per rank equal, byte for byte, what ``nxd_hf.parallelize`` leaves
on each rank of a real parallel model: padded heads and vocab, replicated K/V heads, tied
embeddings held by two pipeline stages, fused projections, per-head norms, LoRA adapters."""

import pytest
import torch

import nxd_hf
from nxd_hf import parallel_state
from nxd_hf.plan.memory import stage_layers
from nxd_hf.plan.shapes import meta_model, rank_params
from support import hf_parity


LORA_TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def tiny_config(model_type: str):
    config_class, _, kwargs = hf_parity.TINY[model_type]
    return config_class(**kwargs)


def lora_config():
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS)


def _init(module) -> None:
    with torch.no_grad():
        for param in module.parameters(recurse=False):
            param.normal_(0.0, 0.02)


def local_param_bytes(model_type: str, lora: bool = False) -> dict:
    """Bytes of the unique parameters this rank holds (and of its LoRA adapters)."""
    _, model_class, _ = hf_parity.TINY[model_type]
    with torch.device("meta"):
        model = model_class(tiny_config(model_type))
    tp, pp = parallel_state.get_tensor_model_parallel_size(), parallel_state.get_pipeline_model_parallel_size()
    torch.manual_seed(0)  # data-parallel replicas must start alike
    model = nxd_hf.parallelize(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, param_init_fn=_init,
                               lora_config=lora_config() if lora else None,
                               **({"num_microbatches": 2} if pp > 1 else {}))
    params = {id(p): p for p in model.parameters()}.values()
    adapters = [p for p in params if p.requires_grad] if lora else []
    return dict(pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                param_bytes=sum(p.numel() * p.element_size() for p in params),
                lora_bytes=sum(p.numel() * p.element_size() for p in adapters))


def train_with_auto_sizes(out_dir: str) -> dict:
    """NxDTrainer with tensor_parallel_size="auto": the plan picks the size, training runs on it."""
    import math

    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama")
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, hf_parity.VOCAB, (8, 16), generator=generator)]
    args = nxd_hf.NxDTrainingArguments(output_dir=out_dir, tensor_parallel_size="auto", max_steps=2, logging_steps=1,
                                       per_device_train_batch_size=2, report_to=[], save_strategy="no",
                                       disable_tqdm=True)
    trainer = nxd_hf.NxDTrainer(model, args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(math.isfinite(x) for x in losses)
    return dict(tp=args.tensor_parallel_size, groups_tp=parallel_state.get_tensor_model_parallel_size())


def recompute_comm_bytes(sequence_parallel: bool, seq: int = 16) -> dict:
    """Payload bytes this rank hands to collectives in one training step of the tiny llama at the
    current tp with every decoder layer recomputed, beside ``nxd_hf.plan``'s terms for it."""
    from nxd_hf import backend
    from nxd_hf.plan.api import plan

    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama")
    tp = 2
    model = nxd_hf.parallelize(model, tensor_parallel_size=tp, sequence_parallel=sequence_parallel,
                               activation_checkpoint_config="full", check_inputs=False)
    ids, labels = hf_parity.batch(b=2, s=seq)
    with backend.count_comm() as records:
        model(input_ids=ids, labels=labels).loss.backward()
    predicted = plan(tiny_config("llama"), world_size=tp, device_memory="1TB", seq_len=seq, micro_batch_size=2,
                     global_batch_size=2, device="cpu",
                     fixed=dict(tp=tp, pp=1, sequence_parallel=sequence_parallel, recompute=True, zero_1=False))
    return dict(measured=sum(r.payload_bytes for r in records),
                predicted=sum(t.payload_bytes for t in predicted.ranked[0].comm))


def parallelize_with_auto_sizes() -> dict:
    """``nxd_hf.parallelize(tensor_parallel_size="auto")``: the plan's sizes, the same on every
    rank, and the model equal to HF at them."""
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair("llama")
    model = nxd_hf.parallelize(model, tensor_parallel_size="auto")
    ids, labels = hf_parity.batch()
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, reference(input_ids=ids, labels=labels).loss,
                               rtol=1e-4, atol=1e-5)
    return dict(tp=parallel_state.get_tensor_model_parallel_size(), pp=parallel_state.get_pipeline_model_parallel_size())


def saved_activation_bytes(model_type: str, sequence_parallel: bool, overrides: dict, batch: int = 2,
                           seq: int = 16) -> dict:
    """Bytes autograd saves in each decoder layer of this rank in a training forward of the tiny
    model at tp = world (unique storages, parameters excluded), beside ``nxd_hf.plan``'s trace."""
    from nxd_hf.architectures import get_patch
    from nxd_hf.plan.activations import decoder_layers, trace_activations
    from nxd_hf.plan.shapes import meta_model, rank_params

    parallel_state.destroy_model_parallel()
    config_class, model_class, kwargs = hf_parity.TINY[model_type]
    config = config_class(**{**kwargs, **overrides})
    with torch.device("meta"):
        model = model_class(config)
    tp = torch.distributed.get_world_size()
    model = nxd_hf.parallelize(model, tensor_parallel_size=tp, sequence_parallel=sequence_parallel,
                               param_init_fn=_init, check_inputs=False)
    model.train()
    where = [None]
    for index, layer in enumerate(decoder_layers(model, get_patch(config))):
        layer.register_forward_pre_hook(lambda m, a, i=index: where.__setitem__(0, i))
        layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, None))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    found = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if where[0] is not None and key not in params:
            found.setdefault(key, (where[0], t.untyped_storage().nbytes()))  # a shared tensor: its first layer
        return t

    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids)
    measured = {}
    for layer, nbytes in found.values():
        measured[layer] = measured.get(layer, 0) + nbytes
    trace = trace_activations(config, micro_batch_size=batch, seq_len=seq, device="cpu")
    fractions = rank_params(config, meta_model(config), tp=tp).fractions
    predicted = {i: trace.place_bytes(i, tp=tp, sequence_parallel=sequence_parallel, fractions=fractions)
                 for i in measured}
    return dict(measured=measured, predicted=predicted)


def predicted_bytes(model_type: str, tp: int, pp: int, pp_rank: int, lora: bool) -> tuple[int, int]:
    config = tiny_config(model_type)
    counts = rank_params(config, meta_model(config), tp=tp, lora_config=lora_config() if lora else None)
    layers = stage_layers(config.num_hidden_layers, pp)[pp_rank]
    first, last = pp_rank == 0, pp_rank == pp - 1
    base = counts.stage(layers, first=first, last=last) * 4
    adapters = counts.stage(layers, first=first, last=last, lora=True) * 4
    return base + adapters, adapters


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (4, 1), (2, 2), (1, 2)])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt2", "gpt_neox", "qwen3", "phi3"])
def test_param_bytes_per_rank_equal_the_plan(ranks4, model_type, tp, pp):
    for rank in ranks4.run(local_param_bytes, model_type, model_parallel=(tp, pp)):
        expected, _ = predicted_bytes(model_type, tp, pp, rank["pp_rank"], lora=False)
        assert rank["param_bytes"] == expected, (model_type, tp, pp, rank)


@pytest.mark.parametrize("tp,pp", [(2, 1), (4, 1), (2, 2)])
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_lora_param_bytes_per_rank_equal_the_plan(ranks4, model_type, tp, pp):
    for rank in ranks4.run(local_param_bytes, model_type, lora=True, model_parallel=(tp, pp)):
        expected, adapters = predicted_bytes(model_type, tp, pp, rank["pp_rank"], lora=True)
        assert (rank["param_bytes"], rank["lora_bytes"]) == (expected, adapters), (model_type, tp, pp, rank)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_recompute_comm_bytes_equal_the_plan(ranks2, sequence_parallel):
    """Activation checkpointing re-runs each layer's forward collectives up to its last saved tensor
    (torch's non-reentrant checkpoint stops early): the plan counts them as measured."""
    for result in ranks2.run(recompute_comm_bytes, sequence_parallel):
        assert result["measured"] == result["predicted"], result


@pytest.mark.parametrize("model_type,sequence_parallel,overrides", [
    ("gpt2", False, dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)),  # Conv1D, dropout masks, math SDPA
    ("phi3", True, {}),  # fused qkv/gate_up, each column layer's own gathered input
    ("llama", True, {}),  # GQA, biases
])
def test_saved_activation_bytes_per_layer_equal_the_plan(ranks2, model_type, sequence_parallel, overrides):
    """The plan's trace (one unsharded meta-device forward) priced at tp=2 equals, byte for byte,
    what autograd saves in each decoder layer of a real tp=2 rank."""
    for result in ranks2.run(saved_activation_bytes, model_type, sequence_parallel, overrides):
        assert result["measured"] == result["predicted"], result


def test_parallelize_takes_auto_sizes(ranks2):
    sizes = ranks2.run(parallelize_with_auto_sizes)
    assert sizes[0] == sizes[1] and 2 % (sizes[0]["tp"] * sizes[0]["pp"]) == 0, sizes


def test_trainer_resolves_auto_tensor_parallel_size(ranks2, tmp_path):
    results = ranks2.run(train_with_auto_sizes, str(tmp_path))
    assert all(r["tp"] == r["groups_tp"] for r in results)  # the chosen size is the one the model runs at
    assert results[0]["tp"] in (1, 2) and len({r["tp"] for r in results}) == 1
