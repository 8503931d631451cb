"""torch_tp.DistributedDataParallel: data parallelism with gradient bucketing in C++.

The wrapper has the signature and the semantics of
:class:`torch.nn.parallel.DistributedDataParallel`; the reducer that buckets,
all-reduces and writes back the gradients is torch_tp's own C++ one
(``csrc/ddp/reducer.cpp``). This file is the thin Python front: choose the
group, check and broadcast the model, swap in the parameters a forward reads
(DTensor views, mixed-precision copies), tell the reducer when a forward
starts and which outputs its backward will start from, and, on a rank that
has joined, shadow the collectives of the ranks still training.
"""

import contextlib
import inspect
import os
import reprlib
import warnings
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.distributed.tensor import DTensor

from . import _C
from ._torch_private import cast_forward_inputs, get_default_group, get_device_index, to_kwargs, tree_flatten

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


class DistributedDataParallel(nn.Module, Joinable):
    r"""Data parallelism over a process group, gradients reduced in buckets by a C++ reducer.

    A drop-in replacement for :class:`torch.nn.parallel.DistributedDataParallel`:
    torch 2.15's arguments in the same order with the same defaults, and the same
    behaviour for those it implements (the others raise
    ``NotImplementedError`` when set), on every torch it supports: with torch
    2.11 and 2.12, whose DDP lacks ``forward_sync_buffers`` (2.11 also
    ``batched_grad_copy``, and every torch before 2.15 ``lazy_bucket_allocation``)
    and does not deprecate ``broadcast_buffers``, this
    one takes ``forward_sync_buffers`` and warns on ``broadcast_buffers`` as
    2.13's does. At construction the parameter shapes are checked across
    ranks and rank 0's parameters and buffers are broadcast. In backward,
    each parameter's gradient is copied into a flat bucket (divided by the
    world size) as soon as it is accumulated, and a bucket's all-reduce
    starts as soon as its last gradient is in, overlapping the rest of the
    backward. When backward returns, every ``.grad`` holds the average over
    the group.

    Buckets hold parameters of one dtype and device. The first backward uses
    one bucket (or, with ``find_unused_parameters=True``, a 1 MiB bucket and
    then ``bucket_cap_mb`` ones in reverse registration order); after it the
    buckets are rebuilt in the order gradients arrived, rank 0's order on
    every rank. On the same backend and inputs the gradients are bitwise
    torch DDP's. :meth:`join` trains on uneven inputs across ranks.

    Args:
        module (nn.Module): the module to replicate. With tensor parallelism,
            a module already parallelized by :func:`torch_tp.parallelize_module`
            (or torch's) on another mesh dimension: its DTensor parameters are
            then trained as their local tensors, which become the module's
            parameters (NOTE [DTensor parameters under DistributedDataParallel]).
        device_ids (list of int or torch.device, optional): for a module on
            one CUDA device, that device (one element); inputs are moved to it
            before the forward. ``None`` (or empty) for CPU and multi-device
            modules.
        output_device (int or torch.device, optional): accepted and checked
            as torch does (only with ``device_ids``; default ``device_ids[0]``)
            and kept as ``self.output_device``. As in torch, the forward does
            not move the output: the module decides where it is.
        dim (int): kept as ``self.dim`` (default 0). torch uses it only in its
            legacy ``scatter``/``gather`` helpers; its forward, like this one,
            moves the inputs to the one device whole instead of scattering them.
        broadcast_buffers (bool, optional): deprecated in torch for
            ``forward_sync_buffers``, with a ``FutureWarning``. ``False``
            disables the buffer broadcast at every forward and, unlike
            ``forward_sync_buffers=False``, at construction too. Ignored when
            ``forward_sync_buffers`` is given.
        init_sync (bool): check the parameter shapes across ranks and
            broadcast rank 0's parameters and buffers at construction
            (default ``True``). With ``False`` no collective runs at
            construction, and the caller makes sure every rank starts from
            the same weights.
        process_group (ProcessGroup, optional): the data-parallel group
            (default: the default group).
        bucket_cap_mb (float, optional): bucket size cap in MiB (default 25;
            the first bucket is then capped at 1 MiB).
        find_unused_parameters (bool): search the autograd graph from the
            forward outputs for parameters that will get no gradient, and
            reduce without them. Without it, a backward that leaves a
            parameter without a gradient raises.
        check_reduction (bool): deprecated and ignored, as in torch (a
            ``FutureWarning`` when ``True``).
        gradient_as_bucket_view (bool): leave each ``.grad`` a view into its
            bucket instead of a copy (saves the memory of one copy of the
            gradients).
        static_graph (bool): the set of used parameters and the graph do not
            change between iterations. Unused parameters are detected as with
            ``find_unused_parameters`` and the buckets are rebuilt after the
            first iteration.
        delay_all_reduce_named_params: not implemented; must be ``None``.
        param_to_hook_all_reduce: not implemented; must be ``None``.
        mixed_precision (torch.nn.parallel.distributed._MixedPrecision, optional):
            as in torch: the parameters stay in full precision; every forward
            runs on ``param_dtype`` copies of them (and floating-point inputs
            cast to it), the gradients are all-reduced in ``reduce_dtype``
            (default ``param_dtype``) and divided by the world size after the
            sum, and ``.grad`` is in the parameters' dtype. Buffers are cast
            to ``buffer_dtype`` once, at construction (NOTE [mixed precision]).
        device_mesh (DeviceMesh, optional): a 1-D mesh whose group is the
            data-parallel group, e.g. ``mesh["dp"]`` of a ``("dp", "tp")``
            mesh. Exclusive with ``process_group``.
        skip_all_reduce_unused_params (bool): not implemented; must be ``False``.
        bucket_cap_mb_list (list of float, optional): not implemented; must be ``None``.
        batched_grad_copy (bool): not implemented; must be ``False``.
        forward_sync_buffers (bool, optional): broadcast the buffers at the
            start of every forward that follows a synchronized one (from rank 0, or under
            :meth:`join` from the highest rank still training) and after a
            join. Construction always broadcasts them (with ``init_sync``).
            Default ``None``: as ``broadcast_buffers``, which defaults to ``True``.
        lazy_bucket_allocation (bool): not implemented; must be ``False``.

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
        output_device: Optional[Any] = None,
        dim: int = 0,
        broadcast_buffers: Optional[bool] = None,
        init_sync: bool = True,
        process_group: Optional[dist.ProcessGroup] = None,
        bucket_cap_mb: Optional[float] = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Optional[List[Tuple[str, nn.Parameter]]] = None,
        param_to_hook_all_reduce: Optional[nn.Parameter] = None,
        mixed_precision: Optional[Any] = None,
        device_mesh: Optional[Any] = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Optional[List[float]] = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: Optional[bool] = None,
        lazy_bucket_allocation: bool = False,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        for name, value, default in (("delay_all_reduce_named_params", delay_all_reduce_named_params, None),
                                     ("param_to_hook_all_reduce", param_to_hook_all_reduce, None),
                                     ("skip_all_reduce_unused_params", skip_all_reduce_unused_params, False),
                                     ("bucket_cap_mb_list", bucket_cap_mb_list, None),
                                     ("batched_grad_copy", batched_grad_copy, False),
                                     ("lazy_bucket_allocation", lazy_bucket_allocation, False)):
            if value is not default:
                raise NotImplementedError(
                    f"torch_tp.DistributedDataParallel: {name}={reprlib.repr(value)} is not implemented; leave "
                    f"it at its default {default!r} (or use torch.nn.parallel.DistributedDataParallel)")
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
            process_group = get_default_group()
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"DistributedDataParallel: bucket_cap_mb={bucket_cap_mb} must be positive")

        self.module = module
        # What the forward swaps in for the parameters: DTensor views (NOTE [DTensor parameters under
        # DistributedDataParallel]) and, with mixed precision, param_dtype copies (NOTE [mixed precision]).
        self.mixed_precision = mixed_precision
        self._param_dtype = None if mixed_precision is None else mixed_precision.param_dtype
        self._swapped_parameters = _swap_parameters(module, every_parameter=self._param_dtype is not None)
        self.process_group = process_group
        self.device_mesh = device_mesh
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._divide_by_initial_world_size = True  # set by join()

        params, names = self._parameters_to_reduce()
        if not params:
            raise RuntimeError(
                "DistributedDataParallel is not needed when a module doesn't have any parameter that "
                "requires a gradient.")
        self._check_devices(device_ids, output_device)
        self.dim = dim

        # NOTE [buffer flags] torch 2.13 deprecated broadcast_buffers for
        # forward_sync_buffers; they differ at construction only:
        # broadcast_buffers=False also keeps the buffers out of the wrap-time
        # broadcast, forward_sync_buffers=False does not. These are the rules
        # on torch 2.11 and 2.12 too (one signature for every torch supported),
        # where broadcast_buffers alone behaves as in their DDP.
        if broadcast_buffers is not None:
            if forward_sync_buffers is not None:
                warnings.warn(
                    "torch_tp.DistributedDataParallel: both `broadcast_buffers` and `forward_sync_buffers` were "
                    "specified. `broadcast_buffers` is deprecated and its value is ignored when "
                    "`forward_sync_buffers` is provided.", FutureWarning, stacklevel=2)
            else:
                warnings.warn(
                    "torch_tp.DistributedDataParallel: `broadcast_buffers` is deprecated. Use "
                    "`forward_sync_buffers` instead. IMPORTANT: unlike `broadcast_buffers=False`, "
                    "`forward_sync_buffers=False` still syncs buffers at init.", FutureWarning, stacklevel=2)
        if forward_sync_buffers is not None:
            self.forward_sync_buffers = forward_sync_buffers
            init_sync_buffers = True
        else:
            self.forward_sync_buffers = True if broadcast_buffers is None else broadcast_buffers
            init_sync_buffers = self.forward_sync_buffers
        if check_reduction:
            # As torch: the reducer always makes sure the reduction completes.
            warnings.warn(
                "torch_tp.DistributedDataParallel: the `check_reduction` argument is deprecated and ignored, as "
                "in torch's DistributedDataParallel. Please avoid using it.", FutureWarning, stacklevel=2)

        self._group_name = process_group.group_name
        if init_sync:
            self._check_shapes_across_ranks(params, names)
            # Every rank starts from rank 0's parameters (trained or frozen, as torch) and buffers.
            states = list(self.module.parameters()) + (self._buffers_to_sync() if init_sync_buffers else [])
            _C._broadcast_coalesced(states, self._group_name, 0, _BROADCAST_BUCKET_BYTES)

        cap_mb = _DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        self.bucket_bytes_cap = int(cap_mb * _MB)
        # As torch: the small first bucket only with the default cap.
        first_bucket_bytes = _DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else self.bucket_bytes_cap
        reduce_dtype = None
        if mixed_precision is not None:
            reduce_dtype = (mixed_precision.param_dtype if mixed_precision.reduce_dtype is None
                            else mixed_precision.reduce_dtype)
        self.reducer = _C._Reducer(params, names, self._group_name, self.bucket_bytes_cap, first_bucket_bytes,
                                   find_unused_parameters, gradient_as_bucket_view, static_graph,
                                   mixed_precision=mixed_precision is not None, reduce_dtype=reduce_dtype)
        self._has_comm_hook = False
        if mixed_precision is not None and mixed_precision.buffer_dtype is not None:
            # As torch's _cast_buffers: every buffer, once, after the broadcast.
            for buffer in self.module.buffers():
                buffer.data = buffer.to(dtype=mixed_precision.buffer_dtype)
        # As torch: inputs move to device_ids[0] on a side stream unless PYTORCH_DDP_USE_SIDE_STREAM=0.
        self._use_side_stream_for_tensor_copies = os.environ.get("PYTORCH_DDP_USE_SIDE_STREAM", "1") == "1"

    @property
    def broadcast_buffers(self) -> bool:
        """The deprecated name of ``forward_sync_buffers``, as in torch."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    # torch 2.15's manual finalization of backward, where the caller ends each backward itself. The reducer
    # here always ends it (NOTE [end of backward] in csrc/ddp/reducer.cpp): the mode reads as off, and
    # asking for it is refused rather than silently ignored.
    @property
    def require_manual_backward_finalization(self) -> bool:
        """Always ``False``: the reducer finalizes every backward itself (manual finalization, torch 2.15's,
        is not implemented)."""
        return False

    @require_manual_backward_finalization.setter
    def require_manual_backward_finalization(self, required: bool) -> None:
        if required:
            raise NotImplementedError(
                "torch_tp.DistributedDataParallel: require_manual_backward_finalization=True is not implemented; "
                "every backward is finalized when it ends (or use torch.nn.parallel.DistributedDataParallel)")

    @property
    def should_finalize_after_backward(self) -> bool:
        """``False``, as torch's is while manual finalization is off."""
        return False

    def finalize_backward(self) -> None:
        """Refused, as torch's is while manual finalization is off: every backward is finalized when it ends."""
        raise RuntimeError("DistributedDataParallel.finalize_backward: require_manual_backward_finalization is "
                           "False; the reducer finalized the backward when it ended")

    def _check_devices(self, device_ids: Optional[List[Any]], output_device: Optional[Any]) -> None:
        # torch's checks, in torch's order, over every parameter (trained or frozen).
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError(
                f"DistributedDataParallel: device_ids can only be None or contain a single element, got "
                f"device_ids={device_ids}")
        module_params = list(self.module.parameters())
        devices = {p.device for p in module_params}
        device_types = {d.type for d in devices}
        if len(device_types) != 1:
            raise ValueError(
                "DistributedDataParallel's input module must be on the same type of devices, but input module "
                f"parameters locate in {sorted(device_types)}")
        self.is_multi_device_module = len(devices) > 1
        self.device_type = next(iter(device_types))
        self.device = module_params[0].device
        if not device_ids or self.device_type == "cpu" or self.is_multi_device_module:
            # As torch, a falsy output_device (0) passes.
            if device_ids or output_device:
                raise ValueError(
                    "DistributedDataParallel: device_ids and output_device only work with a module on one GPU "
                    "(for CPU and multi-device modules both must be None), but got device_ids="
                    f"{device_ids}, output_device={output_device} and module parameters on "
                    f"{sorted(map(str, devices))}")
            self.device_ids = None
            self.output_device = None
        else:
            self.device_ids = [get_device_index(d, True) for d in device_ids]
            self.output_device = get_device_index(device_ids[0] if output_device is None else output_device, True)

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
            # NOTE [collectives under join] A rank's forward issues, in this
            # order: the join context's "still training" all-reduce, the bucket
            # rebuild's broadcast (once), the buffer broadcast (under join: the
            # all-reduce that picks its source first), the "will sync
            # backward" all-reduce (under join); then its backward all-reduces
            # the buckets. A joined rank's _JoinHook.main_hook issues the same
            # sequence, as torch's _DDPJoinHook does for torch's DDP.
            join_work = Join.notify_join_context(self)
            if grad_enabled:
                # Rebuilds the buckets once, after the first synchronized backward.
                self.reducer.prepare_for_forward()
            if self._will_sync_buffers():
                self._sync_buffers()
            if self._join_config.enable:
                self._check_global_requires_backward_grad_sync(is_joined_rank=False)
            if self.device_ids:
                device = torch.device(self.device_type, self.device_ids[0])
                moved_inputs, moved_kwargs = to_kwargs(inputs, kwargs, device, self._use_side_stream_for_tensor_copies)
                inputs, kwargs = moved_inputs[0], moved_kwargs[0]
            if self._param_dtype is not None:
                inputs, kwargs = cast_forward_inputs(self._param_dtype, *inputs, **kwargs)
            with _forward_parameters(self._swapped_parameters, self._param_dtype):
                output = self.module(*inputs, **kwargs)
            if grad_enabled and self.require_backward_grad_sync:
                self.require_forward_param_sync = True
                if join_work is not None and not self._divide_by_initial_world_size:
                    # The "still training" all-reduce counted the ranks that run this backward.
                    # (Its future, not work.wait(): a backend may finish the work before the future.)
                    count = join_work.get_future().wait()[0]
                    self.reducer.set_divisor(int(count.item()))
                outputs: List[torch.Tensor] = []
                if self.find_unused_parameters or self.static_graph:
                    outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
                self.reducer.prepare_for_backward(outputs)
            else:
                self.require_forward_param_sync = False
            return output

    @property
    def _distributed_rank(self) -> int:
        return dist.get_rank(self.process_group)

    def _will_sync_buffers(self) -> bool:
        return self.require_forward_param_sync and self.forward_sync_buffers and bool(self._buffers_to_sync())

    def _sync_buffers(self) -> None:
        # Under join, rank 0 may have joined with stale buffers: the source is
        # the highest rank still training, as in torch.
        src = self._find_common_rank(self._distributed_rank, True) if self._join_config.enable else 0
        with torch.no_grad():
            _C._broadcast_coalesced(self._buffers_to_sync(), self._group_name, src, _BROADCAST_BUCKET_BYTES)

    def _find_common_rank(self, rank: int, is_candidate: bool) -> int:
        # The highest group rank among the candidates (-1 from the others).
        candidate = torch.tensor([rank if is_candidate else -1], device=self.device)
        dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=self.process_group)
        common = int(candidate.item())
        if common == -1:
            raise RuntimeError(
                "torch_tp.DistributedDataParallel: no rank qualified as the source of a join-time broadcast; "
                "this is a bug in torch_tp")
        return common

    def _check_global_requires_backward_grad_sync(self, is_joined_rank: bool) -> Optional[bool]:
        # Under join: tells the joined ranks whether this iteration's backward
        # is synchronized (not under no_sync on some rank still training).
        flag = torch.ones(1, device=self.device) if not is_joined_rank and self.require_backward_grad_sync \
            else torch.zeros(1, device=self.device)
        work = dist.all_reduce(flag, group=self.process_group, async_op=True)
        if not is_joined_rank:
            return None  # the ranks still training do not need the answer
        work.wait()
        return flag.item() != 0

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        # After join: every rank takes the parameters (and buffers, if they
        # are synced) of the highest rank among the last to join.
        src = self._find_common_rank(self._distributed_rank, is_last_joiner)
        states = list(self.module.parameters()) + (self._buffers_to_sync() if self.forward_sync_buffers else [])
        with torch.no_grad():
            _C._broadcast_coalesced(states, self._group_name, src, _BROADCAST_BUCKET_BYTES)

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

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        r"""Context manager for training on uneven inputs across ranks, as torch's ``DistributedDataParallel.join``.

        A rank that leaves the loop inside the context (out of inputs) keeps
        issuing the collectives of the ranks still training, with zero
        gradients, until every rank has left; then every rank takes the
        parameters (and buffers, with ``forward_sync_buffers``) of the last
        rank to leave (the highest such rank on a tie). Collectives of the
        training loop other than this wrapper's are not shadowed; with those,
        use ``throw_on_early_termination=True``.

        Args:
            divide_by_initial_world_size (bool): divide the gradients by the
                group size (``True``, default: every sample weighs the same),
                or by the number of ranks still training (``False``). The
                second applies where the reducer divides, i.e. without a
                comm hook and without ``mixed_precision`` (their hooks divide
                by the group size), as in torch.
            enable (bool): ``False`` makes the context do nothing (inputs
                known to be even).
            throw_on_early_termination (bool): as soon as one rank runs out of
                inputs, raise ``RuntimeError`` on every rank instead of
                continuing with fewer ranks.

        Returns:
            A :class:`torch.distributed.algorithms.Join` context manager.

        Example::

            >>> with ddp.join():
            ...     for batch in my_batches:  # a different number on each rank
            ...         ddp(batch).sum().backward()
            ...         optimizer.step()
            ...         optimizer.zero_grad()
        """
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        r"""The :class:`JoinHook` that shadows this wrapper's collectives on a joined rank.

        Keyword Args:
            divide_by_initial_world_size (bool): see :meth:`join` (default ``True``).
        """
        return _JoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

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
        hook does that. Call it once, before the first backward; not with
        ``mixed_precision``, which reduces with its own hook (as in torch).

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
        if self.mixed_precision is not None:
            raise RuntimeError(
                f"DistributedDataParallel.register_comm_hook: mixed_precision={self.mixed_precision} reduces the "
                "gradients with its own hook, as in torch's DDP; no other hook can be registered")
        if self._has_comm_hook:
            raise RuntimeError("DistributedDataParallel.register_comm_hook can only be called once")
        builtin = _BUILTIN_HOOKS.get(hook)
        same_group = state is self.process_group or (
            state is None and self.process_group is get_default_group())
        if builtin is not None and same_group:
            self.reducer.register_builtin_comm_hook(builtin)
        else:
            self.reducer.register_comm_hook(lambda bucket: hook(state, bucket))
        self._has_comm_hook = True


class _JoinHook(JoinHook):
    """A joined rank's side of NOTE [collectives under join] (torch's _DDPJoinHook)."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool) -> None:
        super().__init__()
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp.reducer.prepare_for_forward()  # the bucket rebuild's broadcast, once
        if ddp._will_sync_buffers():
            src = ddp._find_common_rank(ddp._distributed_rank, False)
            with torch.no_grad():
                _C._broadcast_coalesced(ddp._buffers_to_sync(), ddp._group_name, src, _BROADCAST_BUCKET_BYTES)
        sync_backward = ddp._check_global_requires_backward_grad_sync(is_joined_rank=True)
        # The next iteration syncs buffers only after a synchronized one, as on the ranks still training.
        ddp.require_forward_param_sync = sync_backward
        if sync_backward:
            ddp.reducer.join_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._sync_final_model(is_last_joiner)


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


# NOTE [mixed precision] torch's DDP swaps each parameter's .data for a
# param_dtype copy in a forward pre-hook and back in a backward callback, and
# so has to re-hook the AccumulateGrad nodes every iteration (a dtype change
# makes autograd a new one). Here the forward reads a differentiable
# param.to(param_dtype) instead, swapped in as the DTensor views are: the
# backward casts its gradient up on the way into the full-precision
# parameter's AccumulateGrad, whose hook the reducer keeps. The numbers are
# torch's: a param_dtype gradient is exact in the parameter's dtype, the
# bucket is cast to reduce_dtype (default param_dtype) and all-reduced there,
# and divided after the sum. One difference: torch casts an accumulated .grad
# (no_sync, zero_grad(set_to_none=False)) down to param_dtype at the next
# forward and accumulates in it; here .grad accumulates in the parameter's dtype.


class _SwappedParameter(NamedTuple):
    module: nn.Module
    name: str
    local: nn.Parameter  # registered on `module` outside forwards
    spec: Optional[DTensor]  # for a DTensor parameter, the original: its mesh, placements, global shape and stride


def _swap_parameters(module: nn.Module, every_parameter: bool) -> List[_SwappedParameter]:
    """The parameters a forward reads through a swapped-in tensor: every DTensor one, whose local tensor
    becomes the parameter, and with ``every_parameter`` the others too (mixed precision)."""
    swapped: List[_SwappedParameter] = []
    locals_by_id = {}  # a parameter shared by several modules (tied weights) gets one local parameter
    for submodule in module.modules():
        for name, param in list(submodule._parameters.items()):
            if isinstance(param, DTensor):
                local = locals_by_id.get(id(param))
                if local is None:
                    local = nn.Parameter(param.to_local().detach(), requires_grad=param.requires_grad)
                    locals_by_id[id(param)] = local
                submodule._parameters[name] = local
                swapped.append(_SwappedParameter(submodule, name, local, param))
            elif param is not None and every_parameter:
                swapped.append(_SwappedParameter(submodule, name, param, None))
    return swapped


@contextlib.contextmanager
def _forward_parameters(swapped: List[_SwappedParameter], dtype: Optional[torch.dtype]) -> Iterator[None]:
    """For the duration of a forward, where the modules read a swapped parameter: its ``dtype`` copy
    (NOTE [mixed precision]), as a DTensor view for a DTensor parameter (NOTE [DTensor parameters under
    DistributedDataParallel]). Both differentiable, one per parameter however many modules share it."""
    views = {}
    for entry in swapped:
        view = views.get(id(entry.local))
        if view is None:
            view = entry.local if dtype is None else entry.local.to(dtype)
            if entry.spec is not None:
                spec = entry.spec
                view = DTensor.from_local(view, spec.device_mesh, spec.placements, run_check=False,
                                          shape=spec.shape, stride=spec.stride())
            views[id(entry.local)] = view
        entry.module._parameters[entry.name] = view
    try:
        yield
    finally:
        for entry in swapped:
            entry.module._parameters[entry.name] = entry.local
