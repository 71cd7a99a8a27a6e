"""Which job writes a checkpoint directory: one at a time.

Two launches with the same output directory (a common slip) would otherwise write the same
temporary checkpoint at once and leave tags whose files come from both jobs, each file's
checksum valid. So a directory has an owner, ``<path>/owner.json`` (``{"job": id, "finished":
bool}``), and a save is refused (the same ValueError on every rank) unless its job owns the
directory or may take it over. The rule, checked by rank 0 at every save:

- no owner file: this job becomes the owner (created exclusively: of two jobs racing, one wins);
- the owner is this job: the save goes on;
- the owner's file says it finished (its process ended normally: at interpreter exit or
  ``parallel_state.destroy_model_parallel``), or this job loaded a checkpoint of the owner's
  from this directory (a resume after a crash or a kill): this job takes the directory over;
- else another job is live (or was killed without resuming from it): refused. Delete
  ``owner.json`` once that job is known to be gone, or load its checkpoint first to continue it.

Every save also carries an id (``<job>:<random token>``, agreed over the world) in every
record and shard header, in the index and in the completion marker; loading refuses files of
another save (``nxd_hf.checkpoint.load``), which catches a mix the owner file could not prevent
(the file deleted by hand, a filesystem without atomic links).
"""

import atexit
import json
import os
import secrets
import socket

from nxd_hf import parallel_state
from nxd_hf.checkpoint import store, writer  # noqa: F401  (writer's wait runs before release)

OWNER = "owner.json"

_job: str | None = None  # this process's job id (rank 0 makes it; the others take rank 0's at each save)
_owned: dict[str, str] = {}  # directory -> the job (of this process) rank 0 made its owner
_loaded: dict[str, str] = {}  # directory -> the job whose checkpoint this process loaded from it


def this_job() -> str:
    """An id for this job, made once per process (host, pid, random)."""
    global _job
    if _job is None:
        _job = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    return _job


def new_save_id(job: str) -> str:
    return f"{job}:{secrets.token_hex(8)}"


def note_loaded(path: str, index: dict) -> None:
    """This process loaded a checkpoint of ``index["job"]`` from ``path``: it may take over."""
    if index.get("job"):
        _loaded[os.path.abspath(path)] = index["job"]


def _read(file: str) -> dict | None:
    try:
        with open(file) as f:
            owner = json.load(f)
        return owner if isinstance(owner, dict) and "job" in owner else None
    except (OSError, ValueError):
        return None


def _create_exclusively(file: str, job: str) -> bool:
    """Write the owner file unless one exists (a hard link fails on an existing name)."""
    tmp = f"{file}.tmp.{os.getpid()}"
    with store.durable_open(tmp, "w") as f:
        json.dump({"job": job, "finished": False}, f)
    try:
        os.link(tmp, file)
        return True
    except FileExistsError:
        return False
    finally:
        os.remove(tmp)


def claim(path: str, job: str) -> None:
    """Rank 0, before a save writes anything: make ``job`` the owner of ``path`` or raise."""
    path = os.path.abspath(path)
    file = os.path.join(path, OWNER)
    os.makedirs(path, exist_ok=True)
    if not os.path.exists(file) and _create_exclusively(file, job):
        _owned[path] = job
        return
    owner = _read(file)
    if owner is not None and owner["job"] != job and not owner.get("finished") and owner["job"] != _loaded.get(path):
        raise ValueError(
            f"two jobs share the checkpoint directory {path}: it is in use by job {owner['job']!r} (its {OWNER}), "
            f"and this job ({job!r}) did not resume from it. Give each run its own output directory. If that job is "
            f"no longer running (it was killed), delete {file}; to continue its training, load its checkpoint first "
            "(load_checkpoint / resume_from_checkpoint), which takes the directory over")
    if owner is None or owner["job"] != job or owner.get("finished"):
        store.write_json_atomic(file, {"job": job, "finished": False})
    _owned[path] = job


def release() -> None:
    """Mark the directories this job owns as finished (the end of the process group, or of the
    interpreter): the next job may save there without resuming."""
    for path, job in sorted(_owned.items()):
        file = os.path.join(path, OWNER)
        owner = _read(file)
        if owner is not None and owner["job"] == job and os.path.isdir(path):
            store.write_json_atomic(file, {"job": job, "finished": True})
    _owned.clear()


atexit.register(release)
parallel_state.register_before_destroy(release)
