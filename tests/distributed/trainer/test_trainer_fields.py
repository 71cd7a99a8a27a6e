"""Every field of ``NxDTrainingArguments`` and of the config API (``neuronx_distributed_config``)
changes what happens: one check per field that has no other test proving it (the others are
listed below), all in one spawn of 4 ranks."""

import tempfile
import warnings

import pytest
import torch
import transformers

from support import hf_parity
import nxd_hf
from nxd_hf import parallel_state
from nxd_hf.optim.zero1 import NeuronZero1Optimizer
from nxd_hf.parallel_layers.sharding import full_tensor
from nxd_hf.testing import run_distributed

TOL = hf_parity.TOL
COMMON = dict(learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], seed=7, max_grad_norm=0.5,
              disable_tqdm=True)

# Fields whose effect another test already shows:
#   NxDTrainingArguments tensor_parallel_size, per_device_train_batch_size, gradient_accumulation_steps,
#     max_grad_norm (clipping at 0.5), seed: test_nxd_trainer.py::test_nxd_trainer_matches_trainer_world2
#   fp16, train_sampling_strategy (refused), label_smoothing_factor (against Trainer's): test_nxd_trainer.py
#   config tensor_parallel_size, pipeline_parallel_size, pipeline_config, optimizer_config zero_one_enabled and
#     max_grad_norm: test_trainer_api.py::test_config_api_world4 (against single-process training)
#   config model_init_config sequential_move_factor: test_trainer_api.py (check_sequential_build)
#   config mixed_precision_config use_master_weights=True: test_trainer_api.py (check_bf16_tracks_fp32)
#   config mixed_precision_config use_master_weights_in_ckpt: test_checkpoint.py (support/ckpt.py)
#   config lora_config: test_nxd_trainer.py (tp2 lora, through peft_config)
#   config check_inputs, timeout: test_errors.py::test_errors_world2 (errors_world2.py)


def _dataset(n=16, s=8, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(0, hf_parity.VOCAB, (n, s), generator=g)]


def _trainer(out_dir, model=None, **fields):
    parallel_state.destroy_model_parallel()
    if model is None:
        model = hf_parity.build_pair("llama", num_hidden_layers=4)[1]
    args = nxd_hf.NxDTrainingArguments(output_dir=out_dir, per_device_train_batch_size=4, max_steps=3,
                                       **{**COMMON, **fields})
    return nxd_hf.NxDTrainer(model, args, train_dataset=_dataset())


def _one_step(trainer):
    ids, labels = hf_parity.batch(b=4)
    return trainer.nxd_model.run_train(input_ids=ids, labels=labels)


def _local_rows(trainer, name):
    return dict(trainer.nxd_model.named_parameters())[name].shape[0]


def check_kv_size_multiplier(out_dir):
    """tp=4, two K/V heads: the K/V projections hold 2*4/4 head copies per rank with
    kv_size_multiplier=4, 2*2/4 with 'auto' (2); training still equals Trainer's. With one K/V
    head, 2 copies do not split over 4 ranks: a ValueError (the value reached parallelize)."""
    overrides = dict(num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2)  # head_dim 6
    reference, model = hf_parity.build_pair("llama", **overrides)
    trainer = _trainer(out_dir, model, tensor_parallel_size=4, kv_size_multiplier="4")
    for kind in ("k_proj", "v_proj"):
        assert _local_rows(trainer, f"model.layers.0.self_attn.{kind}.weight") == 2 * 6, kind
    trainer.train()
    ref = transformers.Trainer(reference, transformers.TrainingArguments(
        output_dir=f"{out_dir}/ref", per_device_train_batch_size=4, max_steps=3, **COMMON), train_dataset=_dataset())
    ref.train()
    got = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    want = [h["loss"] for h in ref.state.log_history if "loss" in h]
    assert len(got) == 3
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL)
    ref_params = dict(ref.model.named_parameters())
    for name, param in trainer.nxd_model.named_parameters():
        torch.testing.assert_close(full_tensor(param), ref_params[name].detach(), **TOL, msg=lambda m: f"{name}: {m}")
    auto = _trainer(out_dir, hf_parity.build_pair("llama", **overrides)[1], tensor_parallel_size=4)
    assert _local_rows(auto, "model.layers.0.self_attn.k_proj.weight") == 6
    one_kv_head = dict(overrides, num_key_value_heads=1)
    with pytest.raises(ValueError, match="kv_size_multiplier=4"):  # 1 head x 2 copies do not split over 4 ranks
        _trainer(out_dir, hf_parity.build_pair("llama", **one_kv_head)[1], tensor_parallel_size=4,
                 kv_size_multiplier="2")


def check_pipeline_fields(out_dir):
    """pp=2 (x dp=2): microbatches, two local stages, the schedule asked for."""
    trainer = _trainer(out_dir, pipeline_parallel_size=2, num_microbatches=4, virtual_pipeline_size=2,
                       pipeline_schedule="looped_bfs")
    pp_model = trainer.nxd_model.module
    assert (pp_model.num_microbatches, len(pp_model.stages), pp_model.schedule_name) == (4, 2, "looped_bfs")
    assert parallel_state.get_pipeline_model_parallel_size() == 2
    default = _trainer(out_dir, pipeline_parallel_size=2).nxd_model.module
    # num_microbatches unset: one per stage (NxD's default would not train at pp=2; warned)
    assert (default.num_microbatches, len(default.stages), default.schedule_name) == (2, 1, "1f1b")


def _norm_input_lengths(trainer) -> list[int]:
    lengths = []
    norm = trainer.nxd_model.hf_model.model.layers[0].input_layernorm
    handle = norm.register_forward_pre_hook(lambda module, inputs: lengths.append(inputs[0].shape[1]))
    _one_step(trainer)
    handle.remove()
    return lengths


def check_sequence_parallel(out_dir):
    """With sequence_parallel the decoder layer sees [b, s/tp, h]."""
    assert _norm_input_lengths(_trainer(out_dir, tensor_parallel_size=2, sequence_parallel=True)) == [4]
    assert _norm_input_lengths(_trainer(out_dir, tensor_parallel_size=2)) == [8]


def check_zero_1(out_dir):
    assert isinstance(_trainer(out_dir, zero_1=True).create_optimizer(), NeuronZero1Optimizer)
    assert not isinstance(_trainer(out_dir).create_optimizer(), NeuronZero1Optimizer)


def check_pad_model(out_dir):
    """6 heads at tp=4: padded to 8 (2 per rank) unless pad_model='false', which refuses."""
    trainer = _trainer(out_dir, tensor_parallel_size=4, pad_model="true")
    assert _local_rows(trainer, "model.layers.0.self_attn.q_proj.weight") == 2 * 8
    with pytest.raises(ValueError, match="pad_model=False"):
        _trainer(out_dir, tensor_parallel_size=4, pad_model="false")


def check_bf16_master_weights(out_dir):
    """bf16 parameters, fp32 gradient accumulators (main_grad) and fp32 masters in the optimizer."""
    trainer = _trainer(out_dir, tensor_parallel_size=2, bf16_master_weights=True)
    assert trainer.nxd_model.dtype == torch.bfloat16
    _one_step(trainer)
    assert all(p.main_grad.dtype == torch.float32 for p in trainer.nxd_model.parameters())
    optimizer = trainer.create_optimizer()
    assert all(m.dtype == torch.float32 for group in optimizer.masters for m in group.masters)
    assert _trainer(out_dir, tensor_parallel_size=2).nxd_model.dtype == torch.float32


def _attention_calls(trainer) -> int:
    calls = []
    attention = trainer.nxd_model.hf_model.model.layers[0].self_attn
    handle = attention.register_forward_hook(lambda *_: calls.append(1))
    _one_step(trainer)
    handle.remove()
    return len(calls)


def check_gradient_checkpointing(out_dir):
    """Checkpointed layers run their forward again in backward."""
    assert _attention_calls(_trainer(out_dir, tensor_parallel_size=2, gradient_checkpointing=True)) == 2
    assert _attention_calls(_trainer(out_dir, tensor_parallel_size=2)) == 1


def check_bf16_autocast(out_dir):
    """bf16=True: the training step computes in bf16 over the fp32 weights, as Trainer's autocast."""
    for bf16, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        trainer = _trainer(out_dir, tensor_parallel_size=2, bf16=bf16)
        seen = []
        projection = trainer.nxd_model.hf_model.model.layers[0].self_attn.q_proj
        handle = projection.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
        with trainer.compute_loss_context_manager():
            _one_step(trainer)
        handle.remove()
        assert seen == [dtype] and trainer.nxd_model.dtype == torch.float32, (bf16, seen)


def _config(**kwargs):
    parallel_state.destroy_model_parallel()
    return nxd_hf.neuronx_distributed_config(tensor_parallel_size=2, **kwargs)


def _bf16_model():
    return hf_parity.build_pair("llama")[1].to(torch.bfloat16)


def check_config_fields():
    """The config API fields the Trainer path does not set."""
    def init(module):
        for param in module.parameters(recurse=False):
            torch.nn.init.constant_(param, 0.25)

    built_on = []

    def on_meta():
        model = hf_parity.build_pair("llama")[1]
        built_on.append(model.lm_head.weight.device.type)
        return model

    config = _config(model_init_config={"meta_device_init": True, "param_init_fn": init})
    model = nxd_hf.initialize_parallel_model(config, on_meta)
    assert built_on == ["meta"]
    assert all(bool((p == 0.25).all()) for p in model.parameters())

    for fp32_acc in (True, False):  # use_fp32_grad_acc: an fp32 main_grad per bf16 parameter, or none
        config = _config(mixed_precision_config={"use_fp32_grad_acc": fp32_acc})
        model = nxd_hf.initialize_parallel_model(config, _bf16_model)
        ids, labels = hf_parity.batch()
        model.run_train(input_ids=ids, labels=labels)
        assert all((getattr(p, "main_grad", None) is not None) == fp32_acc for p in model.parameters())

    for masters in (True, False):  # use_master_weights: the optimizer steps fp32 copies, or the bf16 parameters
        config = _config(mixed_precision_config={"use_master_weights": masters})
        model = nxd_hf.initialize_parallel_model(config, _bf16_model)
        optimizer = nxd_hf.initialize_parallel_optimizer(config, torch.optim.AdamW, model.parameters(), lr=1e-3)
        dtypes = {m.dtype for group in optimizer.masters for m in group.masters}
        assert dtypes == {torch.float32 if masters else torch.bfloat16}, (masters, dtypes)

    for clipping in (True, False):  # grad_clipping: the norm is computed (and clipped to) only when on
        config = _config(optimizer_config={"grad_clipping": clipping})
        model = nxd_hf.initialize_parallel_model(config, lambda: hf_parity.build_pair("llama")[1])
        optimizer = nxd_hf.initialize_parallel_optimizer(config, torch.optim.SGD, model.parameters(), lr=1e-3)
        ids, labels = hf_parity.batch()
        model.run_train(input_ids=ids, labels=labels)
        optimizer.step()
        assert (optimizer.grad_norm is not None) == clipping

    config = _config(kv_size_multiplier=2)  # the config API's own field (not in NxD); "auto" would be 1
    model = nxd_hf.initialize_parallel_model(config, lambda: hf_parity.build_pair("llama")[1])  # 2 K/V heads
    assert dict(model.named_parameters())["model.layers.0.self_attn.k_proj.weight"].shape[0] == 2 * 8
    config = _config(optimizer_config={"zero_one_enabled": True}, mixed_precision_config={"use_master_weights": False})
    model = nxd_hf.initialize_parallel_model(config, _bf16_model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nxd_hf.initialize_parallel_optimizer(config, torch.optim.AdamW, model.parameters(), lr=1e-3)
    ignored = [w for w in caught if "use_master_weights=False is ignored" in str(w.message)]
    assert len(ignored) == (torch.distributed.get_rank() == 0), caught  # once, from rank 0


def world4_cases():
    with tempfile.TemporaryDirectory() as out_dir:
        check_kv_size_multiplier(out_dir)
        check_pipeline_fields(out_dir)
        check_sequence_parallel(out_dir)
        check_zero_1(out_dir)
        check_pad_model(out_dir)
        check_bf16_master_weights(out_dir)
        check_gradient_checkpointing(out_dir)
        check_bf16_autocast(out_dir)
        check_config_fields()
    return True


def test_fields_change_behaviour_world4():
    assert run_distributed(world4_cases, 4, timeout_s=600) == [True] * 4


@pytest.mark.parametrize("field,value,message", [
    ("fsdp", "no_shard", "plain data parallelism"),  # full_shard, offload, hybrid_shard: tests/distributed/test_fsdp.py
    ("deepspeed", "ds_config.json", "deepspeed is not used"),
])
def test_refused_hf_fields(field, value, message):
    with pytest.raises(ValueError, match=message):
        nxd_hf.NxDTrainingArguments(output_dir="unused", report_to=[], **{field: value})


@pytest.mark.parametrize("field,value", [("num_microbatches", 4), ("virtual_pipeline_size", 2),
                                         ("pipeline_schedule", "gpipe")])
def test_pipeline_fields_without_pipeline_warn(field, value):
    with pytest.warns(UserWarning, match=f"{field} is ignored: pipeline_parallel_size is 1"):
        nxd_hf.NxDTrainingArguments(output_dir="unused", report_to=[], **{field: value})


def test_kv_size_multiplier_reaches_the_config():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = nxd_hf.NxDTrainingArguments(output_dir="unused", report_to=[], kv_size_multiplier="4")
    assert args.nxd_config().kv_size_multiplier == 4
    parallel_state.destroy_model_parallel()


def test_config_api_kv_size_multiplier_is_type_checked():
    with pytest.raises(ValueError, match="kv_size_multiplier.*wrong type"):
        nxd_hf.neuronx_distributed_config(kv_size_multiplier="8")


def test_use_cpu_is_dropped_without_a_gpu():
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="use_cpu=True on a machine with a GPU"):
            nxd_hf.NxDTrainingArguments(output_dir="unused", report_to=[], use_cpu=True)
    else:  # accelerate would otherwise wrap the model in DDP over every rank
        assert nxd_hf.NxDTrainingArguments(output_dir="unused", report_to=[], use_cpu=True).use_cpu is False


def test_default_arguments_warn_nothing():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nxd_hf.NxDTrainingArguments(output_dir="unused", report_to=[])  # num_microbatches unset
        nxd_hf.NxDTrainingArguments(output_dir="unused", report_to=[], num_microbatches=1)
    assert not [str(w.message) for w in caught]


def check_warnings_once(out_dir: str) -> dict:
    """Two short runs (tp=1 dp=2, tp=2 with ZeRO-1 over one DP rank): this rank's warnings and
    transformers' training-arguments log records."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers.training_args")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _trainer(f"{out_dir}/dp2").train()
            _trainer(f"{out_dir}/tp2", tensor_parallel_size=2, zero_1=True).train()
    finally:
        logger.removeHandler(handler)
    return {"warnings": [str(w.message) for w in caught], "logged": [r.getMessage() for r in records]}


def test_a_true_warning_once_from_rank_0_and_no_false_one(ranks2, tmp_path):
    """transformers' DDP notice is false under nxd_hf (it does the parallelism); torch's pin_memory
    notice (no accelerator here) and ZeRO-1's notice at dp=1 are true and every rank would give them."""
    rank0, rank1 = ranks2.run(check_warnings_once, str(tmp_path))
    assert not [m for r in (rank0, rank1) for m in r["logged"] if "ParallelMode.DISTRIBUTED" in m], (rank0, rank1)
    assert rank1["warnings"] == [], rank1["warnings"]
    pin = [m for m in rank0["warnings"] if "'pin_memory'" in m]
    assert bool(pin) != torch.accelerator.is_available(), rank0["warnings"]  # per DataLoader iterator under "always"
    assert len([m for m in rank0["warnings"] if "nothing to shard" in m]) == 1, rank0["warnings"]
    assert not [m for m in rank0["warnings"] if "ignored" in m], rank0["warnings"]


def check_packed_rows(out_dir: str) -> dict:
    """DataCollatorWithFlattening's one packed row per batch, at tp=2 and at dp=2 (where the second
    replica can only train on a stand-in row): Trainer's training, and this rank's warnings."""
    from test_nxd_trainer import COMMON as TRAINER_COMMON, _check_training, one_process_reference_args

    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(24):
        ids = torch.randint(0, hf_parity.VOCAB, (4 + i % 7,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": list(ids)})
    collator = transformers.DataCollatorWithFlattening()
    caught_all = []
    for layout in (dict(tensor_parallel_size=2), dict()):
        parallel_state.destroy_model_parallel()
        reference, model = hf_parity.build_pair("llama")
        dp = 2 // layout.get("tensor_parallel_size", 1)
        ref = transformers.Trainer(reference, one_process_reference_args(
            output_dir=f"{out_dir}/ref", per_device_train_batch_size=4 * dp, **TRAINER_COMMON),
            train_dataset=rows, data_collator=collator)
        ref.train()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours = nxd_hf.NxDTrainer(model, nxd_hf.NxDTrainingArguments(
                output_dir=f"{out_dir}/nxd", per_device_train_batch_size=4, **TRAINER_COMMON, **layout),
                train_dataset=rows, data_collator=collator)
            ours.train()
        _check_training(ref, ours, f"packed rows {layout}")
        caught_all.append([str(w.message) for w in caught if "single packed rows" in str(w.message)])
    return caught_all


def test_packed_rows_train_as_under_trainer_and_warn_at_dp2(ranks2, tmp_path):
    rank0, rank1 = ranks2.run(check_packed_rows, str(tmp_path))
    assert rank0[0] == [] and len(rank0[1]) == 1 and rank1 == [[], []], (rank0, rank1)  # tp=2: no warning
