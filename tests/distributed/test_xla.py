"""The XLA lane (``make test-xla``): nxd_hf on one torch-xla device on the CPU (PJRT).

Marked ``xla`` and skipped where torch_xla is not importable (the main virtualenv: torch-xla 2.9
needs torch 2.9; ``make test-xla`` builds ``.venv-xla`` for it). The pytest process is a world of
one (``backend.init_process_group_from_env`` without torchrun) whose compute device is the XLA
device, because ``PJRT_DEVICE`` is set. Every case runs the same thing on plain CPU torch and on
the XLA device from the same weights and data and compares on the host. Two PJRT processes are
not tested here: see docs/xla.md for why.
"""

import importlib.util
import os

import pytest
import torch
from torch import nn

pytestmark = [pytest.mark.xla, pytest.mark.skipif(
    importlib.util.find_spec("torch_xla") is None,
    reason="needs torch-xla (torch 2.9): run `make test-xla`, which builds .venv-xla")]

# XLA's CPU backend compiles the graph with its own fusions and reduction order, so results may
# differ from eager CPU torch by rounding. Measured here for the tiny llama's tp=1 step: the
# loss equal, the largest gradient difference 1.5e-7. The project's fp32 tolerance holds; keep it.
TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def xla():
    """The XLA device of a world of one (PJRT on the CPU unless the caller chose a device)."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    from nxd_hf import backend, parallel_state

    backend.init_process_group_from_env()
    device = backend.default_device()
    assert device.type == "xla", f"PJRT_DEVICE is set but nxd_hf computes on {device}"
    yield device
    parallel_state.destroy_model_parallel()


def host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu()


def test_default_device_is_xla_in_a_world_of_one(xla):
    from nxd_hf import backend

    assert backend.default_backend() == "xla"
    assert backend.collective_device(None).type in ("xla", "cpu")
    assert backend.launch_device("xla") == "the XLA device"


@pytest.mark.parametrize("kind", ["column", "row", "embedding"])
def test_sharded_layers_tp1_match_torch_on_cpu(xla, kind):
    from nxd_hf import parallel_state
    from nxd_hf.parallel_layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear, move_model_to_device

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(7)
    ref = nn.Embedding(11, 12, padding_idx=0) if kind == "embedding" else nn.Linear(12, 10)
    torch.manual_seed(7)
    layer = {"column": lambda: ColumnParallelLinear(12, 10), "row": lambda: RowParallelLinear(12, 10),
             "embedding": lambda: ParallelEmbedding(11, 12, padding_idx=0)}[kind]()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 11, (2, 8), generator=g) if kind == "embedding" else torch.randn(2, 8, 12, generator=g)
    y_ref = ref(x)
    probe = torch.randn(y_ref.shape, generator=g)
    (y_ref * probe).sum().backward()

    move_model_to_device(layer, xla)
    y = layer(x.to(xla))
    (y * probe.to(xla)).sum().backward()
    torch.testing.assert_close(host(y), y_ref.detach(), **TOL)
    torch.testing.assert_close(host(layer.weight.grad), ref.weight.grad, **TOL)
    if kind != "embedding":
        torch.testing.assert_close(host(layer.bias.grad), ref.bias.grad, **TOL)


@pytest.mark.parametrize("smoothing, reduction", [(0.0, "mean"), (0.1, "sum"), (0.0, "none")])
def test_parallel_cross_entropy_matches_torch_on_cpu(xla, smoothing, reduction):
    from nxd_hf import parallel_state
    from nxd_hf.parallel_layers.loss_functions import parallel_cross_entropy

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 8, 13, generator=g, requires_grad=True)
    labels = torch.randint(0, 13, (2, 8), generator=g)
    labels[0, :3] = -100
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=smoothing,
                                            reduction=reduction)
    ref = ref.view(labels.shape) if reduction == "none" else ref
    ref.sum().backward()
    on_xla = logits.detach().to(xla).requires_grad_(True)
    loss = parallel_cross_entropy(on_xla, labels.to(xla), smoothing, reduction=reduction)
    loss.sum().backward()
    torch.testing.assert_close(host(loss), ref.detach(), **TOL)
    torch.testing.assert_close(host(on_xla.grad), logits.grad, **TOL)


def test_move_model_to_device_keeps_sharding_metadata_on_xla(xla):
    from nxd_hf.parallel_layers import ColumnParallelLinear, move_model_to_device

    layer = ColumnParallelLinear(4, 6)
    moved = move_model_to_device(nn.Sequential(layer), xla)
    weight = moved[0].weight
    assert weight.device.type == "xla"
    assert weight.tensor_model_parallel and weight.partition_dim == 0
    assert torch.equal(weight.shard_index.cpu(), torch.arange(6))


def _llama_pair():
    """(plain HF llama on the CPU, a copy nxd_hf parallelizes at tp=1 onto the XLA device)."""
    from support import hf_parity
    import nxd_hf
    from nxd_hf import parity

    config_cls, model_cls, kwargs = hf_parity.TINY["llama"]
    reference, model = parity.build_pair(config_cls(**{**kwargs, "attention_bias": False}), model_cls,
                                         perturb="norms")
    nxd_hf.parallelize(model, tensor_parallel_size=1)
    return reference, model


def _batches(steps: int):
    from support import hf_parity
    from nxd_hf import parity

    return [parity.make_batch(hf_parity.VOCAB, batch_size=4, seq_len=8, seed=20 + s) for s in range(steps)]


def test_tp1_train_step_matches_plain_torch_on_cpu(xla):
    """One forward/backward of a tiny llama: loss and every gradient equal plain HF on the CPU."""
    from nxd_hf import backend, parallel_state, parity

    parallel_state.destroy_model_parallel()
    reference, model = _llama_pair()
    assert all(p.device.type == "xla" for p in model.parameters()), "parallelize places the model on XLA"
    (ids, labels), = _batches(1)
    ref_loss = reference(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    loss = model(input_ids=ids.to(xla), labels=labels.to(xla)).loss
    loss.backward()
    backend.materialize()  # one graph for every gradient, not one per gradient read below
    torch.testing.assert_close(host(loss), ref_loss.detach(), **TOL)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(host(parity.gathered_grad(param)), ref_params[name].grad, **TOL,
                                   msg=lambda m: f"{name}: {m}")


def _adamw_steps(model, optimizer, batches, device, clip):
    """Training steps; on XLA each ends, as an XLA training loop must, by running the step's
    graph (``torch_xla.sync()``): otherwise the next step's graph holds this one's update, and
    each parameter read afterwards compiles a graph of its own."""
    from nxd_hf import backend

    losses = []
    for ids, labels in batches:
        loss = model(input_ids=ids.to(device), labels=labels.to(device)).loss
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        if device != "cpu":
            backend.materialize()
        losses.append(host(loss))
    return torch.stack(losses)


def test_zero1_dp1_matches_adamw_with_clipping_on_cpu(xla):
    """NeuronZero1Optimizer at dp=1 (grad clipping active) on XLA: three steps equal torch's
    AdamW + clip_grad_norm_ on plain CPU torch."""
    from nxd_hf import parallel_state
    from nxd_hf.optim import NeuronZero1Optimizer
    from nxd_hf.parallel_layers.sharding import full_tensor

    parallel_state.destroy_model_parallel()
    reference, model = _llama_pair()
    batches = _batches(3)
    ref_losses = _adamw_steps(reference, torch.optim.AdamW(reference.parameters(), lr=1e-3), batches, "cpu", True)
    with pytest.warns(UserWarning, match="nothing to shard"):
        optimizer = NeuronZero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, max_norm=0.5, model=model)
    losses = _adamw_steps(model, optimizer, batches, xla, False)
    assert float(host(optimizer.grad_norm)) > 0.5, "clipping must act"
    torch.testing.assert_close(losses, ref_losses, **TOL)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(host(full_tensor(param)), ref_params[name].detach(), **TOL,
                                   msg=lambda m: f"{name}: {m}")


def test_checkpoint_of_xla_tensors_round_trips_and_opens_in_transformers(xla, tmp_path):
    """save_checkpoint / load_checkpoint of a model and AdamW state on XLA, and save_pretrained's
    directory opened by plain transformers on the CPU."""
    import transformers

    import nxd_hf
    from nxd_hf import parallel_state

    parallel_state.destroy_model_parallel()
    _, model = _llama_pair()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = _batches(3)
    _adamw_steps(model, optimizer, batches[:1], xla, False)
    nxd_hf.save_checkpoint(str(tmp_path / "ckpt"), "step1", model=model, optimizer=optimizer)
    nxd_hf.save_pretrained(model, str(tmp_path / "hf"))
    saved = {name: host(p).clone() for name, p in model.named_parameters()}
    expected = _adamw_steps(model, optimizer, batches[1:], xla, False)

    _, fresh = _llama_pair()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    nxd_hf.load_checkpoint(str(tmp_path / "ckpt"), "step1", model=fresh, optimizer=fresh_optimizer)
    assert all(p.device.type == "xla" for p in fresh.parameters())
    for name, param in fresh.named_parameters():
        assert torch.equal(host(param), saved[name]), name
    torch.testing.assert_close(_adamw_steps(fresh, fresh_optimizer, batches[1:], xla, False), expected, **TOL)

    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    for name, param in plain.named_parameters():
        assert torch.equal(param.detach(), saved[name]), name
