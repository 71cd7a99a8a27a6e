"""nnScaler's ``parallelize`` / ``ComputeConfig`` / ``ParallelModule`` on
nxd_hf's engine: the document's three examples with small real modules, parity with the
unparallelized module over several optimizer steps."""

import copy
import os

import pytest
import torch
from torch import nn

from nxd_hf import backend, parallel_state
from nxd_hf.nnscaler import (
    build_optimizer, ComputeConfig, deduped_state_dict, load_deduped_state_dict, load_merged_state_dicts,
    merge_state_dicts, non_parallel_module_reducer, parallelize, Plan,
)
from nxd_hf.parallel_layers.sharding import is_sharded
from support.nnscaler import check_logical, compare_logical, lm_loss, token_batch, end2end_matches, training_flag_and_class_path
from support.nnscaler_models import Branchy, LLM, MaskDecoder, TOL


def llm_tp_matches(tmp, policy="tp", steps=3):
    """Example 1: the whole LLM (attention by heads, MLPs column -> row, embedding by vocab) over
    one unit of 2 ranks; losses, gradients and AdamW steps equal the plain module's; eval mode runs
    its own traced graph."""
    ref = LLM()
    x, _ = token_batch(0)
    pm = parallelize(copy.deepcopy(ref), {"x": x}, policy, ComputeConfig(2, 2), gen_savedir=tmp)
    opt, ref_opt = torch.optim.AdamW(pm.parameters(), **ADAM), torch.optim.AdamW(ref.parameters(), **ADAM)
    for step in range(steps):
        x, y = token_batch(step + 1)
        loss, ref_loss = lm_loss(pm(x), y), lm_loss(ref(x), y)
        torch.testing.assert_close(loss, ref_loss, **TOL)
        loss.backward()
        ref_loss.backward()
        compare_logical(pm, ref)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    compare_logical(pm, ref, grads=False)
    pm.eval(), ref.eval()
    with torch.inference_mode():
        torch.testing.assert_close(pm(x), ref(x), **TOL)
    check_logical(pm, ref)
    return pm.plan.as_dict()


def mlp_only_policy(graph, compute_config):
    """A user policy: shard only the MLPs of the layout nxd_hf derived, replicate attention."""
    return Plan(tp_size=compute_config.plan_ngpus,
                layouts={name: lay for name, lay in graph.derived.items() if ".mlp." in name})


def custom_policy_matches(tmp):
    layouts = llm_tp_matches(tmp, policy=mlp_only_policy, steps=2)["layouts"]
    assert layouts and all(".mlp." in name for name in layouts), layouts
    bad = lambda graph, cfg: Plan(tp_size=2, layouts={"layers.0.mlp.gate": "column"})  # noqa: E731
    try:
        parallelize(LLM(), {"x": token_batch(0)[0]}, bad, ComputeConfig(2, 2), gen_savedir=tmp)
    except ValueError as e:
        assert "not exact" in str(e) and "layers.0.mlp.gate" in str(e), e
    else:
        raise AssertionError("a column without its row was accepted")


def _two_units_backward(model, ref, step):
    """Each of 2 units its own batch; the reference backpropagates the mean of the units' losses."""
    unit = parallel_state.get_data_parallel_rank()
    batches = [token_batch(10 * step + u) for u in range(2)]
    loss = lm_loss(model(batches[unit][0]), batches[unit][1])
    ref_losses = [lm_loss(ref(x), y) for x, y in batches]
    torch.testing.assert_close(loss, ref_losses[unit], **TOL)
    loss.backward()
    (sum(ref_losses) / 2).backward()


def llm_dp_zero_matches(tmp, steps=3):
    """dp=2 (plan_ngpus=1, runtime_ngpus=2) with use_zero: ZeRO-1 AdamW over the units; each unit
    its own batch; parameters equal the plain module trained on the mean of the units' losses."""
    from nxd_hf.optim import NeuronZero1Optimizer

    ref = LLM()
    pm = parallelize(copy.deepcopy(ref), {"x": token_batch(0)[0]}, "dp", ComputeConfig(1, 2, use_zero=True),
                     gen_savedir=tmp)
    opt = NeuronZero1Optimizer(pm.parameters(), torch.optim.AdamW, grad_clipping=False, **ADAM)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAM)
    for step in range(steps):
        _two_units_backward(pm, ref, step)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        compare_logical(pm, ref, grads=False)


class WithHFModel(nn.Module):
    """Example 2: a plain module holding an HF model parallelized on its own."""

    def __init__(self, tmp, compute_config, llama=None):
        super().__init__()
        import transformers

        torch.manual_seed(0)
        config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=4,
                                          num_key_value_heads=2, num_hidden_layers=2, vocab_size=32)
        self.pre = nn.Embedding(32, 16)
        llama = llama if llama is not None else transformers.LlamaModel(config)
        self.llama = parallelize(llama, {"inputs_embeds": torch.randn(2, 8, 16)}, "tp", compute_config,
                                 gen_savedir=tmp) if compute_config is not None else llama
        self.head = nn.Linear(16, 32)

    def forward(self, x):
        return self.head(self.llama(inputs_embeds=self.pre(x)).last_hidden_state)


def hf_pipelined_matches(tmp, steps=2):
    """An HF causal LM as an end2end module under pp=2: train_step runs its pipeline (one loss,
    the token mean over the samples) and equals the plain model on the samples' concatenation."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=32)
    ref = transformers.LlamaForCausalLM(config)
    samples = [dict(zip(("input_ids", "labels"), token_batch(i))) for i in range(2)]
    pm = parallelize(copy.deepcopy(ref), samples[0], "pp", ComputeConfig(2, 2, use_end2end=True), gen_savedir=tmp)
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(steps):
        samples = [dict(zip(("input_ids", "labels"), token_batch(10 * step + i))) for i in range(2)]
        losses = pm.train_step(samples)
        ref_loss = ref(**{k: torch.cat([s[k] for s in samples]) for k in samples[0]}).loss
        ref_loss.backward()
        assert len(losses) == 1
        torch.testing.assert_close(losses[0], ref_loss.detach(), **TOL)
        compare_logical(pm, ref)
        opt.step(), ref_opt.step(), ref_opt.zero_grad()


def hf_submodule_matches(tmp, steps=3):
    """Two units of tp=2: the HF model's gradients are reduced by nxd_hf, the rest's by the
    non-parallel reducer; everything equals the plain module trained on the units' mean loss."""
    ref = WithHFModel(tmp, None)
    model = WithHFModel(tmp, ComputeConfig(2, 4), llama=copy.deepcopy(ref.llama))
    model.pre.load_state_dict(ref.pre.state_dict()), model.head.load_state_dict(ref.head.state_dict())
    reducer = non_parallel_module_reducer(model)
    assert {id(p) for p in reducer.params} == {id(p) for p in (*model.pre.parameters(), *model.head.parameters())}
    seen = []  # the document's hook example: scale down before the reduction, up after it
    reducer.register_pre_hook(lambda r, grad: (seen.append("pre"), grad.div_(4)))
    reducer.register_post_hook(lambda r, grad: (seen.append("post"), grad.mul_(4)))
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(steps):
        _two_units_backward(model, ref, step)
        reducer.sync_grads()
        compare_logical(model, ref)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    assert any(is_sharded(p) for p in model.llama.parameters())
    # as nnScaler's: one pre and one post call per bucket and step (these parameters fill one bucket)
    assert seen[0] == "pre" and seen[-1] == "post" and len(seen) == 2 * steps


def refused_class_build_leaves_no_plan(tmp):
    """A module class's plan is saved once the class builds: a refused build (here parallel_state
    already at tp=1) leaves none, so the corrected rerun is not refused by reuse="match"."""
    x = torch.randn(2, 8)
    parallel_state.initialize_model_parallel(1, 1)
    P = parallelize(Branchy, {"x": x}, "tp", ComputeConfig(2, 2), gen_savedir=tmp, reuse="match")
    try:
        P()
    except ValueError as e:
        assert "the plan needs tp=2" in str(e), e
    else:
        raise AssertionError("a tp=2 plan was built on parallel_state at tp=1")
    assert not os.path.exists(os.path.join(tmp, "_", "plan.json"))
    parallelize(Branchy, {"x": x}, "dp", ComputeConfig(1, 2), gen_savedir=tmp, reuse="match")()
    assert os.path.exists(os.path.join(tmp, "_", "plan.json"))


def errors_on_every_rank(tmp):
    """A wrong runtime_ngpus, and ranks disagreeing on the config: one ValueError on every rank."""
    x = torch.randn(2, 8)
    try:
        parallelize(Branchy(), {"x": x}, "tp", ComputeConfig(2, 4), gen_savedir=tmp)
    except ValueError as e:
        assert "runtime_ngpus=4" in str(e) and "2 ranks" in str(e), e
    else:
        raise AssertionError("runtime_ngpus != world size was accepted")
    module = Branchy()
    pm = parallelize(module, {"x": x}, "tp", ComputeConfig(2, 2), gen_savedir=tmp)
    try:  # the ranks of a unit must take the same input
        pm(torch.full((2, 8), float(parallel_state_rank())))
    except ValueError as e:
        assert "bad inputs" in str(e), e
    else:
        raise AssertionError("different inputs on the ranks of a unit were accepted")
    try:
        parallelize(module, {"x": x}, "tp", ComputeConfig(2, 2), gen_savedir=tmp)
    except ValueError as e:
        assert "already parallel" in str(e), e
    else:
        raise AssertionError("a module was parallelized twice")
    config = ComputeConfig(2, 2, use_zero=parallel_state_rank() == 0)
    try:
        parallelize(Branchy(), {"x": x}, "tp", config, gen_savedir=tmp)
    except ValueError as e:
        assert "different config on different ranks" in str(e), e
    else:
        raise AssertionError("different configs on different ranks were accepted")


def parallel_state_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def init_params_false_replicas(tmp):
    """Two units, rank 1 built with ``init_params=False`` (the document's ``no_weights`` flow):
    setup does not compare the replicas' weights, which are copied from rank 0 afterwards (what
    ``broadcast_weights`` does); units built with different weights otherwise are a ValueError."""
    import torch.distributed as dist

    P = parallelize(Branchy, {"x": torch.randn(2, 8)}, "dp", ComputeConfig(1, 2), gen_savedir=tmp)
    pm = P(init_params=dist.get_rank() == 0)
    assert dist.get_rank() == 0 or not pm.up.weight.any()
    for p in pm.parameters():
        dist.broadcast(p.data, 0)
    ref = Branchy()
    ref.load_state_dict(P._spec.initial_state)
    torch.testing.assert_close(pm(torch.ones(1, 8)), ref(torch.ones(1, 8)), **TOL)
    parallel_state.destroy_model_parallel()
    torch.manual_seed(dist.get_rank())
    try:
        parallelize(Branchy(), {"x": torch.randn(2, 8)}, "dp", ComputeConfig(1, 2), gen_savedir=tmp)
    except ValueError as e:
        assert "replicas hold different weights" in str(e), e
    else:
        raise AssertionError("replicas with different weights were accepted")


ADAM = dict(lr=1e-2, eps=1e-3)  # eps above the gradients' fp32 rounding noise (see test_nnscaler_state.py)
NUM_SAMPLES = 2


def _samples(step: int, unit: int, seq: int = 8):
    g = torch.Generator().manual_seed(1000 * step + 10 * unit)
    return [{"input_ids": torch.randint(0, 32, (2, seq), generator=g), "labels": torch.randint(0, 32, (2, seq), generator=g)}
            for _ in range(NUM_SAMPLES)]


def _merged(pm, optimizer):
    module_sds = backend.all_gather_object(pm.state_dict())
    optimizer_sds = backend.all_gather_object(optimizer.state_dict())
    return merge_state_dicts(module_sds, optimizer_sds)


def _assert_equal_state(module_sd, optimizer_sd, ref, ref_opt, what: str):
    want = ref.state_dict()
    assert set(module_sd) == set(want), (what, set(module_sd) ^ set(want))
    for name, value in want.items():
        torch.testing.assert_close(module_sd[name], value, **TOL, msg=lambda m, name=name: f"{what} {name}: {m}")
    for index, state in ref_opt.state_dict()["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(optimizer_sd["state"][index][key], value, **TOL,
                                       msg=lambda m, index=index, key=key: f"{what} optimizer {index} {key}: {m}")


def _scramble(pm):
    with torch.no_grad():
        for p in pm.parameters():
            p.add_(1.0)


def decoder_matches(tmp: str, policy: str, plan: int, runtime: int, zero: bool = False, steps: int = 3):
    """See the module docstring; ``parallelize`` of a module in eval mode gives one in eval mode."""
    parallel_state.destroy_model_parallel()
    ref = MaskDecoder().eval()
    config = ComputeConfig(plan, runtime, use_end2end=True, use_zero=zero,
                           pas_config={"pipeline_nmicros": NUM_SAMPLES, "pipeline_nstages": 2})
    pm = parallelize(copy.deepcopy(ref), {"data": _samples(0, 0)[0]}, policy, config, gen_savedir=tmp)
    assert not pm.training and not ref.training
    pm.train(), ref.train()
    optimizer, ref_opt = build_optimizer(pm, torch.optim.Adam, **ADAM), torch.optim.Adam(ref.parameters(), **ADAM)
    units, unit = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    for step in range(steps):
        losses = pm.train_step(_samples(step + 1, unit))
        norm = optimizer.clip_gnorm()
        optimizer.step()
        ref_opt.zero_grad()
        ref_losses = [[ref(s)[0] for s in _samples(step + 1, u)] for u in range(units)]
        (sum(sum(per_unit) for per_unit in ref_losses) / units).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
        ref_opt.step()
        for out, want in zip(losses, ref_losses[unit]):  # pipelined: the losses; else (loss, logits)
            loss = out[0] if isinstance(out, (tuple, list)) else out
            torch.testing.assert_close(loss.float(), want.detach(), **TOL)
        torch.testing.assert_close(norm.float().cpu(), ref_norm, **TOL)
    module_sd, optimizer_sd = _merged(pm, optimizer)
    _assert_equal_state(module_sd, optimizer_sd, ref, ref_opt, f"{policy} merged")
    original = MaskDecoder()
    original.load_state_dict(module_sd)  # strict: the original module's keys, nothing else
    _scramble(pm)
    load_merged_state_dicts(pm, module_sd, optimizer, optimizer_sd)
    _assert_equal_state(*_merged(pm, optimizer), ref, ref_opt, f"{policy} load_merged")
    deduped = deduped_state_dict(pm, optimizer)
    _scramble(pm)
    load_deduped_state_dict(pm, deduped[0], optimizer, deduped[1])
    _assert_equal_state(*_merged(pm, optimizer), ref, ref_opt, f"{policy} deduped")
    pm.eval(), ref.eval(), original.eval()
    eval_samples = _samples(99, unit)
    with torch.no_grad():
        want = [ref(s)[0] for s in eval_samples]
        for got, w in zip(pm.infer_step(eval_samples), want):
            torch.testing.assert_close(got[0] if isinstance(got, (tuple, list)) else got, w, **TOL)
        torch.testing.assert_close(original(eval_samples[0])[0], want[0], **TOL)


def test_example1_llm_tp2(ranks2, tmp_path):
    plans = ranks2.run(llm_tp_matches, str(tmp_path))
    layouts = plans[0]["layouts"]
    assert layouts["layers.0.attn.q"] == "column" and layouts["layers.0.attn.o"] == "row"
    assert layouts["layers.1.attn.qkv_k"] == "column" and layouts["layers.1.attn.proj"] == "row"
    assert layouts["layers.0.mlp.up"] == "column" and layouts["layers.0.mlp.down"] == "row"
    assert layouts["embed"] == "vocab" and "head" not in layouts and "layers.0.norm1" not in layouts
    assert (tmp_path / "_" / "plan.json").exists()


def test_custom_policy(ranks2, tmp_path):
    ranks2.run(custom_policy_matches, str(tmp_path))


def test_dp2_use_zero(ranks2, tmp_path):
    ranks2.run(llm_dp_zero_matches, str(tmp_path))


def test_example3_end2end_mlp_pp2(ranks2, tmp_path):
    ranks2.run(end2end_matches, str(tmp_path), "mlp", "pp", 2, 2)


def test_end2end_mlp_tp2(ranks2, tmp_path):
    ranks2.run(end2end_matches, str(tmp_path), "mlp", "tp", 2, 2)


def test_end2end_llm_hybrid_tp2_pp2(ranks4, tmp_path):
    ranks4.run(end2end_matches, str(tmp_path), "llm", "hybrid", 4, 4)


def test_end2end_llm_pp2_dp2(ranks4, tmp_path):
    ranks4.run(end2end_matches, str(tmp_path), "llm", "pp", 2, 4)


def test_example2_hf_submodule_tp2_two_units(ranks4, tmp_path):
    ranks4.run(hf_submodule_matches, str(tmp_path))


def test_training_flag_and_class_path(ranks2, tmp_path):
    ranks2.run(training_flag_and_class_path, str(tmp_path))


def test_refused_class_build_leaves_no_plan(ranks2, tmp_path):
    ranks2.run(refused_class_build_leaves_no_plan, str(tmp_path))


def test_errors_on_every_rank(ranks2, tmp_path):
    ranks2.run(errors_on_every_rank, str(tmp_path))


def test_hf_model_pipelined(ranks2, tmp_path):
    ranks2.run(hf_pipelined_matches, str(tmp_path))


def test_init_params_false_skips_the_replica_check(ranks2, tmp_path):
    ranks2.run(init_params_false_replicas, str(tmp_path))


@pytest.mark.parametrize("policy,plan,runtime,zero", [
    ("dp", 1, 2, True),  # two units, ZeRO-1
    ("tp", 2, 2, False),  # attention by heads, MLP column -> row, embeddings by vocabulary
    ("pp", 2, 2, False),  # the mask crosses the stage boundary
])
def test_mask_decoder_trains_as_one_process(ranks2, tmp_path, policy, plan, runtime, zero):
    ranks2.run(decoder_matches, str(tmp_path), policy, plan, runtime, zero)


def test_mask_decoder_hybrid_tp2_pp2(ranks4, tmp_path):
    ranks4.run(decoder_matches, str(tmp_path), "hybrid", 4, 4)
