"""The ``"torch_tp"`` process-group backend for CPU tensors.

``import torch_tp`` registers it with torch.distributed, so that::

    dist.init_process_group("torch_tp")                 # CPU tensors
    dist.init_process_group("cpu:torch_tp,cuda:nccl")   # CPU and CUDA tensors
    dist.new_group(ranks, backend="torch_tp")

work under torchrun, as do DeviceMesh sub-groups. Ranks on one node exchange
data through POSIX shared memory (``/dev/shm/torch_tp_*`` segments, unlinked as
soon as every rank has mapped them). When a group spans several nodes,
all-reduce, reduce, reduce-scatter and barrier go through shared memory inside
each node and a gloo group of one leader per node between them; the other
collectives then run on a gloo group of all the group's ranks.

Environment:
    TORCH_TP_HOST_KEY: the node a rank counts as on (default: the hostname).
        Ranks with equal keys share memory; give each launch its own key to
        run a multi-node job on one machine.
    TORCH_TP_SHM_BUFFER_BYTES: the shared data buffer of each rank, in bytes
        (default 2 MiB: two slots of 1 MiB; at least 4096). Tensors of any
        size go through it in chunks.

Every wait is bounded by the group's ``timeout``: a rank whose peer died or
stopped calling raises ``DistBackendError`` (a ``RuntimeError``) naming the
op and the rank; ranks whose calls disagree (op, dtype, element count, root)
raise one that says ``mismatch``.
"""

from datetime import timedelta

import torch.distributed as dist

from . import _C

__all__ = ["BACKEND_NAME"]

BACKEND_NAME = "torch_tp"


def _create_backend(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.Backend:
    # Place the ranks on nodes through the group's store (already prefixed
    # per group by torch), as torch_tp::new_group does in C++.
    hosts = _C.exchange_host_keys(store, rank, world_size, timeout)
    nodes = list(dict.fromkeys(hosts))  # ordered by each node's first rank
    gloo_all = gloo_leaders = None
    if len(nodes) > 1:
        # gloo between the nodes; building a ProcessGroupGloo is itself a
        # rendezvous of its members, so every member constructs it here.
        gloo_all = dist.ProcessGroupGloo(dist.PrefixStore("torch_tp/gloo_all/", store), rank, world_size, timeout)
        if hosts.index(hosts[rank]) == rank:
            gloo_leaders = dist.ProcessGroupGloo(
                dist.PrefixStore("torch_tp/gloo_leaders/", store), nodes.index(hosts[rank]), len(nodes), timeout
            )
    return _C.ProcessGroupShm(store, rank, world_size, timeout, hosts, None, gloo_all, gloo_leaders)


if BACKEND_NAME not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, devices=["cpu"])
