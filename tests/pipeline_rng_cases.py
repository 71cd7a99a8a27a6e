"""Dropout through the pipeline: every stage draws from its own stream, derived per step from
one draw of the default generator (``nxd_hf.parallel_layers.random.pipeline_stage_rng``).

The reference is the unparallelized model run on the same streams: the default generator
seeded with the step's seed, then reseeded with ``seed + 100 * stage`` where that stage's
layers begin. Loss and gathered gradients must equal it; before the streams, stage 1 repeated
stage 0's masks (and a router's statistics came from other masks than the step's), which
fails this."""

import re

import torch

import hf_parity
import moe_pp_cases
import nxd_hf
from nxd_hf import backend, parallel_state
from nxd_hf.parallel_layers.random import draw_step_seed

TOL = hf_parity.TOL
GLOBAL_SEED = 11


def _first_layers(pp_model) -> list[int]:
    """The index of the first decoder layer of each pipeline stage, in stage order."""
    indices = {int(m.group(2)) for n, _ in pp_model.local_named_parameters()
               if (m := re.search(r"\.(h|layers)\.(\d+)\.", n))}
    gathered = [None] * parallel_state.get_pipeline_model_parallel_size()
    torch.distributed.all_gather_object(gathered, min(indices), group=parallel_state.get_pipeline_model_parallel_group())
    return gathered


def _build(model_type: str, tp: int):
    if model_type == "gpt2":  # attention dropout is in the sharded region: off under TP
        dropouts = dict(embd_pdrop=0.2, resid_pdrop=0.2, attn_pdrop=0.0 if tp > 1 else 0.2)
        reference, model = hf_parity.build_pair("gpt2", n_layer=4, **dropouts)
        return reference, model, lambda m: m.transformer.h
    reference, model = moe_pp_cases.build_pair(model_type, attention_dropout=0.3)  # before every router
    return reference, model, lambda m: m.model.layers


def dropout_matches_reference_per_stage(model_type: str, *, tp: int = 1) -> None:
    """One training step at pp=2 (one microbatch) with dropout on: loss and every gathered
    gradient equal the reference's on the per-stage streams; afterwards the default generator
    is in the same state on every rank (one draw per step, whatever the stage's layers drew),
    and a step replayed from a saved state of it draws the same masks."""
    parallel_state.destroy_model_parallel()
    reference, model, layers_of = _build(model_type, tp)
    reference.train()
    model.train()
    pp_model = nxd_hf.parallelize(model, tensor_parallel_size=tp, pipeline_parallel_size=2, num_microbatches=1,
                                  schedule="gpipe", broadcast_and_average_loss=True)
    first_layers = _first_layers(pp_model)
    assert first_layers[0] == 0 < first_layers[1], first_layers
    ids, labels = hf_parity.batch(seed=5, b=2, s=8)

    torch.manual_seed(GLOBAL_SEED)
    step_seed = draw_step_seed()
    expected_state = torch.get_rng_state()
    torch.manual_seed(step_seed)
    stage1 = layers_of(reference)[first_layers[1]]

    def reseed(*_):
        torch.manual_seed(step_seed + 100)

    hook = stage1.register_forward_pre_hook(reseed)
    try:
        ref_out = reference(input_ids=ids, labels=labels)
    finally:
        hook.remove()
    ref_out.loss.backward()
    with torch.no_grad():  # the masks matter: without them the loss differs
        plain = reference(input_ids=ids, labels=labels).loss
    assert not torch.allclose(plain, ref_out.loss, **TOL)

    torch.manual_seed(GLOBAL_SEED)
    loss = pp_model.run_train(input_ids=ids, labels=labels)
    torch.testing.assert_close(loss, ref_out.loss.detach(), **TOL)
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    for name, param in pp_model.local_named_parameters():
        ref_grad = ref_params[name].grad
        torch.testing.assert_close(hf_parity.gathered_grad(param),
                                   ref_grad if ref_grad is not None else torch.zeros_like(ref_params[name]),
                                   **TOL, msg=lambda m, n=name: f"{model_type} tp={tp} {n}: {m}")
    state = torch.get_rng_state()
    assert torch.equal(state, expected_state)
    states = [None] * backend.world_size()
    torch.distributed.all_gather_object(states, state)
    assert all(torch.equal(s, states[0]) for s in states)

    # the streams depend on the default generator's state alone (which checkpoints hold): from
    # one state, one loss; from the next, other masks
    again = pp_model.run_train(input_ids=ids, labels=labels)
    assert not torch.allclose(again, loss, **TOL)
    torch.set_rng_state(state)
    torch.testing.assert_close(pp_model.run_train(input_ids=ids, labels=labels), again, rtol=0, atol=0)


def draws_only_with_dropout_in_training() -> None:
    """The default generator is advanced by exactly one draw per training step of a model with
    dropout — in a module (LoRA's, here on a stage-1 layer only) or in the config — and left
    alone by a model without dropout or in eval mode, as the unsplit model leaves it."""
    import peft

    def state_after(pp_model, **inputs):
        torch.manual_seed(GLOBAL_SEED)
        pp_model.run_train(**inputs) if pp_model.local_modules()[0].training else pp_model.run_eval(**inputs)
        return torch.get_rng_state()

    torch.manual_seed(GLOBAL_SEED)
    untouched = torch.get_rng_state()
    draw_step_seed()
    one_draw = torch.get_rng_state()
    ids, labels = hf_parity.batch(seed=5, b=2, s=8)
    for overrides, lora_dropout, expected in [({}, None, untouched), ({"attention_dropout": 0.1}, None, one_draw),
                                              ({}, 0.1, one_draw)]:
        parallel_state.destroy_model_parallel()
        _, model = hf_parity.build_pair("llama", num_hidden_layers=4, **overrides)
        lora = None if lora_dropout is None else peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=lora_dropout,
                                                                 target_modules=["v_proj"])
        pp_model = nxd_hf.parallelize(model, pipeline_parallel_size=2, num_microbatches=2, lora_config=lora)
        case = f"{overrides} lora_dropout={lora_dropout}"
        assert torch.equal(state_after(pp_model, input_ids=ids, labels=labels), expected), case
        for stage in pp_model.local_modules():  # as NxDModel.eval() does (NxDTrainer's evaluate)
            stage.eval()
        assert torch.equal(state_after(pp_model, input_ids=ids, labels=labels), untouched), f"{case} eval"


def lora_on_one_stage_only_refused() -> None:
    """LoRA targets on stage 1's layers only: a ValueError on every rank, not a backward that
    waits for a gradient stage 0's frozen output never carries."""
    import peft
    import pytest

    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama", num_hidden_layers=4)
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["layers.3.self_attn.v_proj"])
    with pytest.raises(ValueError, match="match modules only on other pipeline stages"):
        nxd_hf.parallelize(model, pipeline_parallel_size=2, num_microbatches=2, lora_config=lora)
