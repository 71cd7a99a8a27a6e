"""parallelize() beyond one forward: AdamW training, data parallelism with accumulation,
generate() with KV cache, and from_pretrained reading only local slices."""

import tempfile

import pytest
import torch
import transformers

from support import hf_parity
import nxd_hf
from nxd_hf import parallel_state
from nxd_hf.parallel_layers.sharding import full_tensor, is_sharded

TOL = hf_parity.TOL
STEPS = 3


def _train(model, batches, *, dp_rank=0, dp_size=1, accumulate=1):
    """AdamW steps; each DP rank takes its slice of every batch; ``accumulate`` micro-steps
    (all but the last inside no_sync). Loss is the sum over non-ignored tokens divided by the
    global count, so DP averaging reproduces the full-batch mean."""
    # Adam normalizes each element's step, so an element whose gradient is near zero moves by
    # ~lr whatever its rounding; lr 1e-3 keeps that within atol after a few steps.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for ids, labels in batches:
        num_items = (labels[:, 1:] != -100).sum() / dp_size  # the DP average multiplies it back
        local_ids, local_labels = ids.chunk(dp_size)[dp_rank], labels.chunk(dp_size)[dp_rank]
        total = 0.0
        for micro, (mb_ids, mb_labels) in enumerate(zip(local_ids.chunk(accumulate), local_labels.chunk(accumulate))):
            sync = micro == accumulate - 1 or not hasattr(model, "no_sync")
            context = model.no_sync() if not sync else torch.enable_grad()
            with context:
                loss = model(input_ids=mb_ids, labels=mb_labels, num_items_in_batch=num_items).loss
                loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return torch.stack(losses)


def _batches(b=4, s=8):
    return [hf_parity.batch(seed=10 + step, b=b, s=s) for step in range(STEPS)]


def check_training_matches(tp: int, accumulate: int) -> None:
    parallel_state.destroy_model_parallel()
    # No attention bias here: the K bias gradient is analytically zero (softmax is shift
    # invariant), so Adam would turn its rounding noise into full-size steps of random sign.
    reference, model = hf_parity.build_pair("llama", attention_bias=False)
    ref_losses = _train(reference, _batches())
    nxd_hf.parallelize(model, tensor_parallel_size=tp)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_size()
    losses = _train(model, _batches(), dp_rank=dp_rank, dp_size=dp_size, accumulate=accumulate)
    torch.distributed.all_reduce(losses, group=parallel_state.get_data_parallel_group())
    torch.testing.assert_close(losses / dp_size, ref_losses, **TOL)  # each rank's loss was scaled by dp
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        full = full_tensor(param)
        torch.testing.assert_close(full, ref_params[name].detach(), **TOL, msg=lambda m: f"{name}: {m}")


def check_generate(tp: int) -> None:
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair("llama")
    nxd_hf.parallelize(model, tensor_parallel_size=tp)
    ids, _ = hf_parity.batch(b=2, s=5)
    kwargs = dict(max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
    reference.eval()
    model.eval()
    expected = reference.generate(ids, **kwargs)
    got = model.generate(ids, **kwargs)
    assert got.shape[1] == ids.shape[1] + 8
    assert torch.equal(got, expected), (got, expected)


def check_from_pretrained(path: str, tp: int) -> None:
    parallel_state.destroy_model_parallel()
    model = nxd_hf.from_pretrained(path, tensor_parallel_size=tp)
    if model.config.model_type == "gpt_neox":  # HF renames embed_out -> lm_head on load; we follow it
        reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        ids, _ = hf_parity.batch()
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, **TOL)
        return
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids, labels = hf_parity.batch()
    with torch.no_grad():
        out, ref_out = model(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.logits, ref_out.logits, **TOL)
    torch.testing.assert_close(out.loss, ref_out.loss, **TOL)
    # exactly this rank's real rows of every sharded tensor plus the replicated ones
    expected = 0
    for param in model.parameters():
        if is_sharded(param):
            real_rows = int((param.shard_index >= 0).sum())
            expected += real_rows * param.numel() // param.shape[param.partition_dim] * param.element_size()
        else:
            expected += param.numel() * param.element_size()
    assert model.nxd.load_report.bytes_read == expected, (model.nxd.load_report.bytes_read, expected)
    full_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    assert expected < full_bytes / tp * 1.5


@pytest.mark.parametrize("tp,accumulate", [(4, 1), (2, 2)], ids=["tp4_dp1", "tp2_dp2_accumulate2_no_sync_first"])
def test_training_matches_hf(ranks4, tp, accumulate):
    ranks4.run(check_training_matches, tp=tp, accumulate=accumulate)


@pytest.mark.parametrize("tp", [2, 4], ids=lambda tp: f"tp{tp}")
def test_generate_matches_hf(ranks4, tp):
    ranks4.run(check_generate, tp)


def test_from_pretrained_sharded_files_reads_only_local_rows_tp4(ranks4, tmp_path):
    reference, _ = hf_parity.build_pair("llama")
    reference.save_pretrained(tmp_path, max_shard_size="20KB")  # several files and an index
    assert (tmp_path / "model.safetensors.index.json").exists()
    ranks4.run(check_from_pretrained, str(tmp_path), tp=4)


def test_from_pretrained_gpt_neox_tp2(ranks4, tmp_path):
    neox, _ = hf_parity.build_pair("gpt_neox")
    neox.save_pretrained(tmp_path / "neox")
    ranks4.run(check_from_pretrained, str(tmp_path / "neox"), tp=2)


def _layout_only(model, *, tp, pad_model="auto", kv_size_multiplier="auto"):
    """The head-layout checks parallelize runs, for a TP size this process does not have."""
    from nxd_hf.setup_steps import attention_layout
    from nxd_hf.architectures import get_patch

    parallel_state.destroy_model_parallel()
    original = parallel_state.get_tensor_model_parallel_size
    parallel_state.get_tensor_model_parallel_size = lambda: tp
    try:
        return attention_layout(model, get_patch(model.config), pad_model=pad_model,
                                kv_size_multiplier=kv_size_multiplier)
    finally:
        parallel_state.get_tensor_model_parallel_size = original


def test_bad_input_is_a_clear_error():
    parallel_state.destroy_model_parallel()
    _, model = hf_parity.build_pair("llama")
    nxd_hf.parallelize(model)
    with pytest.raises(ValueError, match="already parallelized"):
        nxd_hf.parallelize(model)
    _, model = hf_parity.build_pair("llama")
    model.config.quantization_config = {"quant_method": "bitsandbytes"}
    with pytest.raises(ValueError, match="quantized"):
        nxd_hf.parallelize(model)
    for kwargs, message in (
        (dict(pad_model=False), "pad_model=False"),  # 6 heads do not divide over... checked at tp 4 below
        (dict(kv_size_multiplier=0), "kv_size_multiplier"),
        (dict(pad_model="yes"), "pad_model must be"),
    ):
        _, model = hf_parity.build_pair("llama")
        with pytest.raises(ValueError, match=message):
            _layout_only(model, tp=4, **kwargs)
    _, model = hf_parity.build_pair("llama")
    with pytest.raises(ValueError, match="exceeds the 6 attention heads"):
        _layout_only(model, tp=8)
    with tempfile.TemporaryDirectory() as empty, pytest.raises(ValueError, match="save_pretrained"):
        from nxd_hf.checkpoint.hf_safetensors import SafetensorsCheckpoint
        SafetensorsCheckpoint(empty)
