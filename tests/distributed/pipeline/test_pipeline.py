"""NxDPPModel against single-process training of the same model: loss and gathered gradients
after one run_train, losses over optimizer steps, for schedules, layouts and model features."""

import re

from support import moe_pp
import pytest
import torch

import nxd_hf
from nxd_hf import backend, parallel_state
from nxd_hf.parallel_layers.random import draw_step_seed
from nxd_hf.parallel_layers.sharding import is_sharded
from support import hf_parity


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
    reference, model = moe_pp.build_pair(model_type, attention_dropout=0.3)  # before every router
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


TOL = hf_parity.TOL


def _reference_step(reference, ids, labels, attention_mask):
    loss = reference(input_ids=ids, attention_mask=attention_mask, labels=labels).loss
    loss.backward()
    return loss.detach()


def _pp_batch(seed=3, b=8, s=8):
    ids, labels = hf_parity.batch(seed=seed, b=b, s=s)
    labels[2, :] = -100  # ignored tokens spread unevenly over microbatches
    labels[5, 1:6] = -100
    attention_mask = torch.ones_like(ids)
    attention_mask[6, :3] = 0  # left padding
    labels[6, :3] = -100
    return ids, labels, attention_mask


def _dp_slice(t):
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_size()
    return t.chunk(dp_size)[dp_rank]


def check_pipeline(model_type: str, *, tp=1, pp=2, steps=1, seqs=(8,), sequence_parallel=False, **pp_kwargs):
    """Loss and gathered grads after each run_train equal the single-process model; with
    ``steps`` > 1, SGD steps in between (the losses of every step compared); then run_eval's
    loss with the trained weights."""
    parallel_state.destroy_model_parallel()
    overrides = dict(num_hidden_layers=4) if model_type != "gpt2" else dict(n_layer=4)
    reference, model = hf_parity.build_pair(model_type, **overrides)
    pp_kwargs.setdefault("num_microbatches", 2)
    pp_model = nxd_hf.parallelize(model, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                  sequence_parallel=sequence_parallel, broadcast_and_average_loss=True, **pp_kwargs)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(pp_model.local_parameters(), lr=0.1)
    ref_params = dict(reference.named_parameters(remove_duplicate=False))  # tied: both names
    for step in range(steps):
        ids, labels, attention_mask = _pp_batch(seed=step, s=seqs[step % len(seqs)])
        ref_loss = _reference_step(reference, ids, labels, attention_mask)
        loss = pp_model.run_train(input_ids=_dp_slice(ids), attention_mask=_dp_slice(attention_mask),
                                  labels=_dp_slice(labels))
        torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m: f"{model_type} step {step} loss: {m}")
        for name, param in pp_model.local_named_parameters():
            torch.testing.assert_close(hf_parity.gathered_grad(param), ref_params[name].grad, **TOL,
                                       msg=lambda m: f"{model_type} step {step} {name}: {m}")
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    ids, labels, attention_mask = _pp_batch(seed=steps)  # run_eval with the trained weights
    with torch.no_grad():
        ref_loss = reference(input_ids=ids, attention_mask=attention_mask, labels=labels).loss
    loss = pp_model.run_eval(input_ids=_dp_slice(ids), attention_mask=_dp_slice(attention_mask),
                             labels=_dp_slice(labels))
    torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m: f"{model_type} run_eval loss: {m}")
    local = dict(input_ids=_dp_slice(ids), attention_mask=_dp_slice(attention_mask))
    _, logits = pp_model.run_eval(**local, labels=_dp_slice(labels), return_logits=True)  # on every PP rank
    with torch.no_grad():
        torch.testing.assert_close(logits, reference(**local).logits, **TOL,
                                   msg=lambda m: f"{model_type} run_eval logits: {m}")
    return pp_model


def check_deallocation() -> None:
    """Sent activations are freed (stage 0 sends, so its freed bytes count), results unchanged."""
    pp_model = check_pipeline("llama", deallocate_pipeline_outputs=True, num_microbatches=4)
    stages = [s for schedule in pp_model._runner.schedules.values() for s in [schedule._stage]]
    freed = sum(s.freed_bytes for s in stages)
    if 0 in pp_model.local_stage_ids:
        # 4 microbatches x hidden states [2, 8, 48] fp32
        assert freed == 4 * 2 * 8 * 48 * 4, freed
    else:
        assert freed == 0


def check_one_fake_run_per_shape() -> None:
    """Building a schedule runs the whole model on fake tensors for the stages' shapes: once per
    microbatch shape. run_eval at the shape run_train used reuses training's run, which equals a
    fresh fake run made without gradients (as run_eval's would be). (The other way round is not
    reused: tests/distributed/trainer/test_dpo.py's reference pass with LoRA's adapters disabled.)"""
    pp_model = check_pipeline("llama")  # run_train, then run_eval twice, at one batch shape
    cache = pp_model._metadata_by_shape._cache
    assert len(cache) == 1 and len(pp_model._runner.schedules) == 2, (list(cache), list(pp_model._runner.schedules))
    ((train, *signature),) = {key for key in pp_model._runner.schedules if key[0]}
    microbatch = [torch.zeros(shape, dtype=dtype).chunk(pp_model.num_microbatches)[0] for shape, dtype in signature]

    def described(meta):
        return {s: ([(t.shape, t.dtype, t.requires_grad) for t in ins], [(t.shape, t.dtype, t.requires_grad) for t in outs],
                    *nones) for s, (ins, outs, *nones) in meta.items()}

    with torch.no_grad():
        reused, fresh = pp_model.stage_metadata(microbatch, train=False), pp_model._propagated_metadata(microbatch)
    assert len(cache) == 1
    assert described(reused) == described(fresh), (described(reused), described(fresh))


def check_first_stage_split_backward() -> None:
    """Zero-bubble schedules: the first stage's I step computes the gradient down to the
    hidden state entering its first layer and leaves the weights alone; its W step then fills
    in every weight gradient (the parity check compares them with the reference)."""
    from nxd_hf.pipeline.runtime import SplitBackwardFirstStage

    pp_model = check_pipeline("gpt2", schedule="zbv", virtual_pipeline_size=2, num_microbatches=4)  # wte + wpe, tied
    ids, labels, attention_mask = _pp_batch()
    if 0 not in pp_model.local_stage_ids:
        pp_model.run_train(input_ids=ids, attention_mask=attention_mask, labels=labels)
        return
    (schedule,) = [s for (train, *_), s in pp_model._runner.schedules.items() if train]
    (stage,) = [s for s in schedule._stages if s.stage_index == 0]
    assert isinstance(stage, SplitBackwardFirstStage)
    weights = list(stage.submod.parameters())
    seen = []

    def input_step(chunk, **kwargs):
        before = [None if w.grad is None else w.grad.clone() for w in weights]
        stage_backward(chunk, **kwargs)
        assert not kwargs.get("full_backward", True)
        for w, g in zip(weights, before):
            assert (w.grad is None and g is None) or torch.equal(w.grad, g)
        leaves = stage._weight_steps[chunk][2]
        assert all(leaf.grad is not None for leaf in leaves)
        seen.append(tuple(leaf.shape for leaf in leaves))

    stage_backward, stage.backward_one_chunk = stage.backward_one_chunk, input_step
    pp_model.run_train(input_ids=ids, attention_mask=attention_mask, labels=labels)
    # one leaf per microbatch: the hidden state (wte + wpe) entering the first layer, [2, 8, 48]
    assert seen == [(torch.Size([2, 8, 48]),)] * 4, seen
    assert not stage._weight_steps and not stage._cuts


def pipeline_matches_single_process(model_type: str, **kwargs) -> None:
    """check_pipeline, as a case run on the pool (the pipeline model itself stays on the ranks)."""
    check_pipeline(model_type, **kwargs)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt2"])
def test_pp2_loss_grads_and_eval_match_single_process(ranks2, model_type):
    ranks2.run(pipeline_matches_single_process, model_type)


def test_pp2_consecutive_steps_with_two_sequence_lengths(ranks2):
    ranks2.run(pipeline_matches_single_process, "llama", steps=3, seqs=(8, 12))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp2_schedule(ranks2, schedule):
    ranks2.run(pipeline_matches_single_process, "llama", schedule=schedule)


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv", "looped_bfs", "interleaved_zero_bubble"])
def test_pp2_two_virtual_stages_per_rank(ranks2, schedule):
    ranks2.run(pipeline_matches_single_process, "llama", schedule=schedule, virtual_pipeline_size=2)


def test_pp2_full_activation_checkpointing(ranks2):
    ranks2.run(pipeline_matches_single_process, "llama", activation_checkpoint_config="full")


def test_pp2_zero_bubble_with_activation_checkpointing_two_steps(ranks2):
    ranks2.run(pipeline_matches_single_process, "qwen2", schedule="interleaved_zero_bubble",
               virtual_pipeline_size=2, activation_checkpoint_config="full", steps=2)


def test_zero_bubble_first_stage_splits_input_and_weight_backward(ranks2):
    ranks2.run(check_first_stage_split_backward)


def test_pp2_one_fake_run_per_batch_shape(ranks2):
    ranks2.run(check_one_fake_run_per_shape)


def test_sent_activations_are_deallocated(ranks2):
    ranks2.run(check_deallocation)


def test_plain_torch_module_with_torch_tracer(ranks2):
    ranks2.run(check_plain_torch_module)


def check_meta_init_allocates_only_local_stages() -> None:
    """NxD's path: a meta model, NxDPPModel with cuts and param_init_fn: only this rank's stage
    is materialized; every other parameter stays on the meta device."""
    import transformers

    from nxd_hf.parallel_layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
    from nxd_hf.pipeline import NxDPPModel
    from nxd_hf.utils import init_on_device

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 2)
    config_cls, model_cls, kwargs = hf_parity.TINY["llama"]
    with init_on_device(torch.device("meta")):
        model = model_cls(config_cls(**{**kwargs, "num_hidden_layers": 4}))

    def init_weights(module):
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ParallelEmbedding)):
            module.init_weight_cpu()
        elif isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                torch.nn.init.zeros_(module.bias)
        elif hasattr(module, "weight") and isinstance(module.weight, torch.nn.Parameter):
            torch.nn.init.ones_(module.weight)

    pp_model = NxDPPModel(model, transformer_layer_cls=transformers.models.llama.modeling_llama.LlamaDecoderLayer,
                          num_microbatches=2, pipeline_cuts=["model.layers.1"], param_init_fn=init_weights)
    local = {name for name, _ in pp_model.local_named_parameters()}
    assert all(not p.is_meta for _, p in pp_model.local_named_parameters())
    for name, param in model.named_parameters():
        assert param.is_meta == (name not in local), name  # the original model keeps meta non-local weights
    expected_layers = {"model.layers.0", "model.layers.1"} if pp_model.pp_rank == 0 else {"model.layers.2", "model.layers.3"}
    assert {".".join(n.split(".")[:3]) for n in local if ".layers." in n} == expected_layers
    ids, labels, attention_mask = _pp_batch()
    loss = pp_model.run_train(input_ids=ids, attention_mask=attention_mask, labels=labels)
    assert pp_model.pp_rank == 0 or torch.isfinite(loss)


def check_from_pretrained_reads_only_local_stages(path: str) -> None:
    """nxd_hf.from_pretrained at tp 2 x pp 2: each rank reads exactly its stage's rows, and
    run_eval's loss equals the single-process model loaded from the same files."""
    import transformers

    parallel_state.destroy_model_parallel()
    pp_model = nxd_hf.from_pretrained(path, tensor_parallel_size=2, pipeline_parallel_size=2, num_microbatches=2,
                                      broadcast_and_average_loss=True)
    expected = 0
    for _, param in pp_model.local_named_parameters():
        rows = int((param.shard_index >= 0).sum()) if is_sharded(param) else param.shape[0]
        expected += rows * (param.numel() // param.shape[param.partition_dim if is_sharded(param) else 0]) * 4
    assert pp_model.nxd.load_report.bytes_read == expected, (pp_model.nxd.load_report.bytes_read, expected)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids, labels, attention_mask = _pp_batch()
    with torch.no_grad():
        ref_loss = reference(input_ids=ids, attention_mask=attention_mask, labels=labels).loss
    loss = pp_model.run_eval(input_ids=ids, attention_mask=attention_mask, labels=labels)
    torch.testing.assert_close(loss, ref_loss, **TOL)


@pytest.mark.parametrize("model_type", ["gpt2", "mixtral"])
def test_pp2_dropout_draws_from_a_stream_per_stage(ranks2, model_type):
    """Stage 1 no longer repeats stage 0's masks; a router's statistics come from the step's masks."""
    ranks2.run(dropout_matches_reference_per_stage, model_type)


def test_pp2_default_generator_drawn_only_with_dropout_in_training(ranks2):
    ranks2.run(draws_only_with_dropout_in_training)


def test_pp2_lora_on_one_stage_only_refused(ranks2):
    ranks2.run(lora_on_one_stage_only_refused)


def test_pp4_four_microbatches(ranks4):
    ranks4.run(pipeline_matches_single_process, "llama", pp=4, num_microbatches=4)


def test_tp2_pp2(ranks4):
    ranks4.run(pipeline_matches_single_process, "llama", tp=2, pp=2)


def test_tp2_pp2_sequence_parallel_with_per_head_norms(ranks4):
    ranks4.run(pipeline_matches_single_process, "qwen3", tp=2, pp=2, sequence_parallel=True)


def test_tp2_pp2_dropout_same_on_tp_ranks_per_stage(ranks4):
    ranks4.run(dropout_matches_reference_per_stage, "gpt2", tp=2)


def test_tp2_pp2_tied_embedding_across_stages(ranks4):
    ranks4.run(pipeline_matches_single_process, "gpt2", tp=2, pp=2)


def test_tp2_pp2_sequence_parallel_zbv(ranks4):
    ranks4.run(pipeline_matches_single_process, "qwen3", tp=2, pp=2, sequence_parallel=True, schedule="zbv",
               virtual_pipeline_size=2)


def test_dp2_pp2_each_dp_rank_gets_half_the_batch(ranks4):
    ranks4.run(pipeline_matches_single_process, "llama", pp=2, steps=2)


@pytest.mark.parametrize("model_type", ["mistral", "qwen3", "phi3", "gpt_neox", "cohere", "phi"])
def test_tp2_pp2_architecture(ranks4, model_type):
    ranks4.run(pipeline_matches_single_process, model_type, tp=2, pp=2)


def test_meta_init_allocates_only_local_stages(ranks4):
    ranks4.run(check_meta_init_allocates_only_local_stages)


def test_from_pretrained_reads_only_local_stages(ranks4, tmp_path):
    reference, _ = hf_parity.build_pair("qwen2", num_hidden_layers=4)  # tied embeddings across stages
    reference.save_pretrained(tmp_path, max_shard_size="30KB")
    ranks4.run(check_from_pretrained_reads_only_local_stages, str(tmp_path))


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.relu(self.linear(x))


class _PlainNet(torch.nn.Module):
    """A plain torch module returning (loss, logits), for tracer_cls='torch'."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(4))

    def forward(self, features, labels):
        h = self.inp(features)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits, labels), logits


def check_plain_torch_module() -> None:
    """NxD's generic path: a non-HF module, the "torch" tracer, output_loss_value_spec; the
    loss is each microbatch's mean averaged over microbatches."""
    from nxd_hf.pipeline import NxDPPModel

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 2)
    torch.manual_seed(0)
    reference = _PlainNet()
    model = _PlainNet()
    model.load_state_dict(reference.state_dict())
    pp_model = NxDPPModel(model, transformer_layer_cls=_Block, num_microbatches=2, input_names=["features", "labels"],
                          output_loss_value_spec=(True, False), tracer_cls="torch", auto_partition=True,
                          broadcast_and_average_loss=True)
    g = torch.Generator().manual_seed(1)
    features, labels = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
    loss = pp_model.run_train(features=features, labels=labels)
    ref_loss = reference(features, labels)[0]
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    ref_params = dict(reference.named_parameters())
    for name, param in pp_model.local_named_parameters():
        torch.testing.assert_close(param.grad, ref_params[name].grad, **TOL)
