"""torch.compile of parallelized models: parity with eager HF at tp=1 and
tp=2, and NxDTrainingArguments(torch_compile=True) (no longer refused). The models have one
layer: dynamo traces every layer's code again (inlined), so a second one doubles the tracing
time and compiles nothing new."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import nxd_hf
from nxd_hf import parallel_state
from nxd_hf.parallel_layers import fused_loss as fused_loss_module
from support import hf_parity


TOL = hf_parity.TOL


def check_compiled_model(tp: int, fused_loss: bool = False) -> int:
    """Loss and every gathered gradient of ``torch.compile(parallelize(model))`` equal the HF
    model's, two steps; the second reuses the compiled graphs (the backend is not called again).
    Returns the frames dynamo compiled (counted by the backend: no second tracing pass).
    ``fused_loss``: the chunked loss traced too (three chunks of 6 tokens)."""
    parallel_state.destroy_model_parallel()
    torch._dynamo.reset()
    reference, model = hf_parity.build_pair("llama", num_hidden_layers=1)
    nxd_hf.parallelize(model, tensor_parallel_size=tp, check_inputs=False, fused_loss=fused_loss)
    chunk_elements = fused_loss_module.CHUNK_ELEMENTS
    fused_loss_module.CHUNK_ELEMENTS = 6 * model.lm_head.weight.shape[0]  # 16 tokens: three chunks
    try:
        return _two_compiled_steps(reference, model, tp)
    finally:
        fused_loss_module.CHUNK_ELEMENTS = chunk_elements


def _two_compiled_steps(reference, model, tp: int) -> int:
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    frames = []
    for step in range(2):
        ids, labels = hf_parity.batch(seed=step)
        ref_loss = reference(input_ids=ids, labels=labels).loss
        loss = compiled(input_ids=ids, labels=labels).loss
        ref_loss.backward(), loss.backward()
        torch.testing.assert_close(loss, ref_loss, **TOL)
        ref_params = dict(reference.named_parameters())
        for name, param in model.named_parameters():
            torch.testing.assert_close(hf_parity.gathered_grad(param), ref_params[name].grad, **TOL,
                                       msg=lambda m: f"tp={tp} step {step} {name}: {m}")
            param.grad = ref_params[name].grad = None
        frames.append(counter.frame_count)
    assert frames[1] == frames[0], f"tp={tp}: the second step recompiled ({frames} frames after each step)"
    return frames[1]


def check_trainer(out_dir: str) -> None:
    """``NxDTrainingArguments(torch_compile=True)``: accepted, the model trained compiled, and three
    steps log the losses of the same run uncompiled."""
    losses = {}
    for compile_ in (False, True):
        parallel_state.destroy_model_parallel()
        torch._dynamo.reset()
        _, model = hf_parity.build_pair("llama", num_hidden_layers=1)
        args = nxd_hf.NxDTrainingArguments(
            output_dir=f"{out_dir}/{compile_}", tensor_parallel_size=2, max_steps=3, per_device_train_batch_size=2,
            learning_rate=1e-3, report_to=[], save_strategy="no", logging_steps=1, torch_compile=compile_,
            # dynamo's capture alone ("eager"): check_compiled_model runs AOT autograd ("aot_eager") on the same model
            torch_compile_backend="eager" if compile_ else None)
        g = torch.Generator().manual_seed(3)
        data = [{"input_ids": ids, "labels": ids.clone()}
                for ids in torch.randint(0, hf_parity.VOCAB, (6, 8), generator=g)]
        trainer = nxd_hf.NxDTrainer(model, args, train_dataset=data)
        trainer.train()
        assert (model._compiled_call_impl is not None) == compile_, "torch_compile=True compiles the model in place"
        losses[compile_] = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses[True]) == 3
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), **TOL)


@pytest.mark.parametrize("tp, fused_loss", [(1, False), (2, False), (2, True)],
                         ids=["tp1", "tp2", "tp2-fused_loss"])
def test_compiled_parallel_model_matches_hf(ranks2, tp, fused_loss):
    graphs = ranks2.run(check_compiled_model, tp, fused_loss)
    frames = 3 if fused_loss else 4  # the fused loss is traced with the head: one frame fewer
    assert graphs == [frames] * 2, f"tp={tp}: dynamo compiled {graphs} frames per rank (docs/gpu_speed.md: {frames})"


def test_nxd_trainer_torch_compile_tp2(ranks2, tmp_path):
    ranks2.run(check_trainer, str(tmp_path))
