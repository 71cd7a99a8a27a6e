"""The machine a plan is made for: ranks, memory per rank, link and compute speeds.

Presets give a device's dense FLOP/s (at the training dtype) and its links; every number may be
overridden. ``parse_bytes("80GB")`` reads the sizes the command line takes."""

import dataclasses
import re

GiB = 2**30


@dataclasses.dataclass(kw_only=True)
class Cluster:
    """Ranks and speeds. Links: bytes/s per rank for a collective (bus bandwidth) and a fixed
    latency per collective; "intra" links join ranks of one node, "inter" links nodes."""

    world_size: int
    """Ranks (processes, one accelerator each)."""
    device_memory: int
    """Bytes a rank may use."""
    nodes: int = 1
    """Nodes the ranks are spread over (ranks per node = world_size / nodes)."""
    flops: float = 1e12
    """Sustained dense FLOP/s of one rank at the training dtype."""
    intra_bandwidth: float = 10e9
    """Bytes/s one rank moves in a collective inside a node."""
    inter_bandwidth: float = 10e9
    """Bytes/s one rank moves in a collective across nodes."""
    intra_latency: float = 20e-6
    """Seconds per collective inside a node."""
    inter_latency: float = 50e-6
    """Seconds per collective across nodes."""
    name: str = "custom"
    """The preset it came from."""

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nodes


PRESETS = {
    # ~40% of the bf16 dense peak; NVLink 4 bus bandwidth ~ 360 GB/s, 8x400 Gb/s IB ~ 45 GB/s per GPU
    "h100": dict(flops=400e12, intra_bandwidth=360e9, inter_bandwidth=45e9, intra_latency=10e-6, inter_latency=20e-6),
    "a100": dict(flops=125e12, intra_bandwidth=230e9, inter_bandwidth=22e9, intra_latency=10e-6, inter_latency=20e-6),
    # Trainium1 NeuronCore: ~95 TFLOP/s bf16 per chip at 40% of 190; NeuronLink ~ 100 GB/s, EFA 800 Gb/s per node
    "trn1": dict(flops=38e12, intra_bandwidth=100e9, inter_bandwidth=6e9, intra_latency=15e-6, inter_latency=30e-6),
    # gloo on one host: shared memory copies through the kernel; ~5 GFLOP/s per single-threaded rank
    "cpu": dict(flops=5e9, intra_bandwidth=2e9, inter_bandwidth=1e9, intra_latency=200e-6, inter_latency=500e-6),
}


def make_cluster(*, world_size: int, device_memory: int | str, preset: str = "h100", nodes: int = 1,
                 **overrides) -> Cluster:
    """A ``Cluster`` from a preset (``PRESETS``) with any field overridden (None: keep the preset's)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown device preset {preset!r}: use one of {sorted(PRESETS)} or pass flops=, "
                         "intra_bandwidth=, ... yourself")
    if world_size < 1 or nodes < 1 or world_size % nodes:
        raise ValueError(f"world_size ({world_size}) must be a positive multiple of nodes ({nodes})")
    memory = parse_bytes(device_memory)
    fields = {**PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}}
    return Cluster(world_size=world_size, device_memory=memory, nodes=nodes, name=preset, **fields)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(size: int | float | str) -> int:
    """``80GB`` -> 80e9, ``24GiB`` -> 24 x 2^30; a number is bytes."""
    if isinstance(size, (int, float)) and not isinstance(size, bool):
        return int(size)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(size))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read the memory size {size!r}: write e.g. 80GB, 24GiB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
