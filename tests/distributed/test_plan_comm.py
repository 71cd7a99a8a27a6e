"""``nxd_hf.plan``'s communication terms equal, byte for byte, what a real training step of the tiny
models hands to collectives (``nxd_hf.backend.count_comm``) on two gloo ranks, for the structures
the config formula once missed: a tied embedding summed over pp, a dropout after the MLP's
reduction (recomputed again under activation checkpointing), per-head norms summed over TP."""

import pytest
import torch

import nxd_hf
from nxd_hf import backend, parallel_state
from support import hf_parity


def _init(module) -> None:
    with torch.no_grad():
        for param in module.parameters(recurse=False):
            param.normal_(0.0, 0.02)


def step_comm_bytes(model_type: str, overrides: dict, tp: int, pp: int, sequence_parallel: bool = False,
                    recompute: bool = False, batch: int = 2, seq: int = 16) -> dict:
    """Payload bytes per collective of one training step of this rank, beside the plan's terms."""
    from nxd_hf.parallel_sizes import ParallelSizes
    from nxd_hf.plan.activations import trace_activations
    from nxd_hf.plan.layout import Layout
    from nxd_hf.plan.memory import Workload
    from nxd_hf.plan.shapes import meta_model, model_shape, rank_params
    from nxd_hf.plan.step_comm import step_terms

    parallel_state.destroy_model_parallel()
    config_class, model_class, kwargs = hf_parity.TINY[model_type]
    config = config_class(**{**kwargs, **overrides})
    with torch.device("meta"):
        model = model_class(config)
    microbatches = 2 if pp > 1 else 1
    torch.manual_seed(0)
    model = nxd_hf.parallelize(model, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                               sequence_parallel=sequence_parallel, param_init_fn=_init, check_inputs=False,
                               activation_checkpoint_config="full" if recompute else None,
                               **({"num_microbatches": microbatches, "schedule": "1f1b"} if pp > 1 else {}))
    model.train()
    ids, labels = hf_parity.batch(b=batch * microbatches, s=seq)

    def step():
        if pp > 1:
            model.run_train(input_ids=ids, labels=labels)
        else:
            model(input_ids=ids, labels=labels).loss.backward()

    step()  # the first step's one-off agreements (whether some stage draws dropout masks)
    with backend.count_comm() as records:
        step()
    measured = {}
    for r in records:
        measured[r.op] = measured.get(r.op, 0) + r.payload_bytes
    layout = Layout(sizes=ParallelSizes(tp=tp, pp=pp, dp=1), sequence_parallel=sequence_parallel, recompute=recompute,
                    num_microbatches=microbatches, schedule="1f1b" if pp > 1 else None)
    work = Workload(micro_batch_size=batch, seq_len=seq, global_batch_size=batch * microbatches)
    meta = meta_model(config)
    trace = trace_activations(config, micro_batch_size=batch, seq_len=seq, device="cpu")
    terms = step_terms(model_shape(config, meta), rank_params(config, meta, tp=tp), work, layout,
                       parallel_state.get_pipeline_model_parallel_rank(), trace=trace)
    predicted = {}
    for t in terms:
        if t.op != "send":  # the pipeline's point-to-point sends are no collectives
            predicted[t.op] = predicted.get(t.op, 0) + t.payload_bytes
    return dict(measured=measured, predicted=predicted)


@pytest.mark.parametrize("model_type,overrides,tp,pp,sp,recompute", [
    ("gpt2", {}, 1, 2, False, False),  # the tied embedding's gradient summed over the two stages
    ("gpt2", dict(resid_pdrop=0.1), 2, 1, True, True),  # the MLP output's dropout mask: its reduction recomputed
    ("gpt2", dict(resid_pdrop=0.1), 2, 1, False, True),
    ("qwen3", {}, 2, 1, False, False),  # per-head q/k norms: partial gradients over TP without SP too
])
def test_step_comm_bytes_equal_the_plan(ranks2, model_type, overrides, tp, pp, sp, recompute):
    for result in ranks2.run(step_comm_bytes, model_type, overrides, tp, pp, sp, recompute):
        assert result["measured"] == result["predicted"], (model_type, tp, pp, sp, recompute, result)


def zero1_staging_bytes(bucket_bytes: int) -> dict:
    """The staging buffers ZeRO-1 keeps after two steps at dp = 2, beside the plan's."""
    from nxd_hf.optim import NeuronZero1Optimizer
    from nxd_hf.plan.memory import zero1_staging_bytes as planned

    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama")
    model = nxd_hf.parallelize(model, check_inputs=False)
    optimizer = NeuronZero1Optimizer([p for p in model.parameters() if p.requires_grad], torch.optim.AdamW, lr=1e-4,
                                     grad_clipping=False, model=model, bucket_size_mb=bucket_bytes / 2**20)
    ids, labels = hf_parity.batch(b=2, s=8)
    for _ in range(2):
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    # the optimizer's shared buffer and the overlap's second one, both kept for the next step
    # (the free list holds the shared one too once it is released)
    kept = {t.data_ptr(): t for t in [*optimizer._staging_buffers.values(), *optimizer._overlap._free]}.values()
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return dict(measured=sum(t.numel() * t.element_size() for t in kept),
                predicted=planned(grad_bytes, 2, 4, bucket_bytes=bucket_bytes))


@pytest.mark.parametrize("bucket_bytes", [2**12, 2**30])  # several buckets (two in flight); one bucket
def test_zero1_staging_buffers_equal_the_plan(ranks2, bucket_bytes):
    """ZeRO-1's staging buffers outlive the step: the plan holds them through the next forward."""
    for result in ranks2.run(zero1_staging_bytes, bucket_bytes):
        assert result["measured"] == result["predicted"], result
