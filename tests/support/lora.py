"""What the LoRA tests share: a parallel peft model and plain peft on the unsharded model built
from the same weights (``support.hf_parity``'s tiny configs), the training comparison between them,
and logical (gathered) views of sharded adapters."""

import copy

import peft
import torch

import nxd_hf
from nxd_hf import parallel_state
from nxd_hf.parallel_layers.sharding import full_tensor
from support import hf_parity


TOL = hf_parity.TOL
STEPS = 5
LR = 1e-3  # test_hf_training.py: Adam turns rounding of near-zero gradients into ~lr steps
SEED = 7
ALL_LLAMA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_config(**kwargs) -> peft.LoraConfig:
    return peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, **kwargs})


def logical(param: torch.Tensor) -> torch.Tensor:
    full = full_tensor(param)
    return full.t() if getattr(param, "hf_transposed", False) else full


def peft_pair(model_type: str, tp: int, config: peft.LoraConfig, *, sp=False, task_model_cls=None, dp=1, **overrides):
    """(plain peft model, parallel peft model) with equal base weights, same seed for the adapters."""
    parallel_state.destroy_model_parallel()
    reference, model = hf_parity.build_pair(model_type, task_model_cls=task_model_cls, **overrides)
    model = nxd_hf.parallelize(model, tensor_parallel_size=tp, sequence_parallel=sp)
    assert parallel_state.get_data_parallel_size() == dp
    torch.manual_seed(SEED)
    ref_peft = peft.get_peft_model(reference, copy.deepcopy(config))
    torch.manual_seed(SEED)
    par_peft = peft.get_peft_model(model, copy.deepcopy(config))
    return ref_peft, par_peft


def assert_adapters_equal(par_peft, ref_peft, what: str) -> None:
    ref = dict(ref_peft.named_parameters())
    trainable = [(n, p) for n, p in par_peft.named_parameters() if p.requires_grad]
    assert trainable and {n for n, _ in trainable} == {n for n, p in ref.items() if p.requires_grad}
    for name, param in trainable:
        torch.testing.assert_close(logical(param), ref[name].detach(), **TOL, msg=lambda m: f"{what} {name}: {m}")


def _loss(model, ids, labels, task: str):
    if task == "cls":
        mask = torch.ones_like(ids)
        mask[1, -2:] = 0
        return model(input_ids=ids, attention_mask=mask, labels=labels[:, 0] % 3).loss
    return model(input_ids=ids, labels=labels).loss


def train_and_compare(ref_peft, par_peft, what: str, *, task="lm", dp=1, s=8, optimizer=None, max_norm=None):
    """Five AdamW steps on both; losses each step and adapters after, equal. With dp > 1 each DP
    rank takes its half of the batch and the reference averages the halves' losses. With
    ``max_norm`` the reference clips its gradient norm (``optimizer``, e.g. ZeRO-1, clips its own)."""
    assert_adapters_equal(par_peft, ref_peft, f"{what} init")
    ref_opt = torch.optim.AdamW([p for p in ref_peft.parameters() if p.requires_grad], lr=LR)
    opt = optimizer or torch.optim.AdamW([p for p in par_peft.parameters() if p.requires_grad], lr=LR)
    dp_rank = parallel_state.get_data_parallel_rank()
    ref_norms = []
    for step in range(STEPS):
        ids, labels = hf_parity.batch(seed=20 + step, b=2 * dp, s=s)
        torch.manual_seed(1000 + step)  # equal dropout draws (dp=1)
        ref_losses = [_loss(ref_peft, i, l, task) for i, l in zip(ids.chunk(dp), labels.chunk(dp))]
        (sum(ref_losses) / dp).backward()
        torch.manual_seed(1000 + step)
        loss = _loss(par_peft, ids.chunk(dp)[dp_rank], labels.chunk(dp)[dp_rank], task)
        loss.backward()
        torch.testing.assert_close(loss, ref_losses[dp_rank], **TOL, msg=lambda m: f"{what} step {step}: {m}")
        if max_norm is not None:
            ref_norms.append(torch.nn.utils.clip_grad_norm_([p for p in ref_peft.parameters() if p.requires_grad],
                                                            max_norm))
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    assert_adapters_equal(par_peft, ref_peft, f"{what} after {STEPS} steps")
    frozen = [n for n, p in par_peft.named_parameters() if not p.requires_grad]
    assert frozen and all(par_peft.get_parameter(n).grad is None for n in frozen), "base weights got a gradient"
    if optimizer is None:
        state_ids = {id(p) for p in opt.state}
        assert state_ids == {id(p) for p in par_peft.parameters() if p.requires_grad}, "optimizer state beyond adapters"
    assert max_norm is None or max(ref_norms) > max_norm, "clipping must be active"


def eval_logits(peft_model, ids) -> torch.Tensor:
    peft_model.eval()
    with torch.no_grad():
        logits = peft_model(input_ids=ids).logits
    peft_model.train()
    return logits


def check_training(model_type: str, tp: int, *, sp=False, dp=1, task_model_cls=None, task="lm", **config_kwargs):
    config = lora_config(**config_kwargs)
    ref_peft, par_peft = peft_pair(model_type, tp, config, sp=sp, dp=dp, task_model_cls=task_model_cls)
    what = f"{model_type} tp={tp} sp={sp} dp={dp}"
    # peft's print_trainable_parameters counts the unparallelized model (padding, K/V copies, shards)
    assert par_peft.get_nb_trainable_parameters() == ref_peft.get_nb_trainable_parameters(), what
    train_and_compare(ref_peft, par_peft, what, task=task, dp=dp)
    ids, _ = hf_parity.batch(seed=99)
    ref_logits = eval_logits(ref_peft, ids)
    torch.testing.assert_close(eval_logits(par_peft, ids), ref_logits, **TOL, msg=lambda m: f"{what} logits: {m}")
    merged = par_peft.merge_and_unload()  # into the sharded (padded, replicated, Conv1D) weights
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    merged.eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, ref_logits, **TOL, msg=lambda m: f"{what} merged: {m}")


def check_dp_sharded_against_peft(model, ref_peft, what: str) -> None:
    """A LoRA model under ZeRO-2/3 against plain peft on one process (same base, same seed for the
    adapters): every parameter bit-equal at start, base and adapters (HF layout), then one step on
    the same batch on every rank (FSDP2's mean is then the one gradient): the loss and every
    adapter's gradient equal, and the base without gradient."""
    from nxd_hf.fsdp import is_dp_sharded, logical_tensor

    def hf_layout(param, tensor):
        return tensor.t() if getattr(param, "hf_transposed", False) else tensor

    ref = {n.removeprefix("base_model.model."): p for n, p in ref_peft.named_parameters()}
    params = dict(model.named_parameters())
    assert params.keys() == ref.keys(), sorted(params.keys() ^ ref.keys())[:4]
    assert all(is_dp_sharded(p) for p in params.values())  # the frozen base and the adapters
    for name, param in params.items():
        assert param.requires_grad == ref[name].requires_grad, name
        torch.testing.assert_close(hf_layout(param, logical_tensor(param)), ref[name].detach(), rtol=0, atol=0,
                                   msg=lambda m: f"{what} {name}: {m}")
    ids, labels = hf_parity.batch()
    loss = model.train()(input_ids=ids, labels=labels).loss
    ref_loss = ref_peft.train()(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(loss, ref_loss, **TOL)
    loss.backward()
    ref_loss.backward()
    for name, param in params.items():
        if not param.requires_grad:
            assert param.grad is None, f"{what} base {name} got a gradient"
            continue
        grad = hf_layout(param, logical_tensor(param, param.grad))
        torch.testing.assert_close(grad, ref[name].grad, **TOL, msg=lambda m: f"{what} grad {name}: {m}")
