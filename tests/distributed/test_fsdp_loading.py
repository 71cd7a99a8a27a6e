"""``nxd_hf.from_pretrained(..., data_parallel_sharding=...)`` reads the weights straight into
FSDP2's data-parallel shards: the parameters equal HF's, bit for bit, and the largest tensor any
rank ever got from the reader is exactly its largest DP shard of one parameter (no TP shard is
materialized whole); the bytes read are exactly this rank's rows. Llama (TP along dim 0 and 1,
odd vocab padded) and GPT-2 (HF Conv1D weights, stored transposed; tied head).
GPT-2 under ZeRO-3 checkpoints: trained, saved (``save_checkpoint`` and ``save_pretrained`` in
several output shards), loaded at ZeRO-1 and at tp=2 ZeRO-3 and opened by plain transformers,
bit for bit. A pp=2 x dp=2 ZeRO-3 checkpoint (tied embedding across the stages), loaded without FSDP
at ZeRO-1 and at dp=4 under ZeRO-3: the gathered parameters and AdamW state bit for bit (MoE
checkpoints under FSDP: tests/distributed/moe/test_moe_fsdp.py). The ranks2 cases come first, then the ranks4 ones."""

import json

import peft
import torch
import transformers
from safetensors.torch import load_file

from support import hf_parity
from support.fsdp import assert_same_states, full_states
import nxd_hf
from nxd_hf import parallel_state
from nxd_hf.checkpoint.dp_shard import local_of
from nxd_hf.fsdp import is_dp_sharded, logical_tensor


def _save_reference(model_type: str, directory: str, **overrides):
    """The tiny HF model (the same on every rank), saved by rank 0."""
    reference, _ = hf_parity.build_pair(model_type, **overrides)
    if torch.distributed.get_rank() == 0:
        reference.save_pretrained(directory)
    torch.distributed.barrier()
    return reference


def check_loads_into_dp_shards(directory: str, model_type: str, tp: int, mode: str) -> None:
    parallel_state.destroy_model_parallel()
    reference = _save_reference(model_type, directory)
    model = nxd_hf.from_pretrained(directory, tensor_parallel_size=tp, data_parallel_sharding=mode,
                                   sequence_parallel=tp > 1)
    params = dict(model.named_parameters())
    assert params and all(is_dp_sharded(p) for p in params.values())
    for name, want in reference.named_parameters():
        got = _hf_layout(params[name], logical_tensor(params[name]))
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    report = model.nxd.load_report
    shards = [local_of(p) for p in params.values()]
    # the reader never handed back more than one DP shard: the largest parameter shard here
    assert report.largest_bytes == max(s.numel() * s.element_size() for s in shards), report
    real_rows = sum(_stored_numel(p) for p in params.values()) * 4  # fp32, TP padding rows not read
    assert report.bytes_read == real_rows, (report, real_rows)
    ids, labels = hf_parity.batch()  # the same rows on every DP rank: FSDP2's mean is the one gradient
    loss = model.train()(input_ids=ids, labels=labels).loss
    ref_loss = reference(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(loss, ref_loss, **hf_parity.TOL)
    loss.backward()
    ref_loss.backward()
    for name, want in reference.named_parameters():
        grad = _hf_layout(params[name], logical_tensor(params[name], params[name].grad))
        torch.testing.assert_close(grad, want.grad, **hf_parity.TOL, msg=lambda m: f"grad {name}: {m}")


def check_lora_loads_into_dp_shards(directory: str, tp: int, mode: str) -> None:
    """from_pretrained with lora_config under ZeRO-2/3: the base read straight into the DP shards
    under peft's names (``q_proj.base_layer.weight``), the adapters made on the meta base as plain
    peft makes them (same seed), one step equal to plain peft's, the adapter saved then opens in plain
    peft with the same logits; the reader never held more than one
    DP shard (before, the TP shard was read whole first: ``largest_bytes`` was the largest TP-local tensor)."""
    import copy

    from support import lora

    parallel_state.destroy_model_parallel()
    reference = _save_reference("llama", directory)
    config = lora.lora_config(target_modules=["q_proj", "v_proj", "down_proj"], bias="lora_only")
    torch.manual_seed(lora.SEED)
    ref_peft = peft.get_peft_model(reference, copy.deepcopy(config))
    torch.manual_seed(lora.SEED)
    model = nxd_hf.from_pretrained(directory, tensor_parallel_size=tp, data_parallel_sharding=mode,
                                   sequence_parallel=tp > 1, lora_config=copy.deepcopy(config))
    report = model.nxd.load_report
    base = [local_of(p) for n, p in model.named_parameters() if ".lora_" not in n]  # the adapters are not read
    assert report.largest_bytes == max(s.numel() * s.element_size() for s in base), report
    lora.check_dp_sharded_against_peft(model, ref_peft, f"lora tp={tp} {mode}")
    _step_then_adapter_opens_in_plain_peft(model, ref_peft, directory)


def _step_then_adapter_opens_in_plain_peft(model, ref_peft, directory: str) -> None:
    """A step on the gradients just compared (B is no longer zero); then the adapter saved from the
    DP shards opens in plain peft on the plain base in ``directory`` with ``ref_peft``'s logits."""
    for trained in (model, ref_peft):
        torch.optim.SGD([p for p in trained.parameters() if p.requires_grad], lr=0.5).step()
    nxd_hf.lora.save_adapter(model, f"{directory}/adapter")
    if torch.distributed.get_rank() == 0:  # the writer: the files are complete
        loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(directory),
                                                f"{directory}/adapter").eval()
        ids, _ = hf_parity.batch(seed=99)
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids).logits, ref_peft.eval()(input_ids=ids).logits,
                                       **hf_parity.TOL)


def check_load_dp_shards_needs_data_parallel_sharding() -> None:
    """Without data_parallel_sharding, and with LoRA options that copy the base while peft injects."""
    modules_to_save = peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    for kwargs, expected in (({}, "data_parallel_sharding"),
                             (dict(data_parallel_sharding="zero3", lora_config=modules_to_save), "modules_to_save")):
        parallel_state.destroy_model_parallel()
        _, model = hf_parity.build_pair("llama")
        try:
            nxd_hf.parallelize(model, load_dp_shards=lambda m: None, **kwargs)
        except ValueError as error:
            assert "load_dp_shards" in str(error) and expected in str(error), error
        else:
            raise AssertionError(f"load_dp_shards with {kwargs} was accepted")


def _stored_numel(param) -> int:
    """Elements of this rank's DP shard that come from the file (not TP's padding rows)."""
    local = local_of(param)
    if not getattr(param, "tensor_model_parallel", False) or local.numel() == 0:
        return local.numel()
    from nxd_hf.checkpoint.dp_shard import dp_rows

    start, count, _ = dp_rows(param)
    real = param.shard_index >= 0
    if param.partition_dim == 0:
        return int(real[start:start + count].sum()) * local[0].numel()
    return local.numel() // len(real) * int(real.sum())


def _hf_layout(param, tensor):
    return tensor.t() if getattr(param, "hf_transposed", False) else tensor


def _moments(model, optimizer) -> dict:
    """name -> (exp_avg, exp_avg_sq), logical and in HF layout."""
    return {name: tuple(_hf_layout(p, logical_tensor(p, optimizer.state[p][k])) for k in ("exp_avg", "exp_avg_sq"))
            for name, p in model.named_parameters()}


def check_gpt2_zero3_checkpoint(tmp_dir: str) -> None:
    """Two AdamW steps of GPT-2 (HF Conv1D weights, tied head) at ZeRO-3 dp=2, then
    ``save_checkpoint`` and ``save_pretrained`` (in output shards of at most 20 kB, or one bigger
    tensor: rank 0 holds one at a time); plain transformers opens the latter, ZeRO-1 and tp=2 ZeRO-3 load the former:
    the trained parameters (and AdamW's moments) exactly."""
    from nxd_hf.optim import NeuronZero1Optimizer

    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair("gpt2")
    nxd_hf.parallelize(model, data_parallel_sharding="zero3")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dp_rank = parallel_state.get_data_parallel_rank()
    for seed in (1, 2):
        ids, labels = hf_parity.batch(seed=seed, b=4)
        model(input_ids=ids.chunk(2)[dp_rank], labels=labels.chunk(2)[dp_rank]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    want = {name: _hf_layout(p, logical_tensor(p)) for name, p in model.named_parameters()}
    want_moments = _moments(model, optimizer)
    assert not torch.equal(want["transformer.h.0.attn.c_attn.weight"], reference.transformer.h[0].attn.c_attn.weight)
    nxd_hf.save_checkpoint(tmp_dir, "step2", model=model, optimizer=optimizer)
    model.save_pretrained(f"{tmp_dir}/hf", max_shard_size="20kB")
    with open(f"{tmp_dir}/hf/model.safetensors.index.json") as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    held = [[t.numel() * t.element_size() for t in load_file(f"{tmp_dir}/hf/{f}").values()] for f in files]
    assert len(files) > 3 and all(sum(f) <= 20_000 or len(f) == 1 for f in held), held  # a bigger tensor: alone
    plain = transformers.GPT2LMHeadModel.from_pretrained(f"{tmp_dir}/hf")
    for name, param in plain.named_parameters():
        torch.testing.assert_close(param.detach(), want[name], rtol=0, atol=0, msg=lambda m: f"transformers {name}: {m}")
    for layout in ("zero1", "tp2_zero3"):
        parallel_state.destroy_model_parallel()
        _, other = hf_parity.build_pair("gpt2")
        if layout == "zero1":
            nxd_hf.parallelize(other)
            other_optimizer = NeuronZero1Optimizer(other.parameters(), torch.optim.AdamW, lr=1e-3)
        else:
            nxd_hf.parallelize(other, tensor_parallel_size=2, data_parallel_sharding="zero3")
            other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-3)
        nxd_hf.load_checkpoint(tmp_dir, "step2", model=other, optimizer=other_optimizer)
        for name, param in other.named_parameters():
            torch.testing.assert_close(_hf_layout(param, logical_tensor(param)), want[name], rtol=0, atol=0,
                                       msg=lambda m: f"{layout} {name}: {m}")
        if layout == "tp2_zero3":
            for name, moments in _moments(other, other_optimizer).items():
                for got, expected in zip(moments, want_moments[name]):
                    torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=lambda m: f"{layout} {name}: {m}")


def test_gpt2_conv1d_zero3_checkpoint_loads_at_zero1_tp2_and_in_transformers(ranks2, tmp_path):
    ranks2.run(check_gpt2_zero3_checkpoint, str(tmp_path))


def test_from_pretrained_zero3_llama_dp2(ranks2, tmp_path):
    ranks2.run(check_loads_into_dp_shards, str(tmp_path), "llama", 1, "zero3")


def test_from_pretrained_lora_zero3_dp2(ranks2, tmp_path):
    ranks2.run(check_lora_loads_into_dp_shards, str(tmp_path), 1, "zero3")


def test_load_dp_shards_needs_data_parallel_sharding(ranks2):
    ranks2.run(check_load_dp_shards_needs_data_parallel_sharding)


def test_from_pretrained_zero3_gpt2_conv1d_dp2(ranks2, tmp_path):
    ranks2.run(check_loads_into_dp_shards, str(tmp_path), "gpt2", 1, "zero3")


def test_from_pretrained_zero2_llama_tp2_dp2(ranks4, tmp_path):
    ranks4.run(check_loads_into_dp_shards, str(tmp_path), "llama", 2, "zero2")


def test_from_pretrained_lora_zero2_tp2_dp2(ranks4, tmp_path):
    ranks4.run(check_lora_loads_into_dp_shards, str(tmp_path), 2, "zero2")


def test_from_pretrained_zero3_gpt2_conv1d_tp2_dp2(ranks4, tmp_path):
    ranks4.run(check_loads_into_dp_shards, str(tmp_path), "gpt2", 2, "zero3")


def _build_pipeline(zero3: bool, pp: int):
    """Llama (embedding tied to the head, across the stages at pp=2) at ``pp`` x dp=4/pp: ZeRO-3 +
    AdamW, or no FSDP + ZeRO-1."""
    from nxd_hf.optim import NeuronZero1Optimizer

    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama", attention_bias=False, tie_word_embeddings=True)
    kwargs = dict(pipeline_parallel_size=pp, num_microbatches=2, broadcast_and_average_loss=True) if pp > 1 else {}
    model = nxd_hf.parallelize(model, data_parallel_sharding="zero3" if zero3 else None, **kwargs)
    if zero3:
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return model, NeuronZero1Optimizer(model.parameters(), torch.optim.AdamW, grad_clipping=False, lr=1e-3,
                                       weight_decay=0.1)


def check_pipeline_zero3_checkpoint(tmp_dir: str) -> None:
    """Two AdamW steps at pp=2 x dp=2 ZeRO-3, ``save_checkpoint``; loaded at pp=2 x dp=2 ZeRO-1
    (no FSDP) and at pp=1 x dp=4 ZeRO-3: the gathered parameters and AdamW state (moments, step)
    exactly."""
    model, optimizer = _build_pipeline(zero3=True, pp=2)
    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    for seed in (1, 2):
        ids, labels = hf_parity.batch(seed=seed, b=4)
        model.run_train(input_ids=ids.chunk(dp)[dp_rank], labels=labels.chunk(dp)[dp_rank])
        optimizer.step()
        optimizer.zero_grad()
    nxd_hf.save_checkpoint(tmp_dir, "pp2", model=model, optimizer=optimizer)
    saved = full_states(model, optimizer)
    assert any(k.endswith("::exp_avg") for k in saved[1]), sorted(saved[1])[:4]
    for zero3, pp in ((False, 2), (True, 1)):
        model, optimizer = _build_pipeline(zero3, pp)
        nxd_hf.load_checkpoint(tmp_dir, "pp2", model=model, optimizer=optimizer)
        assert_same_states(saved, full_states(model, optimizer), f"pp={pp} {'zero3' if zero3 else 'zero1'}")


def test_pp2_dp2_zero3_checkpoint_loads_at_zero1_and_dp4_zero3(ranks4, tmp_path):
    ranks4.run(check_pipeline_zero3_checkpoint, str(tmp_path))


def check_pipeline_loads_into_dp_shards(directory: str, with_lora: bool) -> None:
    """``from_pretrained`` at pp=2 x dp=2 ZeRO-3: each stage's parameters read straight into its
    DP shards, equal to HF's bit for bit (the embedding tied to the head across the stages); one
    step's loss and gradients equal HF's; the reader never held more than one DP shard. With LoRA
    (``with_lora``): the base read under peft's names, each stage's adapters made on the meta base
    as plain peft makes them on the whole model (same seed), every parameter bit-equal to plain
    peft's, the step's loss and adapter (and trained bias) gradients equal to plain peft's, the base
    (the frozen tied embedding too) without gradient, and the adapter saved after a step opens in
    plain peft (before, each stage's TP shard was read whole first: ``largest_bytes`` was the
    largest TP-local tensor)."""
    import copy

    from support import lora

    parallel_state.destroy_model_parallel()
    config = lora.lora_config(target_modules=["q_proj", "v_proj", "down_proj"], bias="lora_only")
    reference = _save_reference("llama", directory, tie_word_embeddings=True, attention_bias=with_lora)
    if with_lora:
        torch.manual_seed(lora.SEED)
        reference = peft.get_peft_model(reference, copy.deepcopy(config))
    torch.manual_seed(lora.SEED)
    model = nxd_hf.from_pretrained(directory, pipeline_parallel_size=2, data_parallel_sharding="zero3",
                                   num_microbatches=2, broadcast_and_average_loss=True,
                                   lora_config=copy.deepcopy(config) if with_lora else None)
    ref = {n.removeprefix("base_model.model."): p for n, p in reference.named_parameters(remove_duplicate=False)}
    params = dict(model.named_parameters())
    held = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(held, sorted(params))
    assert set().union(*held) == ref.keys(), sorted(set().union(*held) ^ ref.keys())[:4]  # the stages hold them all
    assert all(is_dp_sharded(p) and not local_of(p).is_meta for p in params.values())
    for name, param in params.items():
        assert param.requires_grad == ref[name].requires_grad, name
        torch.testing.assert_close(logical_tensor(param), ref[name].detach(), rtol=0, atol=0,
                                   msg=lambda m: f"{name}: {m}")
    report = model.nxd.load_report
    base = [local_of(p) for n, p in params.items() if ".lora_" not in n]  # the adapters are not read
    assert report.largest_bytes == max(s.numel() * s.element_size() for s in base), report
    ids, labels = hf_parity.batch(b=4)
    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    model.train()
    loss = model.run_train(input_ids=ids.chunk(dp)[dp_rank], labels=labels.chunk(dp)[dp_rank])
    ref_loss = reference.train()(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **hf_parity.TOL)
    for name, param in params.items():
        if not param.requires_grad:
            assert param.grad is None, f"base {name} got a gradient"
            continue
        torch.testing.assert_close(logical_tensor(param, param.grad), ref[name].grad, **hf_parity.TOL,
                                   msg=lambda m: f"grad {name}: {m}")
    if with_lora:
        _step_then_adapter_opens_in_plain_peft(model, reference, directory)


def test_from_pretrained_zero3_pp2_dp2_tied_embedding(ranks4, tmp_path):
    ranks4.run(check_pipeline_loads_into_dp_shards, str(tmp_path), False)


def test_from_pretrained_lora_zero3_pp2_dp2(ranks4, tmp_path):
    ranks4.run(check_pipeline_loads_into_dp_shards, str(tmp_path), True)
