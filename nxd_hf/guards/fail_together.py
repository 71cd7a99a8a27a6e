"""Fail together: a setup step that fails on one rank raises on every rank.

Setup code (``parallelize``, ``nxd_hf.from_pretrained``, the config API's model build) can
fail on one rank only: a layer shape only one rank's slice runs into, a file only one node
cannot read. Without agreement the other ranks go on into the next collective and wait there
until its timeout. ``fail_together`` ends such a block with one small all-reduce over the
world (every rank's message length, zero when it succeeded) and, when some rank failed, a
broadcast of each failing rank's message, so every rank raises the same ``ValueError`` naming
the lowest failing rank and its error (``failures_on_every_rank``).
"""

import contextlib

import torch

from nxd_hf import backend


@contextlib.contextmanager
def fail_together(what: str):
    """Run the block on every rank and agree on its success before any later collective. On a
    world of one (or without torch.distributed) the block's own exception passes unchanged."""
    try:
        yield
    except Exception as error:
        if backend.world_size() == 1:
            raise
        _raise_first(what, failures_on_every_rank(f"{type(error).__name__}: {error}"), error)
        raise AssertionError("unreachable: a failing rank is among the failures") from error
    _raise_first(what, failures_on_every_rank(None), None)


def _raise_first(what: str, failures: dict[int, str], error: Exception | None) -> None:
    if failures:
        source = min(failures)
        raise ValueError(f"{what} failed on rank {source} (every rank stops here): {failures[source]}") from error


def failures_on_every_rank(problem: str | None) -> dict[int, str]:
    """Collective over the world: every failing rank's ``problem`` (None: this rank is fine), by
    rank, the same dict on every rank. One small all-reduce of the message lengths when no rank
    failed; then one broadcast per failing rank. The one way nxd_hf makes every rank raise the
    same error (``fail_together``, checkpoint loading's checks)."""
    world = backend.world_size()
    if world == 1:
        return {} if problem is None else {0: problem}
    me = backend.rank()
    encoded = None if problem is None else problem.encode()
    device = backend.collective_device()
    lengths = torch.zeros(world, dtype=torch.long, device=device)
    lengths[me] = 0 if encoded is None else len(encoded) + 1  # +1: an empty message still fails
    backend.all_reduce(lengths, None)
    failures = {}
    for source in lengths.nonzero().flatten().tolist():
        message = torch.zeros(int(lengths[source]), dtype=torch.uint8, device=device)
        if me == source:
            message[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8, device=device)
        backend.broadcast(message, source, None)
        failures[source] = bytes(message.tolist()).rstrip(b"\0").decode(errors="replace")
    return failures
