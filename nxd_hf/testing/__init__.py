"""Run a function on N gloo ranks on CPU: the spawn helper behind nxd_hf's tests.

The ranks' backend is ``gloo`` unless ``$NXD_HF_BACKEND`` names another when
``run_distributed`` is called: ``cuda:gloo`` puts 2-4 ranks on one GPU (the ``cuda`` test lane,
``make test-gpu``), each rank on ``cuda:LOCAL_RANK % GPUs``.

``run_distributed(fn, world_size=4)`` starts one process per rank from a forkserver that has
already imported torch and transformers (so a rank starts in well under a second), joins them
through a TCPStore the parent owns (no port race), and returns every rank's return value. A
failure on any rank raises ``DistributedTestError`` carrying that rank's traceback; a rank that
does not finish within ``timeout_s`` is killed and reported, never left hanging.
"""

import contextlib
import datetime
import multiprocessing as mp
import os
import queue
import time
import traceback

import torch.distributed as dist

_PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.trainer", "accelerate", "peft", "nxd_hf"]
_extra_preload: list[str] = []
_context = None


class DistributedTestError(AssertionError):
    pass


def preload(*module_names: str) -> None:
    """Have the forkserver import ``module_names`` too, once, so that no rank imports them again
    (a test suite's own helpers, pytest: a rank unpickling a case function imports its module).
    Only names given before the first rank starts count: the forkserver imports once."""
    _extra_preload.extend(name for name in module_names if name not in _extra_preload)


def _get_context():
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload([*_PRELOAD, *_extra_preload, "nxd_hf.testing.gc_freeze"])
    return _context


def _setup_rank(rank: int, world_size: int, port: int, process_group_backend: str = "gloo") -> dist.TCPStore:
    """This process becomes rank ``rank`` (``process_group_backend``: gloo, or ``cuda:gloo`` in the
    GPU lane), joined through the parent's TCPStore."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        OMP_NUM_THREADS="1", NXD_HF_BACKEND=process_group_backend,
    )
    import torch

    torch.set_num_threads(1)
    from nxd_hf import backend

    backend.set_cuda_device_from_env()
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group(process_group_backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    return store


def _wait_for_peers_to_return(store: dist.TCPStore, world_size: int) -> None:
    """A rank that returns and exits while a peer still completes a group's gloo handshake with it
    fails that peer ("Connection closed by peer"). Waited on the store, not on a collective, and
    not after ``backend.abort_groups``: a peer blocked on an aborted rank is freed by its exit. A
    rank that failed has the parent kill the others."""
    from nxd_hf import backend

    if store.add("returned", 1) == world_size:
        store.set("all_returned", "1")
    if backend.groups_aborted():
        return
    with contextlib.suppress(RuntimeError):  # a peer that never returns is reported by the parent
        store.wait(["all_returned"], datetime.timedelta(seconds=60))


def _rank_main(fn, rank, world_size, port, results, args, kwargs, process_group_backend="gloo"):
    try:
        store = _setup_rank(rank, world_size, port, process_group_backend)
        value = fn(*args, **kwargs)
        from nxd_hf import parallel_state

        _wait_for_peers_to_return(store, world_size)
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException:  # report everything, including assertion failures
        results.put((rank, "error", traceback.format_exc()))


def _collect(procs: list, results, timeout_s: float) -> tuple[dict, list]:
    """Every rank's ``(rank, "ok", value)`` from ``results``, or the errors: a rank's traceback
    (then the other ranks' errors of the next 3 s), a rank that died, or a timeout."""
    world_size = len(procs)
    outcome, errors = {}, []
    deadline = time.monotonic() + timeout_s
    while len(outcome) < world_size and not errors:
        try:
            rank, status, value = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outcome]
            if dead:
                errors.append(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
            elif time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(outcome))
                errors.append(f"timed out after {timeout_s:.0f}s waiting for ranks {missing}")
            continue
        if status == "ok":
            outcome[rank] = value
        else:
            errors.append(f"rank {rank} failed:\n{value}")
            deadline = min(deadline, time.monotonic() + 3)  # collect the other ranks' errors too
            while time.monotonic() < deadline:
                try:
                    other, status, value = results.get(timeout=0.2)
                except queue.Empty:
                    continue
                if status != "ok":
                    errors.append(f"rank {other} failed:\n{value}")
            errors += [f"rank {r} died with exit code {p.exitcode}" for r, p in enumerate(procs)
                       if p.exitcode not in (None, 0) and r not in outcome]
    # the root cause first: errors from a peer's failure mention the connection
    errors.sort(key=lambda e: "Connection reset" in e or "Connection closed" in e)
    return outcome, errors


def _join_or_kill(procs: list, timeout_s: float) -> None:
    for p in procs:
        p.join(timeout=timeout_s)
        if p.is_alive():
            p.kill()
            p.join()


def run_distributed(fn, world_size: int, *args, timeout_s: float = 300.0, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the per-rank results.

    ``fn`` must be importable (module level) and its results picklable. Many cases on the same
    world size: ``nxd_hf.testing.pool.RankPool`` keeps the ranks alive between them.
    """
    ctx = _get_context()
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    process_group_backend = os.environ.get("NXD_HF_BACKEND", "gloo")  # read here: the forkserver's env is older
    procs = [
        ctx.Process(target=_rank_main, daemon=True,
                    args=(fn, r, world_size, store.port, results, args, kwargs, process_group_backend))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    errors = ["the parent was interrupted"]
    try:
        outcome, errors = _collect(procs, results, timeout_s)
    finally:
        _join_or_kill(procs, 5 if not errors else 0.5)
        del store
    if errors:
        raise DistributedTestError("\n".join(errors))
    return [outcome[r] for r in range(world_size)]


def run_process(fn, *args, timeout_s: float = 300.0) -> int:
    """Run ``fn(*args)`` in one process forked from the shared forkserver (torch, transformers and
    nxd_hf already imported: a fraction of a second, not a new interpreter's seconds) with no
    process group; return its exit code (negative: killed by that signal). For a test of a
    process that dies; ``fn`` must be importable (module level)."""
    process = _get_context().Process(target=fn, args=args, daemon=True)
    process.start()
    process.join(timeout=timeout_s)
    if process.is_alive():
        process.kill()
        process.join()
        raise DistributedTestError(f"{getattr(fn, '__name__', fn)} did not finish within {timeout_s:.0f}s")
    return process.exitcode
