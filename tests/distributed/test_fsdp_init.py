"""``parallelize(model_on_meta, param_init_fn=fn, data_parallel_sharding=...)`` initializes FSDP2's
data-parallel shards one TP-local parameter at a time (``nxd_hf.fsdp.init``): the gathered
parameters equal, bit for bit, those ``fn`` gives without FSDP on the same ranks (the same draws in
the same order), the embedding tied to the LM head included (the head's init reads the value the
embedding's gave it), and the largest tensor ever built is exactly the largest TP-local parameter.
At dp=2, tp=2 x dp=2 and pp=2 x dp=2 (the tie across the stages). The ranks2 case comes first."""

import torch
from torch.distributed.tensor import DTensor

from support import hf_parity
import nxd_hf
from nxd_hf import parallel_state
from nxd_hf.checkpoint.dp_shard import local_of


def _init_recording(seen: list[int], after: list | None = None):
    """A ``param_init_fn`` drawing from torch's generator; the LM head's (tied) weight is scaled and
    perturbed from its current value, so it must see what the embedding's init left. ``seen`` gets
    the bytes of every tensor it is handed; ``after`` the generator state after each call."""

    def init(module) -> None:
        _init(module)
        if after is not None:
            after.append(torch.get_rng_state())

    def _init(module) -> None:
        with torch.no_grad():
            for param in module.parameters(recurse=False):
                assert not isinstance(param, DTensor) and not param.is_meta, type(param)
                seen.append(param.numel() * param.element_size())
                if getattr(module, "output_size", None) == hf_parity.VOCAB:  # the LM head (ColumnParallelLinear)
                    param.mul_(0.5).add_(torch.randn_like(param), alpha=0.01)
                else:
                    param.normal_(0.0, 0.02)

    return init


def _config():
    config_cls, _, kwargs = hf_parity.TINY["llama"]
    return config_cls(**{**kwargs, "tie_word_embeddings": True, "attention_bias": False})


def _build(fsdp: bool, tp: int, pp: int, seen: list[int], after: list | None = None, **lora):
    parallel_state.destroy_model_parallel()
    with torch.device("meta"):
        model = hf_parity.TINY["llama"][1](_config())
    torch.manual_seed(0)
    kwargs = dict(num_microbatches=2) if pp > 1 else {}
    return nxd_hf.parallelize(model, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                              param_init_fn=_init_recording(seen, after),
                              data_parallel_sharding="zero3" if fsdp else None, **kwargs, **lora)


def check_meta_init_into_dp_shards(tp: int, pp: int) -> None:
    seen_plain, seen_fsdp = [], []
    plain = _build(False, tp, pp, seen_plain)
    assert plain.nxd.init_report is None
    want = nxd_hf.full_state_dict(plain)
    model = _build(True, tp, pp, seen_fsdp)
    params = list(model.parameters())
    assert all(isinstance(p, DTensor) and not local_of(p).is_meta for p in params)
    got = nxd_hf.full_state_dict(model)
    assert set(got) == set(want), set(got) ^ set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    # fn saw what it sees without FSDP: the same TP-local tensors, in the same order
    assert seen_fsdp == seen_plain, (seen_fsdp, seen_plain)
    largest_tp_local = max(p.numel() * p.element_size() for p in params)  # a DTensor's shape is TP-local
    assert model.nxd.init_report.largest_bytes == max(seen_fsdp) == largest_tp_local, model.nxd.init_report
    assert max(local_of(p).numel() * 4 for p in params) < largest_tp_local  # at rest: 1/dp of it


def check_lora_meta_init_into_dp_shards(tp: int, pp: int = 1) -> None:
    """param_init_fn with lora_config under ZeRO-3: the base initialized into the DP shards, the
    adapters made on the meta base and drawn after the init, as without FSDP: every parameter
    bit-equal to the init without FSDP, the adapters to plain peft's drawn from the generator state
    that init leaves, one step equal to plain peft's; the largest tensor built one TP-local parameter
    (before, the whole TP shard was materialized first). At pp=2 (each stage's adapters drawn as on
    the whole model from where that stage's init left the generator, ``nxd_hf.lora.init_rng``):
    bit-equal to the init without FSDP at pp=2, the generator left where that init leaves it."""
    import copy

    import peft

    from support import lora

    config = lora.lora_config(target_modules=["q_proj", "v_proj", "down_proj"])
    seen_plain, seen_fsdp, after = [], [], []
    plain = _build(False, tp, pp, seen_plain, after, lora_config=copy.deepcopy(config))
    want, rng_plain = nxd_hf.full_state_dict(plain), torch.get_rng_state()
    model = _build(True, tp, pp, seen_fsdp, lora_config=copy.deepcopy(config))
    assert torch.equal(torch.get_rng_state(), rng_plain), "the generator is not where the init without FSDP leaves it"
    got = nxd_hf.full_state_dict(model)
    assert set(got) == set(want), set(got) ^ set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    assert seen_fsdp == seen_plain, (seen_fsdp, seen_plain)  # fn never handed an adapter
    largest_tp_local = max(p.numel() * p.element_size() for p in model.parameters())
    assert model.nxd.init_report.largest_bytes == max(seen_fsdp) == largest_tp_local, model.nxd.init_report
    if pp > 1:  # one step at pp=2 against plain peft: tests/distributed/test_fsdp_loading.py
        return
    # plain peft on one process, on the same base, drawing from where the init left the generator
    reference = hf_parity.TINY["llama"][1](_config())
    base = {n.replace(".base_layer", ""): v for n, v in want.items() if ".lora_" not in n}
    reference.load_state_dict(base, strict=False)
    torch.set_rng_state(after[-1])
    ref_peft = peft.get_peft_model(reference.to(hf_parity.backend.default_device()), copy.deepcopy(config))
    lora.check_dp_sharded_against_peft(model, ref_peft, f"lora init tp={tp}")


def check_meta_init_failures_raise_on_every_rank() -> None:
    """An init failing on one rank only (before the head's gather of the tied weight, which every
    rank joins), and replicas seeded differently: every rank raises the same ValueError, no hang."""
    failing = _init_recording([])

    def fail_on_rank1(module) -> None:
        if torch.distributed.get_rank() == 1 and "Embedding" in type(module).__name__:
            raise RuntimeError("init broke on this rank")
        failing(module)

    for init, seed, expected in ((fail_on_rank1, 0, "failed on rank 1"), (failing, None, "replicas hold different")):
        parallel_state.destroy_model_parallel()
        config_cls, model_cls, kwargs = hf_parity.TINY["llama"]
        with torch.device("meta"):
            model = model_cls(config_cls(**{**kwargs, "tie_word_embeddings": True}))
        torch.manual_seed(torch.distributed.get_rank() if seed is None else seed)
        try:
            nxd_hf.parallelize(model, param_init_fn=init, data_parallel_sharding="zero3")
        except ValueError as error:
            assert expected in str(error), error
        else:
            raise AssertionError(f"expected a ValueError with {expected!r}")


def test_meta_init_into_dp_shards_dp2(ranks2):
    ranks2.run(check_meta_init_into_dp_shards, 1, 1)


def test_meta_init_failures_raise_on_every_rank_dp2(ranks2):
    ranks2.run(check_meta_init_failures_raise_on_every_rank)


def test_lora_meta_init_into_dp_shards_dp2(ranks2):
    ranks2.run(check_lora_meta_init_into_dp_shards, 1)


def test_meta_init_into_dp_shards_tp2_dp2(ranks4):
    ranks4.run(check_meta_init_into_dp_shards, 2, 1)


def test_lora_meta_init_into_dp_shards_tp2_dp2(ranks4):
    ranks4.run(check_lora_meta_init_into_dp_shards, 2)


def test_meta_init_into_dp_shards_pp2_dp2_tied_across_stages(ranks4):
    ranks4.run(check_meta_init_into_dp_shards, 1, 2)


def test_lora_meta_init_into_dp_shards_pp2_dp2(ranks4):
    ranks4.run(check_lora_meta_init_into_dp_shards, 1, 2)
