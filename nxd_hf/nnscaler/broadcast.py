"""``broadcast_weights`` (replicas made equal to the first unit's) and copying generated files
between nodes over the process group (``BroadcastGenFilesStrategy``).

nnScaler's "first unit" is ranks ``0 .. plan_ngpus - 1``; in nxd_hf's rank layout
(``parallel_state.rank_lists``: [PP, DP, TP]) the ranks of one model replica are those with the
same data-parallel rank, consecutive only at pp=1, so the source of each tensor is the
data-parallel rank 0 of its (tp, pp) position.
"""

import hashlib
import os

import torch
from torch import nn

from nxd_hf import backend, parallel_state
from nxd_hf.checkpoint.store import durable_open
from nxd_hf.model_state import state_of
from nxd_hf.nnscaler.state_layout import parallel_parts

_CHUNK_BYTES = 64 << 20


def _all_tensors(root: nn.Module):
    """Every parameter and buffer (persistent or not) of ``root``, once each."""
    seen = set()
    for tensor in (*root.parameters(), *root.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield tensor


@torch.no_grad()
def broadcast_weights(module: nn.Module, plan_ngpus: int = -1) -> None:
    """Give every data-parallel replica the weights (parameters and buffers) of data-parallel rank
    0, and the plain (non-parallelized) rest of ``module`` rank 0's. ``plan_ngpus``: the GPUs of
    one replica (tp x pp), checked when given. Collective: every rank calls it."""
    parts = parallel_parts(module)
    tp_pp = parallel_state.get_tensor_model_parallel_size() * parallel_state.get_pipeline_model_parallel_size()
    if plan_ngpus not in (-1, tp_pp):
        raise ValueError(f"broadcast_weights: plan_ngpus={plan_ngpus} but the module is parallelized over tp x pp = "
                         f"{tp_pp} ranks per replica: pass compute_config.plan_ngpus ({tp_pp})")
    group = parallel_state.get_data_parallel_group()
    source = backend.global_rank(group, 0) if backend.group_size(group) > 1 else backend.rank()
    in_parts = set()
    for _, part in parts:
        for root in state_of(part).local_modules:
            for tensor in _all_tensors(root):
                in_parts.add(id(tensor))
                backend.broadcast(tensor.data, source, group)
    for tensor in _all_tensors(module):
        if id(tensor) not in in_parts:
            backend.broadcast(tensor.data, 0, None)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def broadcast_files(directory: str, names: list[str]) -> None:
    """Copy ``directory/<name>`` of rank 0 to every rank whose ``directory`` (same path, another
    node's disk) does not hold the same bytes; written under a temporary name and renamed.
    Collective: every rank calls it with the same names."""
    device = backend.collective_device()
    for name in names:
        path = os.path.join(directory, name)
        data = open(path, "rb").read() if backend.rank() == 0 else b""
        digest = backend.all_gather_object(_digest(data) if backend.rank() == 0 else None)[0]
        have = os.path.exists(path) and _digest(open(path, "rb").read()) == digest
        needs = backend.all_gather_object(not have)
        if not any(needs):
            continue
        size = torch.tensor([len(data)], dtype=torch.long, device=device)
        backend.broadcast(size, 0, None)
        buffer = bytearray()
        for start in range(0, int(size), _CHUNK_BYTES):
            stop = min(start + _CHUNK_BYTES, int(size))
            chunk = torch.zeros(stop - start, dtype=torch.uint8, device=device)
            if backend.rank() == 0:
                chunk.copy_(torch.frombuffer(bytearray(data[start:stop]), dtype=torch.uint8))
            backend.broadcast(chunk, 0, None)
            buffer += chunk.cpu().numpy().tobytes()
        if not have:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with durable_open(path, "wb", atomic=True) as f:
                f.write(bytes(buffer))
