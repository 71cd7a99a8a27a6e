"""A step that fails on one pipeline stage fails on every rank, with the same error, at once.

Inside a pipeline step a rank that raises (a bad shape on the last stage, a user assertion in a
layer's forward) leaves its peers blocked in a receive or a collective until the process
group's timeout. Agreeing on success after every microbatch would cost a collective each
time; instead nothing is added while the step runs well. A rank that catches an exception
posts it in the default group's store (the first post wins: the origin posts before anything
else fails) and aborts its process groups, so every peer waiting on it gets an error at
once, posts in turn (keeping the origin's message) and aborts its own groups: the failure
spreads along the pipeline and TP links in milliseconds. Every rank then raises the same
``ValueError`` naming the origin rank and its error. The process groups are closed
afterwards; the script ends there (as it would on any rank's crash).
"""

from nxd_hf import backend

_failures = 0  # every rank counts the same failures: the step fails on all of them


def raise_on_every_rank(what: str, error: Exception):
    """Raise ``error`` (caught on this rank during ``what``) as the same ValueError on every rank."""
    global _failures
    if backend.world_size() == 1:
        raise error
    _failures += 1
    cause = error
    while cause.__cause__ is not None:  # torch's stages wrap what the module raised
        cause = cause.__cause__
    mine = f"{backend.rank()}\n{type(cause).__name__}: {cause}"
    origin, _, text = backend.post_first(f"nxd_hf/step_failure/{_failures}", mine).partition("\n")
    backend.abort_groups()
    raise ValueError(f"{what} failed on rank {origin} (every rank stops here; the process groups are closed): "
                     f"{text}") from error
