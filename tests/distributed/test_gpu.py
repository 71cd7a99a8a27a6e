"""The GPU lane (``make test-gpu``): the parity cases that matter, on a GPU.

Marked ``cuda`` and skipped without one. Two to four ranks share the one GPU through
``NXD_HF_BACKEND=cuda:gloo``: gloo for CUDA tensors only, so — as under nccl — a control tensor
left on the CPU fails its collective, and pipeline sends go through the CPU staging path
(``nxd_hf.backend.p2p_device``). One-rank cases run on nccl itself. The cases are the CPU
suite's own case functions (the tests' own case functions and tests/support/); ``hf_parity`` puts the
reference models and batches on the backend's device, the models under test start on the CPU
as a model loaded the usual way, so nxd_hf has to place them.
"""

import os
import subprocess
import sys

import pytest
import torch

from support import ckpt
from support import hf_parity, lora
from support.scripts import loss_fell
import test_architectures
import test_checkpoint
import test_examples
import test_fused_loss
import test_layers
import test_lora
import test_nxd_trainer
import test_pipeline
import test_trainer_api
import test_zero1
from nxd_hf import parallel_state
from nxd_hf.testing import run_distributed

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: run `make test-gpu` on a GPU machine")]


@pytest.fixture
def cuda_gloo(monkeypatch):
    """Spawned ranks share the GPU through gloo for CUDA tensors (nccl refuses 2 ranks on 1 GPU)."""
    monkeypatch.setenv("NXD_HF_BACKEND", "cuda:gloo")


@pytest.fixture
def nccl(monkeypatch):
    monkeypatch.setenv("NXD_HF_BACKEND", "nccl")


def _on_gpu() -> str:
    from nxd_hf import backend

    device = backend.default_device()
    assert device.type == "cuda", device
    return str(device)


def _tp_parity_world2():
    _on_gpu()
    for model_type in ("llama", "gpt2", "qwen2", "phi3"):
        for sp in (False, True):
            hf_parity.check_parity(model_type, 2, sp)
    return True


def test_tp2_parity(cuda_gloo):
    """TP block: logits, loss and gathered gradients at tp=2 (with and without SP) vs plain HF."""
    assert run_distributed(_tp_parity_world2, 2, timeout_s=600) == [True, True]


def _architectures_world2():
    for model_type, (expected, with_sp) in test_architectures.CASES.items():
        for sp in (False, True) if with_sp else (False,):
            result, _ = test_architectures.architecture_case(model_type, sp)
            assert result.status == expected, f"{model_type} sp={sp}: {result.message}"
    return True


def test_architectures_tp2(cuda_gloo):
    assert run_distributed(_architectures_world2, 2, timeout_s=600) == [True, True]


def _layers_world4():
    from nxd_hf import parallel_state

    for tp in (2, 4):
        parallel_state.initialize_model_parallel(tp, 1)
        for sp in (False, True):
            test_layers.check_column(10, True, False, sp)
            test_layers.check_row(10, True, True, sp)
            test_layers.check_embedding(11, None, sp)
            test_layers.check_gqa(6, 2, True, False, sp)
        parallel_state.destroy_model_parallel()
    return True


def test_layers_world4(cuda_gloo):
    assert run_distributed(_layers_world4, 4, timeout_s=600) == [True] * 4


def _pipeline_world2():
    for model_type in ("llama", "gpt2"):
        test_pipeline.check_pipeline(model_type)
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zbv"):
        test_pipeline.check_pipeline("llama", schedule=schedule,
                                     **({"virtual_pipeline_size": 2} if schedule in ("interleaved_1f1b", "zbv") else {}))
    return True


def test_pipeline_pp2(cuda_gloo):
    """pp=2: sends staged through the CPU (gloo cannot send CUDA tensors)."""
    assert run_distributed(_pipeline_world2, 2, timeout_s=600) == [True, True]


def _zero1_world4():
    for tp, accumulate in ((2, 1), (1, 2), (4, 1)):
        test_zero1.with_small_chunks(test_zero1.zero1_matches_reference, tp, accumulate)
    return True


def test_zero1_world4(cuda_gloo):
    assert run_distributed(_zero1_world4, 4, timeout_s=600) == [True] * 4


def _lora_world2():
    for model_type, tp, kwargs in test_lora.TRAINING_TP2.values():
        lora.check_training(model_type, tp, **kwargs)
    return True


def test_lora_world2(cuda_gloo):
    assert run_distributed(_lora_world2, 2, timeout_s=600) == [True, True]


def _checkpoints_world2(root):
    for layout, kwargs in test_checkpoint.ROUND_TRIPS_WORLD2.items():
        test_checkpoint.round_trip(os.path.join(root, layout), **kwargs)
    test_checkpoint.save_tp2_for_world1(root)
    return True


def test_checkpoints_saved_on_gpu_load_at_other_layouts(tmp_path, monkeypatch):
    """Round trips at tp=2, pp=2, dp=2+ZeRO-1 and tp=2 -> pp=2 on 2 ranks; then the tp=2
    checkpoint loads on one nccl rank and trains on exactly."""
    monkeypatch.setenv("NXD_HF_BACKEND", "cuda:gloo")
    assert run_distributed(_checkpoints_world2, 2, str(tmp_path), timeout_s=600) == [True, True]
    monkeypatch.setenv("NXD_HF_BACKEND", "nccl")
    run_distributed(test_checkpoint.run_world1, 1, str(tmp_path))


def _trainer_world2():
    for layout in ("tp2", "pp2", "dp2_zero1_accumulate2", "tp2_lora"):
        test_nxd_trainer.check_matches_trainer(layout)
    return True


def test_nxd_trainer_matches_trainer(cuda_gloo):
    """tp=2, pp=2, dp=2+ZeRO-1 with accumulation, tp=2 LoRA: NxDTrainer against Trainer."""
    assert run_distributed(_trainer_world2, 2, timeout_s=600) == [True, True]


def test_nxd_trainer_checkpoints(cuda_gloo, tmp_path):
    run_distributed(test_nxd_trainer.check_checkpoints_and_resume, 2, str(tmp_path), timeout_s=600)


def test_config_api_dp2_zero1_matches_single_process(cuda_gloo):
    run_distributed(test_trainer_api.check_matches_single_process, 2, timeout_s=600)


def _one_rank_cases():
    _on_gpu()
    for model_type in ("llama", "gpt2"):
        hf_parity.check_parity(model_type, 1, False)  # a CPU-loaded model placed on the GPU
    model, optimizer, scheduler, _ = ckpt.build(zero1=True)
    assert next(model.parameters()).device.type == "cuda"
    ckpt.train(model, optimizer, scheduler, 2)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1)
    test_fused_loss.check_kernels_on_gpu()  # the compiled Triton kernels
    test_fused_loss.check_model(1, False, True, False)  # fused_loss=True picks them on CUDA
    test_fused_loss.check_model(1, False, False, True, "gemma2")  # soft-capped logits
    return True


def test_one_rank_nccl(nccl):
    assert run_distributed(_one_rank_cases, 1, timeout_s=600) == [True]


@pytest.mark.parametrize("script, args", [
    ("examples/finetune_causal_lm.py", ["--tp", "1", "--max_steps", "20"]),
    ("examples/parallelize_causal_lm.py", ["--steps", "20"]),
])
def test_examples_torchrun_one_gpu(script, args, tmp_path):
    """torchrun --nproc_per_node 1 on nccl (the default with a GPU)."""
    extra = ["--output_dir", str(tmp_path)] if "finetune" in script else []
    loss_fell(test_examples.run_example(script, 1, *args, *extra))


def test_parallelize_example_two_ranks_one_gpu(cuda_gloo):
    loss_fell(test_examples.run_example("examples/parallelize_causal_lm.py", 2, "--steps", "20"))


FINETUNE_LAUNCHES = {  # the launch on two ranks sharing the GPU, and its one-process twin
    "tp2": (["--tp", "2"], ["--tp", "1"], {}),
    "pp2": (["--pp", "2"], [], {}),
    # bf16 autocast: the tp=2 shards' bf16 partial sums round apart from the whole matmul's (bf16 keeps
    # ~3 significant digits; on the CPU the grad norms were 3.5e-4 apart in relative terms, the losses 2e-5)
    "tp2_zero1_lora_bf16": (["--tp", "2", "--zero1", "--lora", "--bf16"], ["--zero1", "--lora", "--bf16"],
                            dict(rtol=5e-3, atol=1e-3)),
}


@pytest.mark.parametrize("launch", list(FINETUNE_LAUNCHES))
def test_finetune_two_ranks_one_gpu_matches_one_process(launch, tmp_path, cuda_gloo):
    """examples/finetune_causal_lm.py under torchrun on two ranks (cuda:gloo) logs the losses and grad
    norms of `python examples/finetune_causal_lm.py` (one rank, nccl) step by step."""
    args, one_process_args, tol = FINETUNE_LAUNCHES[launch]
    steps = ["--max_steps", "8"]
    test_examples.check_matches_one_process("examples/finetune_causal_lm.py", 2, [*args, *steps],
                                            [*one_process_args, *steps], tmp_path, **tol)


def test_sft_example_tp2_matches_one_process(tmp_path, cuda_gloo):
    for module in ("trl", "datasets"):  # not on every GPU image: bring their wheels (docs/gpu.md)
        pytest.importorskip(module)
    steps = ["--max_steps", "6"]
    test_examples.check_matches_one_process("examples/sft_trl.py", 2, ["--tensor_parallel_size", "2", *steps], steps,
                                            tmp_path)


def test_lightning_example_tp2_matches_one_process(tmp_path, cuda_gloo):
    test_examples.check_lightning_matches_one_process(["--tp", "2", "--max-steps", "8"], ["--max-steps", "8"], tmp_path)


def test_liger_conformance_on_gpu():
    """Liger's own test of its fused linear cross-entropy (tests/conformance/liger) on the GPU,
    with every case the CPU suite skips for time: bf16 and fp16 at its large shape, and the
    compiled Triton kernels there."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/conformance/liger"],
                            cwd=test_examples.ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    # 192 cases: 112 ask for what nxd_hf's loss has not (class weights, z-loss, reduction="none"), 80 run
    assert "80 passed, 112 skipped" in result.stdout, result.stdout[-2000:]


def test_plain_python_uses_the_gpu():
    """`python script.py` (no torchrun): a world of one on nccl, on cuda:0."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "NXD_HF_BACKEND")}
    result = subprocess.run([sys.executable, "examples/parallelize_causal_lm.py", "--steps", "10"],
                            cwd=test_examples.ROOT, capture_output=True, text=True, timeout=600, env=env)
    out = test_examples._check(result)
    assert "on cuda:0" in out, out
    loss_fell(out)
