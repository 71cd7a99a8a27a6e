"""Shared pieces of the checkpoint tests: a config-API training setup at any (tp, pp, dp,
ZeRO-1), deterministic batches by step number, and whole-model / whole-optimizer views that
do not depend on the parallel sizes."""

import torch

import nxd_hf
from nxd_hf import parallel_state
from nxd_hf.checkpoint import full_optimizer_state
from support import hf_parity


BATCH = 8
SEQ = 8


def model_fn(model_type="llama", seed=0, dropout=0.0, dtype=torch.float32):
    overrides = {"num_hidden_layers": 4}
    if model_type == "llama":
        overrides.update(attention_bias=False, attention_dropout=dropout)
    _, model = hf_parity.build_pair(model_type, seed=seed, **overrides)
    return model.to(dtype)


def lr_lambda(step):
    return 1.0 / (1.0 + 0.3 * step)


def build(tp=1, pp=1, zero1=False, seed=0, dropout=0.0, dtype=torch.float32, master_in_ckpt=False):
    """(model, optimizer, scheduler) through the config API, parallel_state re-initialized."""
    parallel_state.destroy_model_parallel()
    config = nxd_hf.neuronx_distributed_config(
        tensor_parallel_size=tp, pipeline_parallel_size=pp,
        pipeline_config={"num_microbatches": 2} if pp > 1 else None,
        optimizer_config={"zero_one_enabled": zero1, "grad_clipping": True, "max_grad_norm": 0.5},
        mixed_precision_config={"use_master_weights_in_ckpt": master_in_ckpt} if master_in_ckpt else None,
    )
    model = nxd_hf.initialize_parallel_model(config, model_fn, "llama", seed, dropout, dtype)
    optimizer = nxd_hf.initialize_parallel_optimizer(config, torch.optim.AdamW, model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    return model, optimizer, scheduler, config


def batch(step):
    ids, labels = hf_parity.batch(seed=500 + step, b=BATCH, s=SEQ)
    return ids, labels


def train(model, optimizer, scheduler, steps, start=0) -> list[float]:
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_size()
    model.train()
    losses = []
    for step in range(start, start + steps):
        ids, labels = batch(step)
        tokens = (labels[:, 1:] != -100).sum()
        loss = model.run_train(input_ids=ids.chunk(dp_size)[dp_rank], labels=labels.chunk(dp_size)[dp_rank],
                               num_items_in_batch=tokens)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(float(loss))
    return losses


def snapshot(model, optimizer) -> dict:
    """Whole model and optimizer tensors (rank 0's view; None elsewhere)."""
    params = nxd_hf.full_state_dict(model, rank0_only=True)
    state = full_optimizer_state(model, optimizer, rank0_only=True)
    return None if params is None else {"params": params, "optim": state}


def assert_snapshots_equal(a: dict, b: dict, exact=True) -> None:
    tol = dict(rtol=0, atol=0) if exact else hf_parity.TOL
    assert set(a["params"]) == set(b["params"]), set(a["params"]) ^ set(b["params"])
    for name in a["params"]:
        torch.testing.assert_close(a["params"][name], b["params"][name], **tol, msg=lambda m: f"{name}: {m}")
    assert set(a["optim"]) == set(b["optim"]), set(a["optim"]) ^ set(b["optim"])
    for name in a["optim"]:
        torch.testing.assert_close(a["optim"][name].float(), b["optim"][name].float(), **tol,
                                   msg=lambda m: f"{name}: {m}")


def tp2_llama():
    """The tiny Llama parallelized at tp=2 on fresh groups (the checkpoint-job tests' model)."""
    _, model = hf_parity.build_pair("llama")
    parallel_state.destroy_model_parallel()
    return nxd_hf.parallelize(model, tensor_parallel_size=2)


def value_error_text(fn) -> str:
    """The message of the ValueError ``fn()`` raises ("no error" if none: what every rank compares)."""
    try:
        fn()
    except ValueError as error:
        return str(error)
    return "no error"
