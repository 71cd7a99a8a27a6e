"""Every code sample of the reference documents in ``shared/reference/`` (beside the checkout) that names an API
nxd_hf provides runs as its own test, adapted only by the import (``neuronx_distributed`` ->
``nxd_hf``) and tiny sizes, compared with a one-process reference where it computes something
(bodies in ``reference_sample_cases.py``; all run in one world-2 spawn). The samples that
cannot run here are listed below with the reason and the nxd_hf code that runs instead."""

import pytest

import nnscaler_sample_cases
import reference_sample_cases
from nxd_hf.testing import run_distributed

# (document, sample) -> the case in reference_sample_cases that runs it
RUNS = {
    ("nxd-core-api.rst", "parallel_state: initialize_model_parallel and the helper APIs"): "core_parallel_state",
    ("nxd-core-api.rst", "ParallelEmbedding / ColumnParallelLinear / RowParallelLinear, move_model_to_device"):
        "core_parallel_layers",
    ("nxd-core-api.rst", "pad_model usage: divide(num_heads + get_number_of_extra_heads), wrapped_classes, "
                         "pad_hook_fn"): "core_pad_model",
    ("nxd-core-api.rst", "parallel_cross_entropy(parallel_logits, labels, label_smoothing)"):
        "core_parallel_cross_entropy",
    ("nxd-core-api.rst", "NxDPPModel(...) with every argument; run_train, run_eval, local_named_parameters, "
                         "local_named_modules"): "core_nxdppmodel_signature",
    ("nxd-pipeline-parallel-guide.rst", "Creating Model + create_partition + move_model_to_device"):
        "pp_guide_creating_model",
    ("nxd-pipeline-parallel-guide.rst", "Mixed precision: torch.autocast around run_train"):
        "pp_guide_mixed_precision",
    ("nxd-pipeline-parallel-guide.rst", "init_on_device(meta) + init_weights as param_init_fn"):
        "pp_guide_meta_device_init",
    ("nxd-pipeline-parallel-guide.rst", "Gradient checkpointing: CheckPointWrapper + apply_checkpoint"):
        "pp_guide_apply_checkpoint",
    ("nxd-pipeline-parallel-guide.rst", "HF models: a subclass keeping the HF class name"): "pp_guide_hf_class_name",
    ("nxd-pipeline-parallel-guide.rst", "Auto partition; interleaved virtual_pipeline_size"):
        "pp_guide_auto_partition_and_interleaving",
    ("nxd-tensor-parallel-guide.rst", "Creating DataLoader: DistributedSampler over the DP ranks"):
        "tp_guide_dataloader",
    ("nxd-tensor-parallel-guide.rst", "ParallelSelfAttention / ParallelSelfOutput (BERT), the final training "
                                      "script with clip_grad_norm, Saving Model with parallel_layers.save"):
        "tp_guide_bert_and_training_script",
    ("nxd-tensor-parallel-guide.rst", "The guide's model (ParallelSelfAttention / ParallelSelfOutput) as the config "
                                      "API's model_fn, at tp=2 and dp=2 + ZeRO-1, save/load_checkpoint across them"):
        "tp_guide_model_through_config_api",
    ("nxd-training-api.txt", "neuronx_distributed_config / initialize_parallel_model (NxDModel methods) / "
                             "initialize_parallel_optimizer"): "api_config_model_optimizer",
    ("nxd-training-api.txt", "LoraConfig; LoRA save (adapter only) and load_lora_from_ckpt"): "api_lora",
    ("nxd-training-api.txt", "Sample usage: config, model, optimizer, run_train(inputs), save/load_checkpoint"):
        "api_sample_usage",
    ("nxd-training-api.txt", "Sample usage with get_model returning a model built from parallel layers "
                             "(tp=2, ZeRO-1)"): "api_sample_usage_own_model",
    ("nxd-training-api.txt", "GQAQKVColumnParallelLinear(input_size, output_sizes, ..., kv_size_multiplier, "
                             "fuse_qkv)"): "api_gqa_qkv_linear",
    ("nxd-training-api.txt", "clip_grad_norm(parameters, max_norm, norm_type)"): "api_clip_grad_norm",
    ("nxd-training-api.txt", "NeuronZero1Optimizer sample; save_sharded_state_dict / load_sharded_state_dict"):
        "api_zero1_optimizer",
}
"""``LoRAModel(module, LoraConfig)`` and ``parallel_layers.load`` run in ``test_reference_fixes.py``
(``case_lora_model``, ``case_parallel_layers_save_load``)."""

CANNOT_RUN = {
    ("nxd-tensor-parallel-guide.rst", "xm.optimizer_step(optimizer, groups=get_data_parallel_group(as_list=True))"):
        ("torch-xla only (XLA's step with a gradient all-reduce)",
         "optimizer.step() after the model's own DP gradient mean (nxd_hf.parallelize) or "
         "initialize_parallel_optimizer's step; runs in tp_guide_bert_and_training_script"),
    ("nxd-pipeline-parallel-guide.rst", "from torch_xla.utils.checkpoint import checkpoint"):
        ("torch-xla only", "torch.utils.checkpoint.checkpoint (pp_guide_apply_checkpoint), or "
                           "activation_checkpoint_config='full'"),
    ("nxd-pipeline-parallel-guide.rst", "torchdistx deferred_init.deferred_init(LlamaForCausalLM, config)"):
        ("torchdistx is unmaintained and does not build for torch 2.x; a model it built is refused with a "
         "ValueError (test_reference_fixes.py::test_torchdistx_deferred_init_is_refused)",
         "init_on_device(torch.device('meta')) + param_init_fn (pp_guide_meta_device_init)"),
    ("nxd-training-api.txt", "neuronx_distributed.lightning: NeuronLTModule, NeuronXLAStrategy, "
                             "NeuronXLAPrecisionPlugin, NeuronTQDMProgressBar, NeuronTensorBoardLogger"):
        ("PyTorch-Lightning on XLA; not provided by nxd_hf",
         "nxd_hf.NxDTrainer / NxDTrainingArguments (transformers.Trainer) for a managed training loop"),
    ("nxd-training-api.txt", "save(..., save_xser=True) / load(..., load_xser=True), use_xser, async_save"):
        ("torch-xla serialization", "accepted and ignored with a warning: nxd_hf writes safetensors"),
}

NNSCALER = {  # nnscaler-parallel-module.md, by the line its code block starts on:
    # (what it shows, the case in nnscaler_sample_cases running it or the test of another file that runs it, ranks)
    19: ("Example 1: parallelize(LLM, ...) of a whole module class with ComputeConfig",
         "sample_parallelize_module_class", 2),
    49: ("Example 2: parallelize of a submodule inside a plain module", "sample_parallelize_submodule", 2),
    91: ("infer / train with build_optimizer", "test_nnscaler_state.py::test_reference_samples_on_parallel_modules", 2),
    116: ("Example 3: End2EndMLP with dict samples, pipelined", "sample_end2end_pipelined", 2),
    154: ("infer_step / train_step with build_optimizer", "test_nnscaler_state.py::test_reference_samples_on_parallel_modules", 2),
    177: ("BroadcastGenFilesStrategy values", "test_nnscaler_state.py::test_gen_savedir_reuse_and_broadcast", 2),
    222: ("broadcast_weights(parallel_module, plan_ngpus) with broadcast_strategy='no_weights'", "test_nnscaler_state.py::test_reference_samples_on_parallel_modules", 2),
    243: ("parallelize(...) signature", "sample_parallelize_signature", 2),
    319: ("build_optimizer(...) signature", "test_nnscaler_state.py::test_reference_samples_on_parallel_modules", 2),
    368: ("register_reducer_pre_hook / post_hook", "test_nnscaler_state.py::test_reference_samples_on_parallel_modules", 2),
    381: ("ParallelModule.__init__(init_params=True)", "sample_init_params", 2),
    391: ("ParallelModule.train_step(samples, is_dummy_batch, scale_fn)", "sample_train_step", 2),
    415: ("ParallelModule.infer_step(samples)", "sample_train_step", 2),
    439: ("merge_state_dicts", "test_nnscaler_state.py::test_reference_samples_on_parallel_modules", 2),
    459: ("load_merged_state_dicts", "test_nnscaler_state.py::test_reference_samples_on_parallel_modules", 2),
    478: ("deduped_state_dict", "test_nnscaler_state.py::test_reference_samples_on_parallel_modules", 2),
    487: ("load_deduped_state_dict", "test_nnscaler_state.py::test_reference_samples_on_parallel_modules", 2),
    505: ("dataset sampling per unit (DistributedSampler)", "sample_distributed_sampler", 4),
}
"""nnScaler's parallelize/ComputeConfig/ParallelModule run here; the
optimizer, state-dict and broadcast samples are items 6-8."""


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("samples"))
    return run_distributed(reference_sample_cases.run_samples, 2, tmp, sorted(set(RUNS.values())), timeout_s=600)


def test_every_sample_case_is_listed():
    assert {s.__name__ for s in reference_sample_cases.SAMPLES} == set(RUNS.values())


@pytest.mark.parametrize("sample", sorted(set(RUNS.values())))
def test_sample(world2, sample):
    for rank, results in enumerate(world2):
        assert results[sample] is None, f"rank {rank}:\n{results[sample]}"


def _elsewhere(case: str) -> bool:
    return "::" in case


def test_the_samples_run_by_other_tests_name_tests_that_exist():
    """The optimizer, state-dict and broadcast samples run on ParallelModules in test_nnscaler_state.py
    (one world for all of them), not here: one integrity check of that mapping, so a renamed test
    cannot leave a sample unrun (it is not a run of the samples, which those tests are)."""
    import importlib

    missing = []
    for line, (_, case, _) in NNSCALER.items():
        if _elsewhere(case):
            file, test = case.split("::")
            if not callable(getattr(importlib.import_module(file.removesuffix(".py")), test, None)):
                missing.append((line, case))
    assert not missing, missing


@pytest.mark.parametrize("line", sorted(line for line, (_, case, n) in NNSCALER.items() if not _elsewhere(case) and n == 2))
def test_nnscaler_sample_world2(ranks2, tmp_path, line):
    ranks2.run(getattr(nnscaler_sample_cases, NNSCALER[line][1]), str(tmp_path))


@pytest.mark.parametrize("line", sorted(line for line, (_, case, n) in NNSCALER.items() if not _elsewhere(case) and n == 4))
def test_nnscaler_sample_world4(ranks4, tmp_path, line):
    ranks4.run(getattr(nnscaler_sample_cases, NNSCALER[line][1]), str(tmp_path))
