"""nnScaler's build_optimizer, merged / deduped state dicts, broadcast_weights and gen_savedir
(``nxd_hf.nnscaler``) on HF models parallelized by nxd_hf, against the unparallelized model and
torch's Adam, and a script written against the
reference document under torchrun."""

import copy
import io
import os
import types

import pytest
import torch

import nxd_hf
import nxd_hf.nnscaler
from nxd_hf import backend, parallel_state
from nxd_hf.nnscaler import (
    broadcast_weights, build_optimizer, deduped_state_dict, load_deduped_state_dict, load_merged_state_dicts,
    merge_state_dicts, ParallelOptimizer, prepare_gen_savedir,
)
from nxd_hf.nnscaler.state_layout import layout_of, local_piece
from support import hf_parity


TOL = hf_parity.TOL
BATCH, SEQ, LR = 4, 8, 1e-2
ADAM = dict(lr=LR, eps=1e-3)  # eps well above the gradients' rounding noise: Adam's near-sign update of a
# gradient near zero would otherwise turn fp32 rounding differences of the parallel sums into 1e-5 gaps


def build(model_type: str, tp: int, pp: int, zero: bool, seed: int = 0):
    """(reference, its Adam, parallel model, build_optimizer's Adam); parallel_state re-initialized."""
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair(model_type, seed=seed)
    kwargs = {"pipeline_parallel_size": pp, "num_microbatches": 2} if pp > 1 else {}
    model = nxd_hf.parallelize(model, tensor_parallel_size=tp, **kwargs)
    optimizer = build_optimizer(model, torch.optim.Adam, types.SimpleNamespace(use_zero=zero), **ADAM)
    return reference, torch.optim.Adam(reference.parameters(), **ADAM), model, optimizer


def batch(step: int):
    ids = torch.randint(0, hf_parity.VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 + step))
    return ids.to(backend.default_device())


def train_step(model, optimizer, step: int, *, clip: float | None = None, scale: float | None = None):
    """One step on this rank's share of the batch (every token a label); returns the clip norm."""
    ids = batch(step)
    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    mine = ids.chunk(dp)[dp_rank]
    if getattr(model.nxd, "pipelined", False):
        model.run_train(input_ids=mine, labels=mine)
    else:
        model(input_ids=mine, labels=mine).loss.backward()
    if scale is not None:
        try:
            optimizer.scale_grads(scale)
            raise AssertionError("scale_grads before sync_shard_grad was accepted")
        except ValueError as error:
            assert "sync_shard_grad" in str(error)
        optimizer.sync_shard_grad()
        optimizer.scale_grads(scale)
    norm = optimizer.clip_gnorm(clip) if clip is not None else None
    optimizer.step()
    optimizer.zero_grad()
    return norm


def reference_step(reference, optimizer, step: int, *, clip: float | None = None, scale: float | None = None):
    ids = batch(step)
    reference(input_ids=ids, labels=ids).loss.backward()
    for p in reference.parameters() if scale is not None else ():
        p.grad.mul_(scale)
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip) if clip is not None else None
    optimizer.step()
    optimizer.zero_grad()
    return norm


def saved_and_loaded(state_dict: dict) -> dict:
    """``state_dict`` through torch.save / torch.load(weights_only=True), as per-rank files are."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def merged(model, optimizer):
    """merge_state_dicts of every rank's state_dict() (saved and loaded, gathered to every rank)."""
    module_sds = backend.all_gather_object(saved_and_loaded(model.state_dict()))
    optimizer_sds = backend.all_gather_object(saved_and_loaded(optimizer.state_dict())) if optimizer else None
    return merge_state_dicts(module_sds, optimizer_sds)


def assert_matches_reference(module_sd, optimizer_sd, reference, reference_optimizer, what: str):
    expected = reference.state_dict()
    assert set(module_sd) == set(expected), set(module_sd) ^ set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(module_sd[name], value, **TOL, msg=lambda m: f"{what} {name}: {m}")
    if optimizer_sd is None:
        return
    expected = reference_optimizer.state_dict()
    assert sorted(optimizer_sd["state"]) == sorted(expected["state"]), what
    for index, state in expected["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(optimizer_sd["state"][index][key], value, **TOL,
                                       msg=lambda m: f"{what} optimizer state {index} {key}: {m}")
    assert optimizer_sd["param_groups"][0]["params"] == expected["param_groups"][0]["params"]


def merged_matches_reference(model_type: str, tp: int, pp: int, zero: bool, steps: int = 3) -> None:
    """Train with build_optimizer (clip_gnorm, reducer hooks that must cancel) and torch's Adam on
    the original model; the merged state dicts equal the reference's, the original module loads
    them (strict) and gives the reference's logits, and torch's Adam loads the merged state."""
    reference, reference_opt, model, optimizer = build(model_type, tp, pp, zero)
    assert isinstance(optimizer, ParallelOptimizer)
    seen = []
    optimizer.register_reducer_pre_hook(lambda reducer, grad: (seen.append(reducer), grad.div_(4)))
    optimizer.register_reducer_post_hook(lambda reducer, grad: grad.mul_(4))
    for step in range(steps):
        clip = 0.05 if step == 1 else None  # the step-1 norm is well above 0.05: clipping acts
        scale = 0.5 if step == 2 else None
        norm = train_step(model, optimizer, step, clip=clip, scale=scale)
        ref_norm = reference_step(reference, reference_opt, step, clip=clip, scale=scale)
        if clip is not None:
            torch.testing.assert_close(norm.float().cpu(), ref_norm.float().cpu(), **TOL)
            assert float(ref_norm) > clip
    assert seen, "the reducer pre hooks never ran"
    some_ranks = backend.all_gather_object(model.state_dict())[:-1]
    try:
        merge_state_dicts(some_ranks)
        raise AssertionError("merge_state_dicts accepted the state dicts of some ranks only")
    except ValueError as error:
        assert "pass every rank's state dict" in str(error), error
    module_sd, optimizer_sd = merged(model, optimizer)
    assert_matches_reference(module_sd, optimizer_sd, reference, reference_opt, f"{model_type} tp={tp} pp={pp}")
    original = copy.deepcopy(reference)
    with torch.no_grad():
        for p in original.parameters():
            p.add_(1.0)  # surely different before loading
    original.load_state_dict(module_sd)  # strict: every key of the original, nothing else
    original.eval(), reference.eval()
    ids = batch(99)
    with torch.no_grad():
        torch.testing.assert_close(original(input_ids=ids).logits, reference(input_ids=ids).logits, **TOL)
    adam = torch.optim.Adam(original.parameters(), **ADAM)
    adam.load_state_dict(optimizer_sd)


def load_merged_at_another_layout(model_type: str, save: tuple, load: tuple) -> None:
    """Merged state of a (tp, pp, zero) run loaded by load_merged_state_dicts into a differently
    initialized model at another layout: one more step there equals the reference's."""
    reference, reference_opt, model, optimizer = build(model_type, *save)
    for step in range(2):
        train_step(model, optimizer, step)
        reference_step(reference, reference_opt, step)
    module_sd, optimizer_sd = merged(model, optimizer)
    _, _, model, optimizer = build(model_type, *load, seed=7)
    missing = {k: v for k, v in module_sd.items() if "layers.1." not in k}
    try:
        load_merged_state_dicts(model, missing, optimizer, optimizer_sd)  # a rank holding layer 1 fails: all raise
        raise AssertionError("a merged state dict without layer 1 was accepted")
    except ValueError as error:
        assert "layers.1." in str(error), error
    load_merged_state_dicts(model, module_sd, optimizer, optimizer_sd)
    train_step(model, optimizer, 2)
    reference_step(reference, reference_opt, 2)
    assert_matches_reference(*merged(model, optimizer), reference, reference_opt, f"loaded at {load}")


def deduped_roundtrip(model_type: str, save: tuple, load: tuple) -> None:
    """deduped_state_dict keeps each logical element once over all ranks; loaded at another
    layout (load_deduped_state_dict) the model and optimizer continue as the reference."""
    reference, reference_opt, model, optimizer = build(model_type, *save)
    for step in range(2):
        train_step(model, optimizer, step)
        reference_step(reference, reference_opt, step)
    module_sd, optimizer_sd = deduped_state_dict(model, optimizer)
    kept = sum(backend.all_gather_object(sum(v.numel() for k, v in module_sd.items() if torch.is_tensor(v))))
    assert kept == sum(v.numel() for v in {id(t): t for t in reference.state_dict(keep_vars=True).values()}.values())
    _, _, model, optimizer = build(model_type, *load, seed=7)
    load_deduped_state_dict(model, module_sd, optimizer, optimizer_sd)
    train_step(model, optimizer, 2)
    reference_step(reference, reference_opt, 2)
    assert_matches_reference(*merged(model, optimizer), reference, reference_opt, f"deduped {save} -> {load}")


def broadcast_equalizes_replicas(model_type: str, tp: int, pp: int) -> None:
    """Replicas initialized differently (data-parallel rank 1 perturbed) equal rank 0's, and the
    reference's, after broadcast_weights; a wrong plan_ngpus is refused."""
    reference, _, model, _ = build(model_type, tp, pp, False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(float(parallel_state.get_data_parallel_rank()))
    try:
        broadcast_weights(model, plan_ngpus=tp * pp + 1)
        raise AssertionError("a wrong plan_ngpus was accepted")
    except ValueError as error:
        assert "plan_ngpus" in str(error)
    broadcast_weights(model, plan_ngpus=tp * pp)
    expected = dict(reference.named_parameters(remove_duplicate=False))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), local_piece(layout_of(p), expected[name].detach()), **TOL,
                                   msg=lambda m: f"{name}: {m}")


def gen_savedir_case(root: str) -> None:
    """Each rank's own directory stands for another node's disk: ALL copies plan and initial
    weights from rank 0, NO_WEIGHTS the plan only, NONE nothing; MATCH refuses a changed plan
    on every rank, MOO regenerates it, GRAPH keeps the weights when the graph is the same."""
    rank = backend.rank()
    node = os.path.join(root, f"node{rank}")
    plan = {"graph": "g1", "tp": 2, "params": {"w": [0, 1]}}
    weights = {"w": torch.arange(4, dtype=torch.float32, device="cpu") + 10 * rank}
    files = prepare_gen_savedir(node, "all", plan, "match", "all", module_name="M")
    files.save_init_weights(weights)
    torch.testing.assert_close(files.load_init_weights()["w"], torch.arange(4, dtype=torch.float32, device="cpu"))
    assert prepare_gen_savedir(node, "all", plan, "match", "all", module_name="M").reused
    files = prepare_gen_savedir(node, "nw", plan, "match", "no_weights")
    files.save_init_weights(weights)
    assert os.path.exists(files.plan_path) and files.has_init_weights() == (rank == 0)
    files = prepare_gen_savedir(node, "none", plan, "match", "none")
    assert os.path.exists(files.plan_path) == (rank == 0)
    try:
        prepare_gen_savedir(node, "all", {**plan, "tp": 1}, "match", "all", module_name="M")
        raise AssertionError("reuse='match' accepted a changed plan")
    except ValueError as error:
        assert "reuse='match'" in str(error) and "tp" in str(error), error
    files = prepare_gen_savedir(node, "all", {**plan, "tp": 1}, "graph", "all", module_name="M")
    assert files.reused and files.has_init_weights()  # same graph: the weights stand
    files = prepare_gen_savedir(node, "all", {**plan, "graph": "g2"}, "moo", "all", module_name="M")
    assert not files.reused and not files.has_init_weights()


class ScaledLM(torch.nn.Module):
    """nnScaler's Example 2: a plain module around a parallelized one, with a plain parameter."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.scale = torch.nn.Parameter(torch.tensor(1.5, device=backend.default_device()))

    def forward(self, input_ids):
        return self.lm(input_ids=input_ids, labels=input_ids).loss * self.scale


def submodule_matches_reference(tp: int, zero: bool, steps: int = 3) -> None:
    """A plain module holding a parallelized HF model: its plain parameter goes through
    _non_parallel_module_reducer (the data-parallel mean), clip_gnorm counts it once, and the
    merged state dicts are the original module's (its names, its parameter order)."""
    parallel_state.destroy_model_parallel()
    reference, lm = hf_parity.build_pair("llama")
    reference, model = ScaledLM(reference), ScaledLM(nxd_hf.parallelize(lm, tensor_parallel_size=tp))
    optimizer = build_optimizer(model, torch.optim.Adam, types.SimpleNamespace(use_zero=zero), **ADAM)
    assert optimizer._non_parallel_module_reducer.params == [model.scale]
    reference_opt = torch.optim.Adam(reference.parameters(), **ADAM)
    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    for step in range(steps):
        ids = batch(step)
        model(ids.chunk(dp)[dp_rank]).backward()
        reference(ids).backward()
        torch.testing.assert_close(optimizer.clip_gnorm(0.05).float().cpu(),
                                   torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05).float().cpu(), **TOL)
        optimizer.step(), reference_opt.step()
        optimizer.zero_grad(), reference_opt.zero_grad()
    assert_matches_reference(*merged(model, optimizer), reference, reference_opt, f"submodule tp={tp} zero={zero}")


class DocLLM(torch.nn.Module):
    """A plain module for the reference's Example 1 samples (tp: a column -> row chain)."""

    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(self.down(torch.nn.functional.gelu(self.up(x))))


def _doc_data(step: int):
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)


def _doc_step(model, optimizer, step: int, units: int, unit: int) -> None:
    x, y = _doc_data(step)
    model.train()
    torch.nn.functional.mse_loss(model(x.chunk(units)[unit]), y.chunk(units)[unit]).backward()
    optimizer.step()
    optimizer.zero_grad()


def nnscaler_doc_samples(tmp: str) -> None:
    """The reference's optimizer, checkpoint and broadcast samples on nxd_hf.nnscaler's
    ParallelModules (world 2): train with build_optimizer and reducer hooks (tp=2), merge and load
    the merged state dicts, deduped state dicts into dp=2 with ZeRO, broadcast_weights after
    init_module_params only on the first unit."""
    from nxd_hf.nnscaler import ComputeConfig, parallelize

    parallel_state.destroy_model_parallel()
    reference = DocLLM()
    reference_opt = torch.optim.Adam(reference.parameters(), **ADAM)
    x = _doc_data(0)[0]
    pm = parallelize(copy.deepcopy(reference), {"x": x}, "tp", ComputeConfig(2, 2), gen_savedir=tmp, instance_name="tp")
    optimizer = build_optimizer(pm, torch.optim.Adam, **ADAM)
    optimizer.register_reducer_pre_hook(lambda reducer, grad: grad.div_(2))
    optimizer.register_reducer_post_hook(lambda reducer, grad: grad.mul_(2))
    for step in range(3):
        _doc_step(pm, optimizer, step, 1, 0)
        _doc_step(reference, reference_opt, step, 1, 0)
    module_sd, optimizer_sd = merged(pm, optimizer)
    assert_matches_reference(module_sd, optimizer_sd, reference, reference_opt, "ParallelModule tp=2")
    pm = parallelize(DocLLM(seed=5), {"x": x}, "tp", ComputeConfig(2, 2), gen_savedir=tmp, instance_name="tp")
    optimizer = build_optimizer(pm, torch.optim.Adam, **ADAM)
    load_merged_state_dicts(pm, module_sd, optimizer, optimizer_sd)
    _doc_step(pm, optimizer, 3, 1, 0)
    _doc_step(reference, reference_opt, 3, 1, 0)
    assert_matches_reference(*merged(pm, optimizer), reference, reference_opt, "loaded merged")
    deduped = deduped_state_dict(pm, optimizer)
    parallel_state.destroy_model_parallel()
    pm = parallelize(DocLLM(seed=9), {"x": x}, "dp", ComputeConfig(1, 2, use_zero=True), gen_savedir=tmp,
                     instance_name="dp")
    optimizer = build_optimizer(pm, torch.optim.Adam, **ADAM)
    assert isinstance(optimizer, ParallelOptimizer) and optimizer.shards_state_over_dp
    load_deduped_state_dict(pm, *deduped[:1], optimizer, deduped[1])
    _doc_step(pm, optimizer, 4, 2, backend.rank())
    _doc_step(reference, reference_opt, 4, 1, 0)
    assert_matches_reference(*merged(pm, optimizer), reference, reference_opt, "deduped tp=2 -> dp=2 ZeRO")
    # the reference's no_weights recipe builds the other units with init_module_params=False; nxd_hf's setup
    # refuses replicas that differ at construction, so the replicas are made to differ after it here
    pm = parallelize(DocLLM(seed=20), {"x": x}, "dp", ComputeConfig(1, 2), gen_savedir=tmp, instance_name="bw",
                     broadcast_strategy="no_weights")
    with torch.no_grad():
        for p in pm.parameters():
            p.add_(float(parallel_state.get_data_parallel_rank()))
    broadcast_weights(pm, 1)
    for name, p in DocLLM(seed=20).state_dict().items():
        torch.testing.assert_close(pm.state_dict()[name], p, **TOL, msg=lambda m: f"broadcast {name}: {m}")


@pytest.mark.parametrize("model_type,tp,pp,zero", [
    ("llama", 2, 1, True),  # tp=2 x dp=2, ZeRO-1; padded vocab, replicated K/V
    ("llama", 2, 1, False),  # tp=2 x dp=2 without ZeRO
    ("qwen2", 1, 2, True),  # pp=2 x dp=2, ZeRO-1; embeddings tied across the stages
    ("gpt2", 2, 2, False),  # tp=2 x pp=2; Conv1D (transposed), fused c_attn, tied head
])
def test_merged_state_dicts_match_the_original_module(ranks4, model_type, tp, pp, zero):
    ranks4.run(merged_matches_reference, model_type, tp, pp, zero)


@pytest.mark.parametrize("save,load", [
    ((2, 1, True), (1, 2, False)),
    ((1, 2, False), (2, 2, False)),
])
def test_load_merged_state_dicts_at_another_layout(ranks4, save, load):
    ranks4.run(load_merged_at_another_layout, "qwen2", save, load)


@pytest.mark.parametrize("save,load", [
    ((2, 1, True), (1, 2, True)),
    ((2, 2, False), (2, 1, True)),
])
def test_deduped_state_dicts_round_trip_at_other_layouts(ranks4, save, load):
    ranks4.run(deduped_roundtrip, "qwen2", save, load)


@pytest.mark.parametrize("zero", [False, True])
def test_plain_module_around_a_parallel_one(ranks4, zero):
    ranks4.run(submodule_matches_reference, 2, zero)


@pytest.mark.parametrize("model_type,tp,pp", [("llama", 2, 1), ("qwen2", 1, 2)])
def test_broadcast_weights_equalizes_replicas(ranks4, model_type, tp, pp):
    ranks4.run(broadcast_equalizes_replicas, model_type, tp, pp)


def test_gen_savedir_reuse_and_broadcast(ranks2, tmp_path):
    ranks2.run(gen_savedir_case, str(tmp_path))


@pytest.mark.parametrize("args", [
    ["--example", "1", "--policy", "tp", "--plan_ngpus", "2", "--use_zero"],
    ["--example", "3", "--policy", "tp", "--plan_ngpus", "2"],
])
def test_nnscaler_script(rank_pools, tmp_path, args):
    """A script written against the reference document (imports from nxd_hf.nnscaler) trains, and
    the original module loaded with its merged state dicts computes the same outputs (as torchrun
    starts it, on the pool's ranks: the launch itself is test_examples.py's)."""
    from support.scripts import loss_fell, run_on_ranks

    out = run_on_ranks(rank_pools, "examples/nnscaler_example.py", 4, *args, "--gen_savedir", str(tmp_path))
    loss_fell(out)
    assert "computes the parallel module's outputs" in out


def test_gen_savedir_in_one_process(tmp_path):
    """Without torch.distributed: bad enum values and a changed plan under MATCH are ValueErrors; a
    broadcast strategy has no other node to copy to (ignored with a warning)."""
    from nxd_hf.nnscaler import BroadcastGenFilesStrategy, ReuseType, prepare_gen_savedir

    with pytest.raises(ValueError, match="reuse must be one of"):
        prepare_gen_savedir(tmp_path, None, {"a": 1}, "sometimes")
    with pytest.raises(ValueError, match="JSON"):
        prepare_gen_savedir(tmp_path, None, {"a": object()}, ReuseType.MATCH)
    with pytest.warns(UserWarning, match="broadcast_strategy='all' is ignored"):
        files = prepare_gen_savedir(tmp_path, None, {"a": 1}, ReuseType.MATCH, "all")
    assert files.strategy == BroadcastGenFilesStrategy.NONE and not files.reused
    assert prepare_gen_savedir(tmp_path, None, {"a": 1}, "match").reused
    with pytest.raises(ValueError, match="differs in \\['a'\\]"):
        prepare_gen_savedir(tmp_path, None, {"a": 2}, "match")
    assert not prepare_gen_savedir(tmp_path, None, {"a": 2}, "override").reused
    with pytest.raises(ValueError, match="init_module_params=False"):
        files.load_init_weights()


def test_reference_samples_on_parallel_modules(ranks2, tmp_path):
    """nnscaler-parallel-module.md's build_optimizer / reducer hooks / merge / load merged /
    deduped / load deduped / broadcast_weights samples on ParallelModules."""
    ranks2.run(nnscaler_doc_samples, str(tmp_path))
