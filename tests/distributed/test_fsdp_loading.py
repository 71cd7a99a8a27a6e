"""``nxd_hf.from_pretrained(..., data_parallel_sharding=...)`` reads the weights straight into
FSDP2's data-parallel shards: the parameters equal HF's, bit for bit, and the largest tensor any
rank ever got from the reader is exactly its largest DP shard of one parameter (no TP shard is
materialized whole); the bytes read are exactly this rank's rows. Llama (TP along dim 0 and 1,
odd vocab padded) and GPT-2 (HF Conv1D weights, stored transposed; tied head).
The ranks2 cases come first, then the ranks4 ones."""

import torch
import transformers

from support import hf_parity
import nxd_hf
from nxd_hf import parallel_state
from nxd_hf.checkpoint.dp_shard import local_of
from nxd_hf.fsdp import is_dp_sharded, logical_tensor


def _save_reference(model_type: str, directory: str):
    """The tiny HF model (the same on every rank), saved by rank 0."""
    reference, _ = hf_parity.build_pair(model_type)
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
        got = logical_tensor(params[name])
        got = got.t() if getattr(params[name], "hf_transposed", False) else got
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    report = model.nxd.load_report
    shards = [local_of(p) for p in params.values()]
    # the reader never handed back more than one DP shard: the largest parameter shard here
    assert report.largest_bytes == max(s.numel() * s.element_size() for s in shards), report
    real_rows = sum(_stored_numel(p) for p in params.values()) * 4  # fp32, TP padding rows not read
    assert report.bytes_read == real_rows, (report, real_rows)
    ids, labels = hf_parity.batch()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, labels=labels).loss,
                                   reference.eval()(input_ids=ids, labels=labels).loss, **hf_parity.TOL)


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


def test_from_pretrained_zero3_llama_dp2(ranks2, tmp_path):
    ranks2.run(check_loads_into_dp_shards, str(tmp_path), "llama", 1, "zero3")


def test_from_pretrained_zero3_gpt2_conv1d_dp2(ranks2, tmp_path):
    ranks2.run(check_loads_into_dp_shards, str(tmp_path), "gpt2", 1, "zero3")


def test_from_pretrained_zero2_llama_tp2_dp2(ranks4, tmp_path):
    ranks4.run(check_loads_into_dp_shards, str(tmp_path), "llama", 2, "zero2")


def test_from_pretrained_zero3_gpt2_conv1d_tp2_dp2(ranks4, tmp_path):
    ranks4.run(check_loads_into_dp_shards, str(tmp_path), "gpt2", 2, "zero3")
