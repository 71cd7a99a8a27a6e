"""Without a GPU: every tensor nxd_hf builds says where it lives.

On CPU/gloo a tensor built on the wrong device is invisible — every device is the CPU — yet
under nccl (or ``cuda:gloo``) a control tensor built on the CPU and handed to a collective
crashes every layout with two or more ranks (``fail_together``'s failure flag). So
every ``torch.tensor/zeros/ones/empty/full/arange/...`` call inside ``nxd_hf/`` must pass
``device=`` (``backend.collective_device(group)`` for what goes to a collective,
``backend.default_device()`` or a tensor's own device for compute), or be listed in
``host_only_tensors.toml`` (beside this file) with the reason it is host-only. ``*_like`` / ``new_*`` calls inherit their tensor's device and
are not checked. On a GPU the ``cuda`` lane (test_gpu.py) is the behavioural check.
"""

import ast
import os
import pathlib
import tomllib

import pytest
import torch

import nxd_hf

CREATORS = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
            "linspace", "eye", "empty_strided", "frombuffer", "from_numpy"}
ROOT = pathlib.Path(nxd_hf.__file__).parent

# (file under nxd_hf/, enclosing function) -> why its device-less tensors never reach a collective
# or a device computation: the allow-list, kept as data beside this file.
with open(pathlib.Path(__file__).with_name("host_only_tensors.toml"), "rb") as _f:
    HOST_ONLY = {(file, function): why for file, sites in tomllib.load(_f).items() for function, why in sites.items()}


def _unplaced_calls(path: pathlib.Path) -> list[tuple[str, str, int]]:
    """(enclosing function, creator, line) of every device-less tensor creation in ``path``."""
    found = []

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{scope}.{child.name}" if scope else child.name
                visit(child, inner)
                continue
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and isinstance(child.func.value, ast.Name) and child.func.value.id == "torch"
                    and child.func.attr in CREATORS and not any(k.arg == "device" for k in child.keywords)):
                found.append((scope, child.func.attr, child.lineno))
            visit(child, scope)

    visit(ast.parse(path.read_text()), "")
    return found


def _all_unplaced() -> dict[tuple[str, str], list[str]]:
    sites = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for scope, creator, line in _unplaced_calls(path):
            sites.setdefault((rel, scope), []).append(f"torch.{creator} at line {line}")
    return sites


def test_every_tensor_nxd_hf_builds_names_its_device():
    unplaced = {site: calls for site, calls in _all_unplaced().items() if site not in HOST_ONLY}
    assert not unplaced, (
        "tensors built without device= (on a GPU they land on the CPU; handed to a collective under nccl they "
        "crash): pass device=backend.collective_device(group) for what goes to a collective, the compute "
        "device or a tensor's own device otherwise, or add the site to host_only_tensors.toml with the reason:\n"
        + "\n".join(f"  nxd_hf/{f} {scope}: {', '.join(calls)}" for (f, scope), calls in sorted(unplaced.items())))


def test_host_only_list_has_no_stale_entries():
    stale = sorted(set(HOST_ONLY) - set(_all_unplaced()))
    assert not stale, f"HOST_ONLY entries that match no device-less creation any more (remove them): {stale}"


@pytest.mark.parametrize("source, expected", [
    ("import torch\ndef f(group):\n    return torch.tensor([1], dtype=torch.long)\n", [("f", "tensor", 3)]),
    ("import torch\ndef f(d):\n    return torch.zeros(3, device=d)\n", []),
    ("import torch\nclass A:\n    def g(self):\n        return torch.full((2,), 1)\n", [("A.g", "full", 4)]),
    ("import torch\ndef f(x):\n    return torch.zeros_like(x)\n", []),
])
def test_the_check_sees_device_less_creations(tmp_path, source, expected):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert _unplaced_calls(path) == expected


@pytest.mark.parametrize("config, served, computes_on_cuda", [
    ("gloo", {"cpu": "gloo", "cuda": "gloo"}, False),  # plain gloo: CPU compute, CUDA tensors accepted
    ("cpu:gloo,cuda:gloo", {"cpu": "gloo", "cuda": "gloo"}, False),
    ("cuda:gloo", {"cuda": "gloo"}, True),  # the GPU lane: refuses CPU tensors as nccl does
    ("nccl", {"cuda": "nccl"}, True),
    ("cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}, True),
])
def test_backend_configs_decide_the_devices(config, served, computes_on_cuda):
    from nxd_hf import backend

    assert backend._config_devices(config) == served
    assert backend._computes_on_cuda(served) == computes_on_cuda


def test_env_reports_the_backend_and_device_of_each_launch(monkeypatch):
    from nxd_hf import cli

    monkeypatch.delenv("NXD_HF_BACKEND", raising=False)
    text = cli.environment()
    expected = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert f"`python script.py`: a world of one on {'nccl' if expected != 'cpu' else 'gloo'} (the default), " \
           f"computing on {expected}" in text, text
    assert "`torchrun --nproc_per_node N script.py`:" in text, text
    monkeypatch.setenv("NXD_HF_BACKEND", "cuda:gloo")
    assert "a world of one on cuda:gloo (from $NXD_HF_BACKEND), computing on cuda" in cli.environment()


def test_setup_places_on_the_backend_device_by_default():
    """parallelize's step 10 defaults to backend.default_device() (the CPU here, cuda:LOCAL_RANK
    under nccl), decided before the weights exist so meta weights materialize there."""
    from torch import nn

    from nxd_hf import backend
    from nxd_hf.model_setup.local import target_device

    with torch.device("meta"):
        meta = nn.Linear(2, 2)
    assert target_device(None, [meta]) == backend.default_device()
    assert target_device(None, [nn.Linear(2, 2)]) == backend.default_device()
    assert target_device("cpu", [meta]) == torch.device("cpu")


def _backend_seen():
    import torch.distributed as dist

    from nxd_hf import backend

    return str(dist.get_backend_config()), str(backend.collective_device()), os.environ["NXD_HF_BACKEND"]


def test_spawned_ranks_take_the_backend_from_the_environment(monkeypatch):
    """run_distributed reads $NXD_HF_BACKEND when called (the GPU lane sets cuda:gloo)."""
    from nxd_hf.testing import run_distributed

    monkeypatch.setenv("NXD_HF_BACKEND", "cpu:gloo")
    assert run_distributed(_backend_seen, 2) == [("cpu:gloo", "cpu", "cpu:gloo")] * 2


def test_stage_through_moves_inputs_to_compute_and_outputs_to_send_device():
    """The pipeline's CPU staging (gloo cannot send CUDA tensors), with meta standing in for the
    send device: inputs arrive anywhere and run on the compute device; a non-last stage hands
    its outputs over on the send device, once however often the stage is rebuilt."""
    from torch import nn

    from nxd_hf.pipeline.runtime import stage_through

    middle, last = nn.Linear(2, 2), nn.Linear(2, 2)
    for _ in range(2):
        stage_through(middle, torch.device("cpu"), torch.device("meta"), is_last=False)
        stage_through(last, torch.device("cpu"), torch.device("meta"), is_last=True)
    assert len(middle._forward_pre_hooks) == len(middle._forward_hooks) == 1
    assert middle(torch.ones(1, 2)).device.type == "meta"
    assert len(last._forward_hooks) == 0 and last(torch.ones(1, 2)).device.type == "cpu"  # feeds the loss
