"""The one module that talks to ``torch.distributed``.

Everything in nxd_hf that communicates goes through these functions, so gloo (CPU), nccl
(CUDA) and xla (torch-xla) differ here only, and so the payload bytes of every collective can
be counted in one place (``count_comm``; used by ``bench/comm_volume/run.py`` and the tests).

Payload is the size of the tensor a rank hands to the collective: the whole tensor for
all-reduce, broadcast and reduce-scatter, the local shard for all-gather. Collectives over a
group of size 1 are skipped and not counted.

Devices. ``default_device()`` is where a rank computes: ``cuda:LOCAL_RANK`` (modulo the GPUs
there) when the backend serves CUDA only (nccl, ``cuda:gloo``) or maps CUDA to nccl, the XLA
device under xla, else the CPU. ``collective_device(group)`` is where every tensor handed to
a collective on ``group`` lives — control tensors included (failure flags, input-check sums,
sizes, norms, checkpoint metadata): the compute device when the group's backend serves it,
else the CPU. Control tensors are built on that device rather than on a CPU side channel
(a ``cpu:gloo,cuda:nccl`` default group): that works whoever created the process group (a
user's own ``init_process_group("nccl")`` has no CPU backend), keeps one backend per group
(no second set of gloo connections per group), and the hot path (gradients, norms,
activations) is already on the device; the few control values cost one small host-device
copy, made where the host reads them anyway. Every collective checks that its tensor's
device type is one the group's backend serves and raises naming the op otherwise
(``tests/distributed/test_devices.py`` checks statically, without a GPU, that every tensor nxd_hf builds
names its device).

``NXD_HF_BACKEND`` overrides the backend: ``cuda:gloo`` runs 2-4 ranks on one GPU (nccl
refuses that) and, like nccl, refuses CPU tensors — the GPU test lane uses it. gloo cannot
send/recv CUDA tensors, so point-to-point (the pipeline) under a gloo backend that computes on
CUDA is staged through the CPU on a plain gloo twin of the group (``p2p_group``,
``p2p_device``).

A script started with plain ``python`` (no torchrun) gets a world of one process on the
default backend: nccl on ``cuda:0`` when a GPU is there — the same backend and device as
``torchrun --nproc_per_node 1``, so the two launches run the same code; a world of one makes
no collective call, so nccl costs nothing there. Under ``PJRT_DEVICE`` that world of one is
gloo and computes on the XLA device (torch-xla's CPU client cannot span processes: docs/xla.md).

The package: ``devices`` (where a rank computes, what a group serves), ``groups`` (the world,
groups, their names and errors, host-side agreement), ``collectives`` (counted, checked
collectives). Everything is used as ``nxd_hf.backend.<name>``.
"""

from nxd_hf.backend.collectives import (  # noqa: F401
    CommRecord, is_abstract, all_gather, all_gather_into, all_reduce, broadcast, comm_tag, count_comm, reduce_scatter,
    reduce_scatter_into,
)
from nxd_hf.backend.collectives import (  # noqa: F401
    CombineTokens, DispatchRows, DispatchTokens, RingShift, all_to_all, exchange_counts, ring_shift,
)
from nxd_hf.backend.devices import (  # noqa: F401
    _computes_on_cuda, _config_devices, _served_devices, collective_device, default_backend, default_device,
    launch_device, materialize, p2p_device, set_cuda_device_from_env,
)
from nxd_hf.backend.groups import (  # noqa: F401
    SELF, abort_groups, all_gather_object, arrival_barrier, barrier, destroy_group, global_rank, group_rank,
    group_size, groups_aborted, init_process_group_from_env, is_initialized, new_group, new_host_group, p2p_group,
    post_first, rank, warn_once, world_size,
)
from nxd_hf.backend.collectives import all_reduce_async  # noqa: F401,E402
from nxd_hf.backend.collectives import reduce_scatter_async  # noqa: F401,E402
