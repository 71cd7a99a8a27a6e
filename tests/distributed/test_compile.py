"""torch.compile of parallelized models: parity with eager HF at tp=1 and
tp=2, and NxDTrainingArguments(torch_compile=True) (no longer refused). The models have one
layer: dynamo traces every layer's code again (inlined), so a second one doubles the tracing
time and compiles nothing new."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import nxd_hf
from nxd_hf import parallel_state
from support import hf_parity


TOL = hf_parity.TOL


def check_compiled_model(tp: int) -> dict:
    """Loss and every gathered gradient of ``torch.compile(parallelize(model))`` equal the HF
    model's, two steps; the second reuses the compiled graphs (the backend is not called again).
    Returns the frames dynamo compiled (counted by the backend: no second tracing pass)."""
    parallel_state.destroy_model_parallel()
    torch._dynamo.reset()
    reference, model = hf_parity.build_pair("llama", num_hidden_layers=1)
    nxd_hf.parallelize(model, tensor_parallel_size=tp, check_inputs=False)
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


@pytest.mark.parametrize("tp", [1, 2])
def test_compiled_parallel_model_matches_hf(ranks2, tp):
    graphs = ranks2.run(check_compiled_model, tp)
    assert graphs == [4, 4], f"tp={tp}: dynamo compiled {graphs} frames per rank (docs/gpu_speed.md: 4)"


def test_nxd_trainer_torch_compile_tp2(ranks2, tmp_path):
    ranks2.run(check_trainer, str(tmp_path))
