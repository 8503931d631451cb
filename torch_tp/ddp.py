"""torch_tp.DistributedDataParallel: data parallelism with gradient bucketing in C++.

The wrapper has the signature and the semantics of
:class:`torch.nn.parallel.DistributedDataParallel`; the reducer that buckets,
all-reduces and writes back the gradients is torch_tp's own C++ one
(``csrc/ddp/reducer.cpp``). This file is the thin Python front: choose the
group, check and broadcast the model, and tell the reducer when a forward
starts and which outputs its backward will start from.
"""

import contextlib
import inspect
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map

from . import _C

__all__ = ["DistributedDataParallel"]

_MB = 1024 * 1024
# torch's defaults: bucket_cap_mb=25 and dist._DEFAULT_FIRST_BUCKET_BYTES.
_DEFAULT_BUCKET_CAP_MB = 25
_DEFAULT_FIRST_BUCKET_BYTES = 1 * _MB
# The size of the flat buffers that broadcast parameters and buffers (torch's
# broadcast_bucket_size).
_BROADCAST_BUCKET_BYTES = 250 * _MB

# torch's default hooks run by the C++ reducer itself (no Python per bucket).
_BUILTIN_HOOKS = {
    default_hooks.allreduce_hook: "allreduce",
    default_hooks.fp16_compress_hook: "fp16_compress",
    default_hooks.bf16_compress_hook: "bf16_compress",
}


class DistributedDataParallel(nn.Module):
    r"""Data parallelism over a process group, gradients reduced in buckets by a C++ reducer.

    A drop-in replacement for :class:`torch.nn.parallel.DistributedDataParallel`
    (same arguments, defaults and behaviour in the cases torch_tp tests). At
    construction the parameter shapes are checked across ranks and rank 0's
    parameters and buffers are broadcast. In backward, each parameter's
    gradient is copied into a flat bucket (divided by the world size) as soon
    as it is accumulated, and a bucket's all-reduce starts as soon as its last
    gradient is in, overlapping the rest of the backward. When backward
    returns, every ``.grad`` holds the average over the group.

    Buckets hold parameters of one dtype and device. The first backward uses
    one bucket (or, with ``find_unused_parameters=True``, a 1 MiB bucket and
    then ``bucket_cap_mb`` ones in reverse registration order); after it the
    buckets are rebuilt in the order gradients arrived, rank 0's order on
    every rank. On the same backend and inputs the gradients are bitwise
    torch DDP's.

    Args:
        module (nn.Module): the module to replicate. With tensor parallelism,
            a module already parallelized by :func:`torch_tp.parallelize_module`
            (or torch's) on another mesh dimension: its DTensor parameters are
            then trained as their local tensors, which become the module's
            parameters (NOTE [DTensor parameters under DistributedDataParallel]).
        device_ids (list of int or torch.device, optional): for a module on
            one CUDA device, that device; inputs are moved to it. ``None`` for
            CPU and multi-device modules.
        process_group (ProcessGroup, optional): the data-parallel group
            (default: the default group).
        device_mesh (DeviceMesh, optional): a 1-D mesh whose group is the
            data-parallel group, e.g. ``mesh["dp"]`` of a ``("dp", "tp")``
            mesh. Exclusive with ``process_group``.
        bucket_cap_mb (float, optional): bucket size cap in MiB (default 25;
            the first bucket is then capped at 1 MiB).
        broadcast_buffers (bool): broadcast rank 0's buffers at the start of
            every synchronized forward (default True).
        find_unused_parameters (bool): search the autograd graph from the
            forward outputs for parameters that will get no gradient, and
            reduce without them. Without it, a backward that leaves a
            parameter without a gradient raises.
        gradient_as_bucket_view (bool): leave each ``.grad`` a view into its
            bucket instead of a copy (saves the memory of one copy of the
            gradients).
        static_graph (bool): the set of used parameters and the graph do not
            change between iterations. Unused parameters are detected as with
            ``find_unused_parameters`` and the buckets are rebuilt after the
            first iteration.

    Example::

        >>> # torchrun --nproc-per-node 2 train.py
        >>> dist.init_process_group("gloo")
        >>> model = torch_tp.DistributedDataParallel(nn.Linear(16, 4))
        >>> loss = model(torch.randn(8, 16)).sum()
        >>> loss.backward()  # every rank now holds the averaged gradients
        >>> with model.no_sync():  # accumulate locally, reduce at the next synchronized backward
        ...     model(torch.randn(8, 16)).sum().backward()
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Optional[List[Any]] = None,
        process_group: Optional[dist.ProcessGroup] = None,
        device_mesh: Optional[Any] = None,
        bucket_cap_mb: Optional[float] = None,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
    ) -> None:
        super().__init__()
        if process_group is not None and device_mesh is not None:
            raise RuntimeError(
                "DistributedDataParallel: cannot specify both process_group and device_mesh arguments")
        if device_mesh is not None:
            if device_mesh.ndim != 1:
                raise RuntimeError(
                    f"DistributedDataParallel: only a 1-D device mesh is supported, got {device_mesh} "
                    f"with dims {device_mesh.mesh_dim_names}; pass its data-parallel dimension, e.g. "
                    "mesh['dp']")
            process_group = device_mesh.get_group(0)
        elif process_group is None:
            process_group = dist.distributed_c10d._get_default_group()
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"DistributedDataParallel: bucket_cap_mb={bucket_cap_mb} must be positive")

        self.module = module
        self._dtensor_parameters = _localize_dtensor_parameters(module)
        self.process_group = process_group
        self.device_mesh = device_mesh
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.dim = 0
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True

        params, names = self._parameters_to_reduce()
        if not params:
            raise RuntimeError(
                "DistributedDataParallel is not needed when a module doesn't have any parameter that "
                "requires a gradient.")
        devices = {p.device for p in params}
        self.is_multi_device_module = len(devices) > 1
        self.device_type = next(iter(devices)).type
        if device_ids is None or self.is_multi_device_module or self.device_type == "cpu":
            if device_ids is not None:
                raise ValueError(
                    "DistributedDataParallel: device_ids only works with a module on a single GPU; got "
                    f"device_ids={device_ids} for a module with parameters on {sorted(map(str, devices))}")
            self.device_ids = None
        else:
            if len(device_ids) != 1:
                raise ValueError(f"DistributedDataParallel: device_ids={device_ids} must name one device")
            self.device_ids = [torch.device(self.device_type, torch.cuda._utils._get_device_index(device_ids[0], True))]

        self._check_shapes_across_ranks(params, names)
        self._group_name = process_group.group_name
        # Every rank starts from rank 0's parameters and buffers.
        _C._broadcast_coalesced(params + self._buffers_to_sync(), self._group_name, 0, _BROADCAST_BUCKET_BYTES)

        cap_mb = _DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        self.bucket_bytes_cap = int(cap_mb * _MB)
        # As torch: the small first bucket only with the default cap.
        first_bucket_bytes = _DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else self.bucket_bytes_cap
        self.reducer = _C._Reducer(params, names, self._group_name, self.bucket_bytes_cap, first_bucket_bytes,
                                   find_unused_parameters, gradient_as_bucket_view, static_graph)
        self._has_comm_hook = False

    def _parameters_to_reduce(self) -> Tuple[List[nn.Parameter], List[str]]:
        # Registration order, each shared parameter once (under its first name), as torch's DDP.
        params, names, seen = [], [], set()
        for module_name, submodule in self.module.named_modules():
            for param_name, param in submodule.named_parameters(recurse=False):
                if param.requires_grad and param not in seen:
                    seen.add(param)
                    params.append(param)
                    names.append(f"{module_name}.{param_name}" if module_name else param_name)
        return params, names

    def _buffers_to_sync(self) -> List[torch.Tensor]:
        return list(self.module.buffers())

    def _check_shapes_across_ranks(self, params: List[torch.Tensor], names: List[str]) -> None:
        # A clear error at wrap time beats a hang or garbage in the first
        # all-reduce (whose buckets would differ in size across ranks).
        mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in zip(names, params)]
        world = self.process_group.size()
        everyone: List[Any] = [None] * world
        dist.all_gather_object(everyone, mine, group=self.process_group)
        me = self.process_group.rank()
        rank_of = lambda r: dist.get_global_rank(self.process_group, r)  # noqa: E731
        for r, theirs in enumerate(everyone):
            if len(theirs) != len(mine):
                raise RuntimeError(
                    f"DistributedDataParallel expects the same model on every rank, but rank {rank_of(me)} has "
                    f"{len(mine)} parameters and rank {rank_of(r)} has {len(theirs)}")
            for (name, shape, dtype), (their_name, their_shape, their_dtype) in zip(mine, theirs):
                if (shape, dtype) != (their_shape, their_dtype):
                    raise RuntimeError(
                        f"DistributedDataParallel expects the same model on every rank, but parameter "
                        f"'{name}' has shape {list(shape)} ({dtype}) on rank {rank_of(me)} and parameter "
                        f"'{their_name}' has shape {list(their_shape)} ({their_dtype}) on rank {rank_of(r)}")

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        with torch.autograd.profiler.record_function("torch_tp.DistributedDataParallel.forward"):
            grad_enabled = torch.is_grad_enabled()
            if grad_enabled:
                # Rebuilds the buckets once, after the first synchronized backward.
                self.reducer.prepare_for_forward()
            if self.require_forward_param_sync and self.broadcast_buffers:
                self._sync_buffers()
            if self.device_ids:
                device = self.device_ids[0]
                move = lambda x: x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x  # noqa: E731
                inputs, kwargs = tree_map(move, inputs), tree_map(move, kwargs)
            with _dtensor_views(self._dtensor_parameters):
                output = self.module(*inputs, **kwargs)
            if grad_enabled and self.require_backward_grad_sync:
                self.require_forward_param_sync = True
                outputs: List[torch.Tensor] = []
                if self.find_unused_parameters or self.static_graph:
                    outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
                self.reducer.prepare_for_backward(outputs)
            else:
                self.require_forward_param_sync = False
            return output

    def _sync_buffers(self) -> None:
        buffers = self._buffers_to_sync()
        if buffers and self.process_group.size() > 1:
            with torch.no_grad():
                _C._broadcast_coalesced(buffers, self._group_name, 0, _BROADCAST_BUCKET_BYTES)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        r"""Context manager that skips the gradient reduction, for gradient accumulation.

        Backwards of forwards run inside the context accumulate gradients in
        ``.grad`` locally; the first synchronized backward after it reduces the
        accumulated sum.

        Example::

            >>> with ddp.no_sync():
            ...     for batch in micro_batches[:-1]:
            ...         ddp(batch).sum().backward()
            >>> ddp(micro_batches[-1]).sum().backward()  # reduces all of them
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: object, hook: Callable[..., torch.futures.Future]) -> None:
        r"""Replace the bucket all-reduce with ``hook(state, bucket)``.

        torch's ``default_hooks.allreduce_hook``, ``fp16_compress_hook`` and
        ``bf16_compress_hook`` (with ``state`` this wrapper's process group, or
        ``None`` when that is the default group) run in C++ with the same
        arithmetic. Any other hook is called from the reducer with a
        ``GradBucket``-like object (``index()``, ``buffer()``, ``gradients()``,
        ``parameters()``, ``is_last()``, ``set_buffer()``) and must return a
        ``torch.futures.Future`` holding the reduced flat buffer. As in torch,
        the gradients in the bucket are not divided by the world size: the
        hook does that. Call it once, before the first backward.

        Args:
            state (object): passed to the hook as its first argument.
            hook (Callable): ``hook(state, bucket) -> torch.futures.Future[Tensor]``.

        Example::

            >>> from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            >>> ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        """
        if not callable(hook):
            raise TypeError(f"DistributedDataParallel.register_comm_hook: hook must be callable, got {hook!r}")
        if len(inspect.signature(hook).parameters) != 2:
            raise ValueError(
                "DistributedDataParallel.register_comm_hook: hook must take (state, bucket), got "
                f"{inspect.signature(hook)}")
        if self._has_comm_hook:
            raise RuntimeError("DistributedDataParallel.register_comm_hook can only be called once")
        builtin = _BUILTIN_HOOKS.get(hook)
        same_group = state is self.process_group or (
            state is None and self.process_group is dist.distributed_c10d._get_default_group())
        if builtin is not None and same_group:
            self.reducer.register_builtin_comm_hook(builtin)
        else:
            self.reducer.register_comm_hook(lambda bucket: hook(state, bucket))
        self._has_comm_hook = True


# NOTE [DTensor parameters under DistributedDataParallel]
# The reducer buckets plain tensors, and a tensor-parallel model's parameters
# are DTensors (NOTE [DTensor parameters, local forward] in
# torch_tp/parallel/_params.py). As torch's DDP does on a sliced 2-D mesh
# (torch.distributed.tensor.parallel.ddp), the wrapper registers each DTensor
# parameter's local tensor (same storage) as the parameter the reducer and the
# optimizer see, and around every forward puts a DTensor view of it
# (DTensor.from_local, differentiable) where the module reads the parameter,
# so the tensor-parallel modules see their DTensors. Gradients flow through
# the view into the local parameter; a Partial one (a SequenceParallel
# norm's) is summed over the TP group by from_local's backward, which
# redistributes to the parameter's placement, before the reducer reads it.


class _LocalizedParameter(NamedTuple):
    module: nn.Module
    name: str
    local: nn.Parameter  # registered on `module` outside forwards; the DTensor's local tensor
    spec: DTensor  # the original DTensor parameter: its mesh, placements, global shape and stride


def _localize_dtensor_parameters(module: nn.Module) -> List[_LocalizedParameter]:
    localized: List[_LocalizedParameter] = []
    locals_by_id = {}  # a parameter shared by several modules (tied weights) gets one local parameter
    for submodule in module.modules():
        for name, param in list(submodule._parameters.items()):
            if not isinstance(param, DTensor):
                continue
            local = locals_by_id.get(id(param))
            if local is None:
                local = nn.Parameter(param.to_local().detach(), requires_grad=param.requires_grad)
                locals_by_id[id(param)] = local
            submodule._parameters[name] = local
            localized.append(_LocalizedParameter(submodule, name, local, param))
    return localized


@contextlib.contextmanager
def _dtensor_views(localized: List[_LocalizedParameter]) -> Iterator[None]:
    """NOTE [DTensor parameters under DistributedDataParallel]: DTensor views of the local parameters
    where the modules read them, for the duration of a forward."""
    views = {}
    for entry in localized:
        view = views.get(id(entry.local))
        if view is None:
            spec = entry.spec
            view = DTensor.from_local(entry.local, spec.device_mesh, spec.placements, run_check=False,
                                      shape=spec.shape, stride=spec.stride())
            views[id(entry.local)] = view
        entry.module._parameters[entry.name] = view
    try:
        yield
    finally:
        for entry in localized:
            entry.module._parameters[entry.name] = entry.local
