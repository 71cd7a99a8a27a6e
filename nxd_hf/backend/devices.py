"""Which device a rank computes on, and which devices a group's backend serves (the package
docstring says why control tensors live on ``collective_device``)."""

import os

import torch
import torch.distributed as dist

SELF = "self"
"""The group of this rank alone (what ``parallel_state`` hands out before initialization)."""


def default_backend() -> str:
    """``$NXD_HF_BACKEND`` when set (e.g. ``cuda:gloo``), ``xla`` when an XLA device is
    requested, else nccl with a GPU, gloo without."""
    requested = os.environ.get("NXD_HF_BACKEND")
    if requested:
        return requested
    if os.environ.get("PJRT_DEVICE"):
        return "xla"
    return "nccl" if torch.cuda.is_available() else "gloo"


def _config_devices(config: str) -> dict[str, str]:
    """device type -> backend name of a backend config ("cpu:gloo,cuda:gloo", "nccl", "cuda:gloo")."""
    defaults = {"gloo": ("cpu", "cuda"), "nccl": ("cuda",), "xla": ("xla",)}
    devices = {}
    for part in config.split(","):
        device, _, name = part.rpartition(":")
        for d in (device,) if device else defaults.get(name, ("cpu",)):
            devices[d] = name
    return {"xla": "xla"} if "xla" in devices.values() else devices  # however torch-xla registers it


def _served_devices(group=None) -> dict[str, str]:
    """device type -> backend name for ``group`` (the default group for None; SELF: the default backend)."""
    if not dist.is_initialized() or _xla_world_of_one():
        return _config_devices(default_backend())
    return _config_devices(str(dist.get_backend_config(None if group is SELF else group)))


def _xla_world_of_one() -> bool:
    """A world of one under ``PJRT_DEVICE``: its group is gloo (``_init_world_of_one``) and makes no
    collective call, but the rank computes on the XLA device."""
    return default_backend() == "xla" and dist.get_world_size() == 1


def _local_cuda_device() -> torch.device:
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError(f"the backend {default_backend()!r} computes on CUDA but no GPU is visible: run on a GPU "
                         "machine, or unset $NXD_HF_BACKEND (gloo on the CPU)")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0)) % count)


def default_device() -> torch.device:
    """The device a rank computes on for the backend in use (module docstring)."""
    served = _served_devices()
    if "xla" in served:
        import torch_xla  # optional extra

        return torch_xla.device()
    if _computes_on_cuda(served):
        return _local_cuda_device()
    return torch.device("cpu")


def materialize() -> None:
    """XLA: run the pending computation of every live tensor on the device as one compiled graph,
    so that reading them to the host next is a copy each (a lazy tensor read on its own compiles
    and runs a graph of its own: minutes for a checkpoint's tensors). Elsewhere nothing to do."""
    if "xla" in _served_devices():
        import torch_xla  # optional extra

        torch_xla.sync()


def _computes_on_cuda(served: dict[str, str]) -> bool:
    """CUDA-only backends, or CUDA on nccl; plain gloo (CPU and CUDA) computes on the CPU."""
    return "cuda" in served and ("cpu" not in served or served["cuda"] == "nccl")


def collective_device(group=None) -> torch.device:
    """Where tensors handed to a collective on ``group`` live (control tensors included): the
    compute device when the group's backend serves it, else the CPU."""
    device = default_device()
    return device if device.type in _served_devices(group) else torch.device("cpu")


def p2p_device(group=None, device: torch.device | None = None) -> torch.device:
    """Where tensors computed on ``device`` (default: the compute device) are sent point-to-point
    on ``group``: the CPU when gloo serves that device (gloo's send/recv of a CUDA tensor fails
    and breaks the group), else ``device`` itself."""
    device = device or default_device()
    return torch.device("cpu") if _served_devices(group).get(device.type) == "gloo" else device


def launch_device(name: str, local_rank: int = 0) -> str:
    """The device a rank with ``local_rank`` computes on under backend ``name`` (``nxd-hf env``)."""
    served = _config_devices(name)
    if "xla" in served:
        return "the XLA device"
    if _computes_on_cuda(served):
        count = torch.cuda.device_count()
        return f"cuda:{local_rank % count}" if count else "cuda (no GPU visible: it would fail)"
    return "cpu"


def set_cuda_device_from_env() -> None:
    """Select this rank's GPU (``LOCAL_RANK`` modulo the GPUs there) when the backend computes on CUDA."""
    if _computes_on_cuda(_config_devices(default_backend())) and torch.cuda.is_available():
        torch.cuda.set_device(_local_cuda_device())
