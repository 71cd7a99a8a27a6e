"""Fail together: a setup step that fails on one rank raises on every rank.

Setup code (``parallelize``, ``nxd_hf.from_pretrained``, the config API's model build) can
fail on one rank only: a layer shape only one rank's slice runs into, a file only one node
cannot read. Without agreement the other ranks go on into the next collective and wait there
until its timeout. ``fail_together`` ends such a block with one small all-reduce over the
world (the lowest failing rank, or none) and, when some rank failed, a broadcast of its
message, so every rank raises the same ``ValueError`` naming that rank and its error.
"""

import contextlib

import torch

from nxd_hf import backend

_MESSAGE_BYTES = 2048  # fixed size: every rank sends the same shape, failing or not


@contextlib.contextmanager
def fail_together(what: str):
    """Run the block on every rank and agree on its success before any later collective. On a
    world of one (or without torch.distributed) the block's own exception passes unchanged."""
    try:
        yield
    except Exception as error:
        if backend.world_size() == 1:
            raise
        _agree(what, error)
        raise AssertionError("unreachable: _agree raises when a rank failed") from error
    _agree(what, None)


def _agree(what: str, error: Exception | None) -> None:
    world = backend.world_size()
    if world == 1:
        return
    me = backend.rank()
    failed = torch.tensor([me if error is not None else world], dtype=torch.long)
    backend.all_reduce(failed, None, op="min")  # the lowest failing rank, or world if none
    source = int(failed)
    if source == world:
        return
    message = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
    if me == source:
        encoded = f"{type(error).__name__}: {error}".encode()[:_MESSAGE_BYTES]
        message[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    backend.broadcast(message, source, None)
    text = bytes(message.tolist()).rstrip(b"\0").decode(errors="replace")
    agreed = ValueError(f"{what} failed on rank {source} (every rank stops here): {text}")
    raise agreed from error
