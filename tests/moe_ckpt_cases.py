"""MoE checkpoints across pipeline sizes (tests/distributed/test_moe_pipeline.py):
save_checkpoint at pp=2 <-> load at pp=1 (dp=2), and save_pretrained at pp=2 writing what
transformers' own save_pretrained writes."""

import os

import torch
import transformers

import nxd_hf
from moe_pp_cases import TOL, build_pair, moe_batch, replica_rows
from nxd_hf import backend, parallel_state

CKPT_LR = 1e-3  # weights after Adam steps at another pp: lr 1e-3 keeps rounding-noise gradients' steps ~1e-6


def _moe_model(model_type: str):
    return build_pair(model_type, aux=False)[1]


def _build(model_type: str, pp: int):
    parallel_state.destroy_model_parallel()
    config = nxd_hf.neuronx_distributed_config(pipeline_parallel_size=pp, optimizer_config={"grad_clipping": False},
                                               pipeline_config={"num_microbatches": 2} if pp > 1 else None)
    model = nxd_hf.initialize_parallel_model(config, _moe_model, model_type)
    optimizer = nxd_hf.initialize_parallel_optimizer(config, torch.optim.AdamW, model.parameters(), lr=CKPT_LR)
    return model, optimizer


def _steps(model, optimizer, steps: range) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        ids, mask, labels = replica_rows(*moe_batch(seed=300 + step))
        tokens = (moe_batch(seed=300 + step)[2][:, 1:] != -100).sum()
        losses.append(model.run_train(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=tokens))
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _reference_run(model_type: str, steps: int):
    reference, _ = build_pair(model_type, aux=False)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=CKPT_LR)
    losses = []
    for step in range(steps):
        ids, mask, labels = moe_batch(seed=300 + step)
        loss = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return reference, losses


def checkpoint_reshards(model_type: str, tmp_dir: str, *, save_pp: int, load_pp: int) -> None:
    """Two steps at pp=save_pp, save_checkpoint, load at pp=load_pp (the rest of the world is
    data parallel), one more step: losses and weights equal three steps of the plain model."""
    reference, ref_losses = _reference_run(model_type, 3)
    model, optimizer = _build(model_type, save_pp)
    losses = _steps(model, optimizer, range(2))
    nxd_hf.save_checkpoint(tmp_dir, "moe", model=model, optimizer=optimizer)
    model, optimizer = _build(model_type, load_pp)
    nxd_hf.load_checkpoint(tmp_dir, "moe", model=model, optimizer=optimizer)
    losses += _steps(model, optimizer, range(2, 3))
    torch.testing.assert_close(torch.stack([l.float() for l in losses]), torch.stack(ref_losses), **TOL)
    from nxd_hf.checkpoint.logical import DiskNames

    full = nxd_hf.full_state_dict(model)  # under the names the checkpoint stores
    disk_name = DiskNames(reference)
    ref = {disk_name(n): t for n, t in reference.state_dict().items()}
    assert set(full) == set(ref), set(full) ^ set(ref)
    for name, tensor in full.items():
        torch.testing.assert_close(tensor, ref[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def save_pretrained_loads_in_transformers(model_type: str, tmp_dir: str) -> None:
    """save_pretrained at pp=2 after a step: plain transformers loads it with the trained model's
    logits, and the files hold the tensor names transformers' own save_pretrained writes."""
    import safetensors.torch

    reference, _ = _reference_run(model_type, 1)
    model, optimizer = _build(model_type, 2)
    _steps(model, optimizer, range(1))
    nxd_hf.save_pretrained(model, f"{tmp_dir}/ours")
    if backend.rank() == 0:
        reference.save_pretrained(f"{tmp_dir}/theirs")
    backend.barrier()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(f"{tmp_dir}/ours").eval()
    ids, mask, _ = moe_batch(seed=99)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).logits,
                                   reference.eval()(input_ids=ids, attention_mask=mask).logits, **TOL)

    def names(directory):
        keys = set()
        for file in os.listdir(directory):
            if file.endswith(".safetensors"):
                keys |= set(safetensors.torch.load_file(os.path.join(directory, file)))
        return keys

    ours, theirs = names(f"{tmp_dir}/ours"), names(f"{tmp_dir}/theirs")
    assert ours == theirs, f"only ours: {sorted(ours - theirs)[:4]}; only transformers': {sorted(theirs - ours)[:4]}"
