"""ZeRO-3 / ZeRO-2 on torch's FSDP2 over nxd_hf's data-parallel ranks (``data_parallel_sharding``):
several AdamW steps with active gradient clipping against the one-process HF model (loss, norm,
every gathered gradient, the parameters), at dp=2 (also with CPU offload), tp=2 x dp=2 (+SP),
HSDP (dp=4 as 2 x 2) and pp=2 x dp=2 (tied embedding across the stages; MoE models under FSDP:
tests/distributed/moe/test_moe_fsdp.py); exact bytes per rank of parameters, gradients and optimizer state;
NxDTrainer(fsdp=...) against one-process Trainer (also "offload" and "hybrid_shard"); checkpoints
resumed at other layouts; LoRA against plain peft; refusals.
The ranks2 cases come first, then the ranks4 ones: one pool of each size is started once."""

import pytest
import torch

from support import hf_parity, moe_pp
from support.fsdp import LR, MAX_NORM, TOL, batches, check_params, check_step_and_step, logical_grad, train_step
import nxd_hf
from nxd_hf import backend, parallel_state
from nxd_hf.fsdp import is_dp_sharded, logical_tensor
from nxd_hf.parallel_layers.grads import clip_grad_norm


def check_offload_policy(model) -> None:
    """Every FSDP module of ``model`` (the layers and the root) has FSDP2's CPUOffloadPolicy, and
    every parameter it manages is offloaded (its shard in host memory)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    assert len(fsdp_modules) == model.config.num_hidden_layers + 1, len(fsdp_modules)
    for module in fsdp_modules:
        group = module._get_fsdp_state()._fsdp_param_group
        assert isinstance(group.offload_policy, CPUOffloadPolicy), type(module)
        assert all(p.offload_to_cpu for p in group.fsdp_params)
    assert all(p.device.type == "cpu" for p in model.parameters())


def check_fsdp_matches_hf(mode: str, tp: int, sp: bool, shard_size: int | None = None, offload: bool = False) -> None:
    """``shard_size``: HSDP, sharded over that many DP ranks and replicated across the groups.
    ``offload``: FSDP2's CPU offload (on a CPU a no-op device-wise; the path is the same)."""
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair("llama", attention_bias=False)
    nxd_hf.parallelize(model, tensor_parallel_size=tp, sequence_parallel=sp, data_parallel_sharding=mode,
                       data_parallel_shard_size=shard_size, data_parallel_offload=offload)
    if offload:
        check_offload_policy(model)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_size()
    assert dp_size == torch.distributed.get_world_size() // tp and all(is_dp_sharded(p) for p in model.parameters())
    mesh = next(model.parameters()).device_mesh
    assert mesh.ndim == (1 if shard_size is None else 2) and mesh.size(mesh.ndim - 1) == (shard_size or dp_size)
    norm_ranks = tuple(torch.distributed.get_process_group_ranks(mesh.get_group(mesh.ndim - 1)))
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    for step, (ids, labels) in enumerate(batches()):
        ref_loss, ref_norm = train_step(reference, ids, labels, dp_rank=0, dp_size=1, clip=torch.nn.utils.clip_grad_norm_)
        with backend.count_comm() as records:
            loss, norm = train_step(model, ids, labels, dp_rank=dp_rank, dp_size=dp_size, clip=clip_grad_norm)
        dp_ranks = tuple(torch.distributed.get_process_group_ranks(parallel_state.get_data_parallel_group()))
        dp_all_reduces = [r for r in records if r.op == "all_reduce" and r.ranks in (dp_ranks, norm_ranks)]
        assert len(dp_all_reduces) == 1, records  # the norm's sum of shards: FSDP2's reduce-scatter did the mean
        assert dp_all_reduces[0].ranks == norm_ranks  # under HSDP over the shard group: the replicas hold copies
        torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        check_step_and_step(f"{mode} tp={tp} step {step}", model, reference, (ref_optimizer, optimizer),
                             loss=loss / dp_size, ref_loss=ref_loss, norm=norm, ref_norm=ref_norm)
    check_params(f"{mode} tp={tp}", model, reference)


def test_zero3_matches_hf_dp2(ranks2):
    ranks2.run(check_fsdp_matches_hf, "zero3", 1, False)


def test_zero2_matches_hf_dp2(ranks2):
    ranks2.run(check_fsdp_matches_hf, "zero2", 1, False)


def test_zero3_cpu_offload_matches_hf_dp2(ranks2):
    ranks2.run(check_fsdp_matches_hf, "zero3", 1, False, offload=True)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer counted once)."""
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def check_bytes_per_rank(mode: str, tp: int) -> None:
    """Parameters, gradients and AdamW state held per rank: each TP-local tensor of dim 0 size n0
    and row size r keeps ceil(n0 / dp) rows (FSDP2 pads dim 0 to a multiple of dp); over all
    ranks that is the logical model once, plus what TP replicates by design (norms on every TP
    rank) and the padding rows of TP (odd vocab) and of FSDP."""
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair("llama", attention_bias=False)
    nxd_hf.parallelize(model, tensor_parallel_size=tp, data_parallel_sharding=mode)
    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    params = list(model.parameters())
    rows = {id(p): min(max(p.shape[0] - dp_rank * -(-p.shape[0] // dp), 0), -(-p.shape[0] // dp)) for p in params}
    row_numel = {id(p): p[0].numel() for p in params}  # p.shape: the TP-local shape; p.to_local(): this rank's rows
    padded = sum(-(-p.shape[0] // dp) * row_numel[id(p)] for p in params)
    local = sum(rows[id(p)] * row_numel[id(p)] for p in params)
    assert sum(p.to_local().numel() for p in params) == local
    assert _storage_bytes(p.to_local() for p in params) == 4 * padded  # fp32, FSDP2's padded shards

    # over the world: the logical model once per DP group, plus TP's replicas and padding
    logical = sum(p.numel() for p in reference.parameters())
    replicated = sum(p.numel() for p in params if not getattr(p, "tensor_model_parallel", False))
    tp_padding = sum((p.shape[p.partition_dim] * tp - p.logical_size) * p.numel() // p.shape[p.partition_dim]
                     for p in params if getattr(p, "tensor_model_parallel", False))
    world = torch.tensor(local)
    torch.distributed.all_reduce(world)
    assert world.item() == logical + (tp - 1) * replicated + tp_padding, (world.item(), logical, replicated, tp_padding)

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ids, labels = batches()[0]
    train_step(model, ids, labels, dp_rank=dp_rank, dp_size=dp, clip=clip_grad_norm)
    grads = [p.grad.to_local() for p in params]
    assert sum(g.numel() for g in grads) == local
    grad_bytes = _storage_bytes(grads)
    optimizer.step()
    state = [t.to_local() if is_dp_sharded(t) else t for s in optimizer.state.values() for t in s.values()]
    moments = [t for t in state if t.dim() > 0]
    assert sum(m.numel() for m in moments) == 2 * local  # exp_avg and exp_avg_sq of this rank's rows only
    assert _storage_bytes(moments) == 2 * 4 * local
    steps = [t for t in state if t.dim() == 0]  # AdamW's step count: one scalar per parameter, replicated
    assert len(steps) == len(params)
    assert grad_bytes == 4 * padded  # FSDP2's reduce-scatter output: the padded shards


def test_bytes_per_rank_zero3_dp2(ranks2):
    ranks2.run(check_bytes_per_rank, "zero3", 1)


def check_refusals() -> None:
    parallel_state.destroy_model_parallel()
    for kwargs, match in ((dict(data_parallel_sharding="full_shard"), "must be one of"),
                          (dict(data_parallel_offload=True), "need data_parallel_sharding")):
        _, model = hf_parity.build_pair("llama", attention_bias=False)
        with pytest.raises(ValueError, match=match):
            nxd_hf.parallelize(model, **kwargs)
        parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama", attention_bias=False)
    nxd_hf.parallelize(model, data_parallel_sharding="zero3")
    from nxd_hf.optim import NeuronZero1Optimizer

    with pytest.raises(ValueError, match="already sharded over the data-parallel ranks"):
        NeuronZero1Optimizer(model.parameters(), torch.optim.AdamW, lr=LR)


def test_refusals(ranks2):
    ranks2.run(check_refusals)


def test_hybrid_shard_size_cutting_expert_data_groups_refused():
    """At dp=12, ep=3, blocks of 4 DP ranks would hold 2 ranks of one expert-data group and 1 of the others."""
    from nxd_hf.fsdp import check_data_parallel_sharding

    with pytest.raises(ValueError, match="data_parallel_shard_size=4 with expert_parallel_size=3: one must divide"):
        check_data_parallel_sharding("zero3", expert_parallel_size=3, shard_size=4)


def check_trainer_matches_trainer(fsdp: str, accumulate: int, fsdp_config: dict | None = None) -> None:
    """NxDTrainer(fsdp=...) at dp = world (2, or 4 for HSDP) against transformers.Trainer on one
    process (the same global batch of 4): logged losses and grad norms every step, final parameters."""
    import tempfile

    from test_nxd_trainer import STEPS as TRAINER_STEPS, _losses, _run_case

    dp = torch.distributed.get_world_size()
    with tempfile.TemporaryDirectory() as out_dir:
        ref, ours = _run_case(out_dir, batch=4 // dp // accumulate, accumulate=accumulate, fsdp=fsdp,
                              fsdp_config=fsdp_config)
    modes = {"full_shard": "zero3", "shard_grad_op": "zero2", "hybrid_shard": "zero3", "hybrid_shard_zero2": "zero2"}
    assert ours.args.data_parallel_sharding == modes[fsdp.split()[0]]
    assert all(is_dp_sharded(p) for p in ours.nxd_model.parameters())
    shard_size = (fsdp_config or {}).get("dp_shard_size")
    mesh = next(ours.nxd_model.parameters()).device_mesh
    assert mesh.shape == ((dp // shard_size, shard_size) if shard_size else (dp,)), mesh
    if "offload" in fsdp:
        check_offload_policy(ours.nxd_model.nxd.hf_model)
    for key in ("loss", "grad_norm"):
        got, want = _losses(ours, key), _losses(ref, key)
        assert [s for s, _ in got] == [s for s, _ in want] == list(range(1, TRAINER_STEPS + 1)), (key, got)
        torch.testing.assert_close(torch.tensor([v for _, v in got]), torch.tensor([v for _, v in want]), **TOL)
    assert ours.state.total_flos == ref.state.total_flos > 0, (ours.state.total_flos, ref.state.total_flos)  # of the whole model
    ref_params = dict(ref.model.named_parameters())
    for name, param in ours.nxd_model.named_parameters():
        torch.testing.assert_close(logical_tensor(param), ref_params[name].detach(), **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("fsdp,accumulate", [("full_shard auto_wrap", 1), ("shard_grad_op", 2),
                                              ("full_shard offload", 1)])
def test_nxd_trainer_fsdp_matches_trainer(ranks2, fsdp, accumulate):
    ranks2.run(check_trainer_matches_trainer, fsdp, accumulate)


def test_trainer_arguments_read_hf_fsdp_and_refuse_the_rest():
    from nxd_hf.fsdp.hf_options import read_hf_fsdp

    assert read_hf_fsdp("full_shard auto_wrap", None).data_parallel_sharding == "zero3"
    assert read_hf_fsdp("shard_grad_op", {"fsdp_version": 2}).data_parallel_sharding == "zero2"
    assert read_hf_fsdp(True, {"reshard_after_forward": False}).data_parallel_sharding == "zero2"
    assert read_hf_fsdp("full_shard", {"activation_checkpointing": True}).activation_checkpointing
    assert read_hf_fsdp(None, None).data_parallel_sharding is None
    request = read_hf_fsdp("full_shard offload", None)
    assert request.data_parallel_sharding == "zero3" and request.offload and request.shard_size is None
    assert read_hf_fsdp("offload", None).data_parallel_sharding == "zero3"  # alone: full_shard offload
    assert read_hf_fsdp("shard_grad_op", {"offload_params": "true"}).offload
    request = read_hf_fsdp("hybrid_shard_zero2 auto_wrap", {"fsdp_dp_shard_size": 2})
    assert request.data_parallel_sharding == "zero2" and request.shard_size == 2 and not request.offload
    for fsdp, config, match in (("hybrid_shard", None, "needs fsdp_config\\['dp_shard_size'\\]"),
                                ("full_shard", {"dp_shard_size": 2}, "add 'hybrid_shard'"),
                                ("no_shard", None, "plain data parallelism"),
                                ("full_shard", {"min_num_params": 1000}, "min_num_params"),
                                ("full_shard", {"version": 1}, "version 1"), ("full_shard", {"xla": True}, "xla"),
                                ("sharded", None, "unknown fsdp option"), (None, {"version": 2}, "without fsdp")):
        with pytest.raises(ValueError, match=match):
            read_hf_fsdp(fsdp, config)
    args = nxd_hf.NxDTrainingArguments(output_dir="unused", fsdp="full_shard", report_to=[])
    assert args.data_parallel_sharding == "zero3" and not args.fsdp  # accelerate never sees fsdp
    args = nxd_hf.NxDTrainingArguments(output_dir="unused", fsdp="hybrid_shard offload",
                                       fsdp_config={"dp_shard_size": 2}, report_to=[])
    assert args.data_parallel_sharding == "zero3" and args.data_parallel_shard_size == 2 and args.data_parallel_offload
    assert not args.fsdp and not args.fsdp_config
    with pytest.raises(ValueError, match="drop zero_1"):
        nxd_hf.NxDTrainingArguments(output_dir="unused", fsdp="full_shard", zero_1=True, report_to=[])


def _train(model, optimizer, batches, *, zero1: bool = False):
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_size()
    losses = []
    for ids, labels in batches:
        loss, _ = train_step(model, ids, labels, dp_rank=dp_rank, dp_size=dp_size,
                        clip=(lambda params, norm: None) if zero1 else clip_grad_norm)  # ZeRO-1 clips in step()
        optimizer.step()
        optimizer.zero_grad()
        torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        losses.append(loss / dp_size)
    return torch.stack(losses), {n: logical_tensor(p) for n, p in model.named_parameters()}


def check_checkpoint_resumes_at_other_layouts(tmp_dir: str) -> None:
    """Two ZeRO-3 steps, a checkpoint (model and AdamW state), two more steps; the checkpoint loaded
    at ZeRO-1 (dp=2), at tp=2 and at ZeRO-3 again makes the same two steps. ``save_pretrained``
    of the ZeRO-3 model opens in plain transformers."""
    from nxd_hf.optim import NeuronZero1Optimizer

    data = batches()
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair("llama", attention_bias=False)
    nxd_hf.parallelize(model, data_parallel_sharding="zero3")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    _train(model, optimizer, data[:2])
    nxd_hf.save_checkpoint(tmp_dir, "step2", model=model, optimizer=optimizer)
    model.save_pretrained(f"{tmp_dir}/hf")
    want_losses, want_params = _train(model, optimizer, data[2:])
    saved = type(reference).from_pretrained(f"{tmp_dir}/hf")  # plain transformers, the weights after two steps
    for layout in ("zero1", "tp2", "zero3"):
        parallel_state.destroy_model_parallel()
        _, other = hf_parity.build_pair("llama", attention_bias=False)
        nxd_hf.parallelize(other, tensor_parallel_size=2 if layout == "tp2" else 1,
                           data_parallel_sharding="zero3" if layout == "zero3" else None)
        if layout == "zero1":
            other_optimizer = NeuronZero1Optimizer(other.parameters(), torch.optim.AdamW, lr=LR, weight_decay=0.1,
                                                   max_norm=MAX_NORM)
        else:
            other_optimizer = torch.optim.AdamW(other.parameters(), lr=LR, weight_decay=0.1)
        nxd_hf.load_checkpoint(tmp_dir, "step2", model=other, optimizer=other_optimizer)
        if layout == "zero1":
            for name, param in saved.named_parameters():
                torch.testing.assert_close(logical_tensor(dict(other.named_parameters())[name]), param.detach())
        losses, params = _train(other, other_optimizer, data[2:], zero1=layout == "zero1")
        torch.testing.assert_close(losses, want_losses, **TOL, msg=lambda m: f"{layout} losses: {m}")
        for name, param in params.items():
            torch.testing.assert_close(param, want_params[name], **TOL, msg=lambda m: f"{layout} {name}: {m}")


def test_checkpoint_resumes_at_zero1_and_tp2(ranks2, tmp_path):
    ranks2.run(check_checkpoint_resumes_at_other_layouts, str(tmp_path))


def check_lora_matches_peft(tp: int) -> None:
    """parallelize(lora_config=..., data_parallel_sharding="zero3"): the frozen base sharded, the
    adapters trained, against plain peft on the one-process model."""
    import copy

    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair("llama", attention_bias=False)
    torch.manual_seed(7)
    reference = peft.get_peft_model(reference, copy.deepcopy(config))
    torch.manual_seed(7)
    nxd_hf.parallelize(model, tensor_parallel_size=tp, lora_config=copy.deepcopy(config),
                       data_parallel_sharding="zero3")
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_size()
    ref_named = {n.removeprefix("base_model.model."): p for n, p in reference.named_parameters()}
    trained = [(n.removeprefix("base_model.model."), p) for n, p in model.named_parameters() if p.requires_grad]
    assert trained and {n for n, _ in trained} == {n for n, p in ref_named.items() if p.requires_grad}
    assert all(is_dp_sharded(p) for p in model.parameters())  # the frozen base too
    ref_optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR)
    optimizer = torch.optim.AdamW([p for _, p in trained], lr=LR)
    for step, (ids, labels) in enumerate(batches()):
        ref_loss, ref_norm = train_step(reference, ids, labels, dp_rank=0, dp_size=1, clip=torch.nn.utils.clip_grad_norm_)
        loss, norm = train_step(model, ids, labels, dp_rank=dp_rank, dp_size=dp_size,
                           clip=lambda params, max_norm: clip_grad_norm([p for p in params if p.requires_grad], max_norm))
        torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        torch.testing.assert_close(loss / dp_size, ref_loss, **TOL)
        torch.testing.assert_close(norm, ref_norm, **TOL)
        for name, param in trained:
            torch.testing.assert_close(logical_grad(param), ref_named[name].grad, **TOL,
                                       msg=lambda m: f"lora step {step} grad {name}: {m}")
        for opt in (ref_optimizer, optimizer):
            opt.step()
            opt.zero_grad()
    for name, param in model.named_parameters():
        torch.testing.assert_close(logical_tensor(param), ref_named[name.removeprefix("base_model.model.")].detach(),
                                   **TOL, msg=lambda m: f"lora param {name}: {m}")


def test_lora_zero3_matches_peft_dp2(ranks2):
    ranks2.run(check_lora_matches_peft, 1)


def check_hybrid_checkpoint_loads_unsharded(tmp_dir: str) -> None:
    """An HSDP checkpoint (dp=4 as 2 copies of 2 shards, one step trained) loads into the plain
    DDP model and into tp=2 x dp=2 ZeRO-3 with the same logical parameters and AdamW moments."""
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama", attention_bias=False)
    nxd_hf.parallelize(model, data_parallel_sharding="zero3", data_parallel_shard_size=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    _train(model, optimizer, batches()[:1])
    nxd_hf.save_checkpoint(tmp_dir, "hsdp", model=model, optimizer=optimizer)
    want = {n: logical_tensor(p) for n, p in model.named_parameters()}
    want_moments = {n: logical_tensor(p, optimizer.state[p]["exp_avg"]) for n, p in model.named_parameters()}
    for layout in (dict(), dict(tensor_parallel_size=2, data_parallel_sharding="zero3")):
        parallel_state.destroy_model_parallel()
        _, other = hf_parity.build_pair("llama", attention_bias=False)
        nxd_hf.parallelize(other, **layout)
        other_optimizer = torch.optim.AdamW(other.parameters(), lr=LR)
        nxd_hf.load_checkpoint(tmp_dir, "hsdp", model=other, optimizer=other_optimizer)
        for name, param in other.named_parameters():
            torch.testing.assert_close(logical_tensor(param), want[name], rtol=0, atol=0)
            torch.testing.assert_close(logical_tensor(param, other_optimizer.state[param]["exp_avg"]),
                                       want_moments[name], rtol=0, atol=0)


def check_trainer_checkpoints_and_resume(out_dir: str) -> None:
    """NxDTrainer(fsdp="full_shard") at dp=2 saves every 2 steps; resuming from checkpoint-4 at the
    same layout gives the same last two steps, and so does resuming at tp=2 (no FSDP)."""
    from test_nxd_trainer import _losses, _train_nxd

    whole = _train_nxd(f"{out_dir}/a", steps=6, batch=2, fsdp="full_shard")
    want = torch.tensor([v for _, v in _losses(whole)[-2:]])
    for layout, where in ((dict(fsdp="full_shard", batch=2), "b"), (dict(tensor_parallel_size=2), "c")):
        resumed = _train_nxd(f"{out_dir}/{where}", steps=6, resume=f"{out_dir}/a/checkpoint-4", **layout)
        torch.testing.assert_close(torch.tensor([v for _, v in _losses(resumed)[-2:]]), want, **TOL,
                                   msg=lambda m: f"resumed at {layout}: {m}")


def test_nxd_trainer_fsdp_checkpoints_and_resume(ranks2, tmp_path):
    ranks2.run(check_trainer_checkpoints_and_resume, str(tmp_path))



def check_pipeline_fsdp_matches_hf(mode: str | None, accumulate: int = 1) -> None:
    """pp=2 x dp=2: each stage's layers sharded over its DP group (each stage its own FSDP root),
    the embedding tied to the LM head across the stages; several AdamW steps with clipping
    against the one-process model (loss, norm, every gathered gradient, the parameters).
    ``accumulate``: each step's rows in that many ``run_train`` calls (one microbatch each, GPipe), the
    gradients accumulated (the tied one summed over its stages once per call); ``mode`` None: no
    FSDP, the same check."""
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair("llama", attention_bias=False, tie_word_embeddings=True)
    schedule = dict(num_microbatches=2) if accumulate == 1 else dict(num_microbatches=1, schedule="gpipe")
    pp_model = nxd_hf.parallelize(model, pipeline_parallel_size=2, data_parallel_sharding=mode,
                                  broadcast_and_average_loss=True, **schedule)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_size()
    assert dp_size == 2 and all(is_dp_sharded(p) == (mode is not None) for p in pp_model.parameters())
    assert pp_model.tied.local, "the embedding and the LM head are on different stages: a tie across them"
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
    optimizer = torch.optim.AdamW(pp_model.parameters(), lr=LR, weight_decay=0.1)
    for step, (ids, labels) in enumerate(batches()):
        ref_loss, ref_norm = train_step(reference, ids, labels, dp_rank=0, dp_size=1, clip=torch.nn.utils.clip_grad_norm_)
        num_items = (labels[:, 1:] != -100).sum()  # the step's tokens, over the calls and the DP ranks
        rows = zip(ids.chunk(dp_size)[dp_rank].chunk(accumulate), labels.chunk(dp_size)[dp_rank].chunk(accumulate))
        loss = sum(pp_model.run_train(input_ids=i, labels=l, num_items_in_batch=num_items) for i, l in rows)
        norm = clip_grad_norm(pp_model.parameters(), MAX_NORM)
        check_step_and_step(f"pp2 {mode} step {step}", pp_model, reference, (ref_optimizer, optimizer),
                             loss=loss, ref_loss=ref_loss, norm=norm, ref_norm=ref_norm)
    check_params(f"pp2 {mode}", pp_model, reference)


@pytest.mark.parametrize("mode,accumulate", [("zero3", 1), ("zero2", 2), (None, 2)])
def test_fsdp_matches_hf_pp2_dp2_tied_embedding(ranks4, mode, accumulate):
    ranks4.run(check_pipeline_fsdp_matches_hf, mode, accumulate)


def test_zero3_matches_hf_tp2_dp2_sequence_parallel(ranks4):
    ranks4.run(check_fsdp_matches_hf, "zero3", 2, True)


def test_zero2_matches_hf_tp2_dp2_sequence_parallel(ranks4):
    ranks4.run(check_fsdp_matches_hf, "zero2", 2, True)


def test_hybrid_zero3_matches_hf_dp4_shard2(ranks4):
    ranks4.run(check_fsdp_matches_hf, "zero3", 1, False, 2)


def test_bytes_per_rank_zero2_tp2_dp2(ranks4):
    ranks4.run(check_bytes_per_rank, "zero2", 2)


def test_lora_zero3_matches_peft_tp2_dp2(ranks4):
    ranks4.run(check_lora_matches_peft, 2)


@pytest.mark.parametrize("fsdp,accumulate", [("hybrid_shard", 1), ("hybrid_shard_zero2", 1)])
def test_nxd_trainer_hybrid_shard_matches_trainer_dp4(ranks4, fsdp, accumulate):
    ranks4.run(check_trainer_matches_trainer, fsdp, accumulate, {"dp_shard_size": 2})


def test_hybrid_checkpoint_loads_at_ddp_and_tp2_zero3(ranks4, tmp_path):
    ranks4.run(check_hybrid_checkpoint_loads_unsharded, str(tmp_path))


@pytest.mark.parametrize("pp,ep", [(2, 1), (1, 2), (2, 2)], ids=["pp2_dp2", "ep2_dp4", "pp2_ep2_dp2"])
def test_nxd_trainer_fsdp_pipeline_or_experts_matches_trainer(ranks4, tmp_path, pp, ep):
    """NxDTrainer(fsdp="full_shard") on a Mixtral at pp=2 x dp=2 (each stage its own FSDP root), at
    ep=2 x dp=4 (experts over the expert-data group) and at pp=2 x ep=2 (both) against one-process
    transformers.Trainer."""
    ranks4.run(moe_pp.trainer_matches_hf, "mixtral", str(tmp_path), pp=pp, ep=ep, fsdp="full_shard", steps=3)


