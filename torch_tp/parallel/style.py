"""Parallel styles with the signatures and defaults of ``torch.distributed.tensor.parallel``.

A style turns a module into its tensor-parallel form on a 1-D mesh. Unlike
torch's styles, parameters stay plain ``nn.Parameter``\\ s holding this rank's
``torch.chunk`` piece (tagged with a :class:`~torch_tp.parallel._shard.ShardInfo`),
activations stay plain local tensors, and the work is done by the torch_tp ops:

=====================  ==========================  ===================================
style                  module                      forward
=====================  ==========================  ===================================
ColwiseParallel        nn.Linear                   column_parallel_linear (W, b: Shard(0))
ColwiseParallel        nn.Embedding                column_parallel_embedding (W: Shard(1))
RowwiseParallel        nn.Linear                   row_parallel_linear (W: Shard(1), b replicated)
RowwiseParallel        nn.Embedding                vocab_parallel_embedding (W: Shard(0))
SequenceParallel       any (norms, dropout)        the module on the sequence shard; parameter
                                                   gradients all-reduced over the group
PrepareModuleInput/    any                         layouts changed with all-gather / split
Output
=====================  ==========================  ===================================

Where torch hands back a DTensor (``use_local_output=False``), these styles
hand back a DTensor too, wrapping the local result (``DTensor.from_local``, no
communication), and every style accepts DTensor inputs, so code written for
torch's styles keeps working.
"""

import types
from abc import ABC, abstractmethod
from typing import Any, Dict, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle as _TorchParallelStyle

from ..ops import shard
from ._layout import (
    convert,
    from_dtensor,
    gather_replicated,
    gather_to_replicated_dtensor,
    normalize,
    partial_grad_local,
    split_replicated,
    to_dtensor,
)
from ._replicated_grad import register_replicated_grad_reduction
from ._shard import ShardInfo, get_shard_info, set_shard_info

__all__ = [
    "ColwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
]


def _group_name(mesh: DeviceMesh) -> str:
    return mesh.get_group().group_name


def _src_global_rank(mesh: DeviceMesh, src_data_rank: int) -> int:
    return dist.get_global_rank(mesh.get_group(), src_data_rank)


def _distribute(param: nn.Parameter, mesh: DeviceMesh, dim: Optional[int], src_data_rank: Optional[int]) -> nn.Parameter:
    """This rank's piece of ``param`` along ``dim`` (or all of it for ``dim=None``),
    as a new Parameter. With ``src_data_rank`` set, the values are those of that
    rank's ``param`` (broadcast first), so every rank starts from one model, as
    ``distribute_tensor`` does; with ``None`` each rank keeps its own values."""
    full = param.detach()
    if src_data_rank is not None and mesh.size() > 1:
        full = full.clone()
        dist.broadcast(full, src=_src_global_rank(mesh, src_data_rank), group=mesh.get_group())
    if dim is None:
        return nn.Parameter(full, requires_grad=param.requires_grad)
    new = nn.Parameter(shard(full, dim, mesh.get_group()), requires_grad=param.requires_grad)
    set_shard_info(new, ShardInfo(dim, full.shape, _group_name(mesh)))
    return new


def _describe(module: nn.Module, style: str, mesh: DeviceMesh) -> None:
    """Append the sharding to the module's repr: ``Linear(in_features=16, out_features=64,
    bias=True, tp=colwise: weight rows 0:32, group '1')``."""
    original = module.extra_repr

    def extra_repr(self) -> str:
        shards = []
        for name, param in self.named_parameters(recurse=False):
            info = get_shard_info(param)
            if info is None:
                shards.append(f"{name} replicated")
            else:
                shards.append(f"{name} {tuple(param.shape)} of {tuple(info.full_shape)} (dim {info.dim})")
        detail = ", ".join(shards) if shards else "no parameters"
        base = original()
        return f"{base}{', ' if base else ''}tp={style}[{detail}] over {mesh.size()} ranks"

    module.extra_repr = types.MethodType(extra_repr, module)


def _install(module: nn.Module, mesh: DeviceMesh, style, forward, kind: str) -> nn.Module:
    """Give a sharded module its layouts and its torch_tp forward."""
    module._tp_mesh = mesh
    module._tp_group_name = _group_name(mesh)
    module._tp_input_layout = style.input_layouts[0]
    module._tp_output_layout = style.output_layouts[0]
    module._tp_use_local_output = style.use_local_output
    module.forward = types.MethodType(forward, module)
    _describe(module, kind, mesh)
    return module


class ParallelStyle(_TorchParallelStyle, ABC):
    """Base of the torch_tp styles: ``_apply(module, device_mesh)`` parallelizes
    ``module`` in place and returns it. ``src_data_rank`` is set by
    :func:`parallelize_module` (default 0)."""

    src_data_rank: Optional[int] = 0

    @abstractmethod
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module: ...


def _placement_tuple(layout) -> Tuple[Placement, ...]:
    return (layout,) if isinstance(layout, Placement) else tuple(layout)


class ColwiseParallel(ParallelStyle):
    r"""Partition an ``nn.Linear`` or ``nn.Embedding`` column-wise.

    ``nn.Linear``: weight and bias sharded on dim 0 (output features);
    ``nn.Embedding``: weight sharded on dim 1 (embedding dim). The input is
    replicated (with ``input_layouts=Shard(d)`` it is gathered along ``d``
    first, and its gradient reduce-scattered); the output is sharded on the
    last dim.

    Keyword Args:
        input_layouts (Placement, optional): layout of the module input;
            ``Replicate()`` by default.
        output_layouts (Placement, optional): layout of the module output;
            ``Shard(-1)`` by default. ``Replicate()`` all-gathers it.
        use_local_output (bool, optional): return the local tensor (default)
            instead of a DTensor.

    Returns:
        A :class:`ParallelStyle` for :func:`parallelize_module`.

    Example::

        >>> from torch_tp import parallelize_module, ColwiseParallel
        >>> m = parallelize_module(Model(), tp_mesh, {"w1": ColwiseParallel()})
    """

    def __init__(self, *, input_layouts: Optional[Placement] = None, output_layouts: Optional[Placement] = None,
                 use_local_output: bool = True):
        super().__init__()
        self.input_layouts = (input_layouts or Replicate(),)
        self.output_layouts = (output_layouts or Shard(-1),)
        self.desired_input_layouts = (Replicate(),)
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Linear):
            module.weight = _distribute(module.weight, device_mesh, 0, self.src_data_rank)
            if module.bias is not None:
                module.bias = _distribute(module.bias, device_mesh, 0, self.src_data_rank)
            forward = _colwise_linear_forward
        elif isinstance(module, nn.Embedding):
            module.weight = _distribute(module.weight, device_mesh, 1, self.src_data_rank)
            forward = _colwise_embedding_forward
        else:
            raise NotImplementedError(
                f"ColwiseParallel currently only support nn.Linear and nn.Embedding! got {type(module).__name__}")
        return _install(module, device_mesh, self, forward, "colwise")

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}(input_layouts={self.input_layouts}, "
                f"output_layouts={self.output_layouts}, use_local_output={self.use_local_output})")


class RowwiseParallel(ParallelStyle):
    r"""Partition an ``nn.Linear`` or ``nn.Embedding`` row-wise.

    ``nn.Linear``: weight sharded on dim 1 (input features), bias replicated and
    added once after the reduction; the input is sharded on the last dim.
    ``nn.Embedding``: weight sharded on dim 0 (the vocabulary: ids outside this
    rank's rows are masked, their rows zeroed, then summed over the ranks); the
    input is replicated. The output is replicated (all-reduce) or, with
    ``output_layouts=Shard(d)``, sharded along ``d`` (reduce-scatter).

    Keyword Args:
        input_layouts (Placement, optional): layout of the module input;
            ``Shard(-1)`` by default (nn.Embedding: ``Replicate()``).
        output_layouts (Placement, optional): layout of the module output;
            ``Replicate()`` by default.
        use_local_output (bool, optional): return the local tensor (default)
            instead of a DTensor.

    Returns:
        A :class:`ParallelStyle` for :func:`parallelize_module`.

    Example::

        >>> from torch_tp import parallelize_module, RowwiseParallel
        >>> m = parallelize_module(Model(), tp_mesh, {"w2": RowwiseParallel()})
    """

    def __init__(self, *, input_layouts: Optional[Placement] = None, output_layouts: Optional[Placement] = None,
                 use_local_output: bool = True):
        super().__init__()
        self.input_layouts = (input_layouts or Shard(-1),)
        self.output_layouts = (output_layouts or Replicate(),)
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Linear):
            self.desired_input_layouts = (Shard(-1),)
            module.weight = _distribute(module.weight, device_mesh, 1, self.src_data_rank)
            if module.bias is not None:
                module.bias = _distribute(module.bias, device_mesh, None, self.src_data_rank)
            forward = _rowwise_linear_forward
        elif isinstance(module, nn.Embedding):
            self.desired_input_layouts = (Replicate(),)
            module.weight = _distribute(module.weight, device_mesh, 0, self.src_data_rank)
            forward = _rowwise_embedding_forward
        else:
            raise NotImplementedError(
                f"RowwiseParallel currently only support nn.Linear and nn.Embedding! got {type(module).__name__}")
        return _install(module, device_mesh, self, forward, "rowwise")

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}(input_layouts={self.input_layouts}, "
                f"output_layouts={self.output_layouts}, use_local_output={self.use_local_output})")


# ---------------------------------------------------------------- forwards of the sharded modules
# Each reads its input (a plain tensor in the declared layout, or a DTensor),
# runs one torch_tp op, and hands back the output in the requested layout.


def _finish(self, local: torch.Tensor, placement: Placement, global_shape) -> Any:
    if self._tp_use_local_output:
        return local
    return to_dtensor(local, self._tp_mesh, placement, global_shape)


def _output_sharded_on_last(self, out: torch.Tensor, features: int):
    """out [.., features/p] (Shard(-1)) -> the requested output layout."""
    wanted = normalize(self._tp_output_layout, out.dim())
    global_shape = out.shape[:-1] + (features,)
    if wanted == Shard(out.dim() - 1):
        return _finish(self, out, wanted, global_shape)
    if isinstance(wanted, Replicate):
        return _finish(self, gather_replicated(out, out.dim() - 1, self._tp_group_name, features), wanted, global_shape)
    raise NotImplementedError(f"torch_tp: ColwiseParallel output_layouts={wanted} is not supported "
                              "(use Shard(-1) or Replicate())")


def _gather_dim(self, x_layout: Placement, ndim: int) -> Optional[int]:
    """None for a replicated input; d for Shard(d) (sequence parallel)."""
    if isinstance(x_layout, Replicate):
        return None
    if isinstance(x_layout, Shard) and x_layout.dim != ndim - 1:
        return x_layout.dim
    raise NotImplementedError(f"torch_tp: {type(self).__name__} with input layout {x_layout} is not supported")


def _colwise_linear_forward(self, x):
    if isinstance(x, DTensor) and x.device_mesh.ndim == 1 and isinstance(x.placements[0], Replicate):
        # The input's gradient may stay partial: the sum of its consumers'
        # partial gradients is reduced once, where it meets the gather that
        # made x replicated (NOTE [partial grad_x] in linear.cpp; NOTE
        # [replicated DTensor inputs without DTensor] in _layout.py).
        local = partial_grad_local(x)
        out = torch.ops.torch_tp.column_parallel_linear(local, self.weight, self.bias, self._tp_group_name,
                                                         partial_grad_input=True)
        return _output_sharded_on_last(self, out, self.out_features)
    local, layout, global_shape = from_dtensor(x, self._tp_input_layout)
    dim = _gather_dim(self, layout, local.dim())
    full = None if dim is None or global_shape is None else global_shape[dim]
    out = torch.ops.torch_tp.column_parallel_linear(local, self.weight, self.bias, self._tp_group_name, dim, full)
    return _output_sharded_on_last(self, out, self.out_features)


def _colwise_embedding_forward(self, ids):
    local, layout, global_shape = from_dtensor(ids, self._tp_input_layout)
    dim = _gather_dim(self, layout, local.dim() + 1)
    full = None if dim is None or global_shape is None else global_shape[dim]
    out = torch.ops.torch_tp.column_parallel_embedding(local, self.weight, self._tp_group_name, self.padding_idx,
                                                        dim, full)
    return _output_sharded_on_last(self, out, self.embedding_dim)


def _rowwise_scatter_dim(self, ndim: int) -> Optional[int]:
    wanted = normalize(self._tp_output_layout, ndim)
    if isinstance(wanted, Replicate):
        return None
    if isinstance(wanted, Shard) and wanted.dim != ndim - 1:
        return wanted.dim
    raise NotImplementedError(f"torch_tp: RowwiseParallel output_layouts={self._tp_output_layout} is not supported "
                              "(use Replicate() or Shard(d) on a non-feature dim)")


def _rowwise_linear_forward(self, x):
    local, layout, _ = from_dtensor(x, self._tp_input_layout)
    last = Shard(local.dim() - 1)
    if layout != last:
        local = convert(local, layout, last, self._tp_group_name, None)
    out_ndim = local.dim()
    dim = _rowwise_scatter_dim(self, out_ndim)
    out = torch.ops.torch_tp.row_parallel_linear(local, self.weight, self.bias, self._tp_group_name, dim)
    global_shape = local.shape[:-1] + (self.out_features,)
    return _finish(self, out, Replicate() if dim is None else Shard(dim), global_shape)


def _rowwise_embedding_forward(self, ids):
    local, layout, global_shape = from_dtensor(ids, self._tp_input_layout)
    if isinstance(layout, Shard):
        full = None if global_shape is None else global_shape[layout.dim]
        local = torch.ops.torch_tp.all_gather(local, layout.dim, self._tp_group_name, full)
    dim = _rowwise_scatter_dim(self, local.dim() + 1)
    out = torch.ops.torch_tp.vocab_parallel_embedding(local, self.weight, self._tp_group_name, self.num_embeddings,
                                                       self.padding_idx, dim)
    global_shape = local.shape + (self.embedding_dim,)
    return _finish(self, out, Replicate() if dim is None else Shard(dim), global_shape)


# ---------------------------------------------------------------- sequence parallel


class SequenceParallel(ParallelStyle):
    r"""Run a module (a norm, dropout) on this rank's shard of the sequence.

    The module's parameters stay replicated. Each rank's gradient for them
    covers only its shard of the sequence, so the gradients are all-reduced
    over the group: every rank ends the backward with the full one (all of a
    backward's in one all-reduce at its end where that is safe; see
    NOTE [deferred replicated-gradient all-reduce] in ``_replicated_grad.py``).

    Keyword Args:
        sequence_dim (int, optional): the sharded dimension of the input and
            output; 1 by default.
        use_local_output (bool, optional): return the local tensor instead of a
            DTensor ``Shard(sequence_dim)`` (the default, as in torch).

    Returns:
        A :class:`ParallelStyle` for :func:`parallelize_module`.

    Example::

        >>> from torch_tp import parallelize_module, SequenceParallel
        >>> m = parallelize_module(Model(), tp_mesh, {"norm": SequenceParallel()})
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        super().__init__()
        self.sequence_sharding = (Shard(sequence_dim),)
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group_name = _group_name(device_mesh)
        reduced = []
        for name, param in list(module.named_parameters(recurse=False)):
            replicated = _distribute(param, device_mesh, None, self.src_data_rank)
            setattr(module, name, replicated)
            if replicated.requires_grad:
                reduced.append(replicated)
        if reduced and device_mesh.size() > 1:
            register_replicated_grad_reduction(module, reduced, group_name)
        for child in module.children():
            if any(True for _ in child.parameters()):
                raise NotImplementedError("torch_tp: SequenceParallel applies to leaf modules (norms, dropout); "
                                          f"{type(module).__name__} has submodules with parameters")
        sharding = self.sequence_sharding[0]
        use_local_output = self.use_local_output

        def prepare_input(_module, inputs):
            if not inputs:
                return inputs
            local, layout, global_shape = from_dtensor(inputs[0], sharding)
            wanted = normalize(sharding, local.dim())
            if layout != wanted:
                local = convert(local, layout, wanted, group_name, global_shape)
            module._tp_global_shape = global_shape if global_shape is not None else None
            return (local,) + tuple(inputs[1:])

        def prepare_output(_module, _inputs, output):
            if use_local_output or not isinstance(output, torch.Tensor):
                return output
            wanted = normalize(sharding, output.dim())
            global_shape = module._tp_global_shape
            if global_shape is None:
                global_shape = list(output.shape)
                global_shape[wanted.dim] *= device_mesh.size()
            return to_dtensor(output, device_mesh, wanted, global_shape)

        module.register_forward_pre_hook(prepare_input)
        module.register_forward_hook(prepare_output)
        _describe(module, f"sequence({sharding.dim})", device_mesh)
        return module

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(sequence_dim={self.sequence_sharding[0].dim}, " \
               f"use_local_output={self.use_local_output})"


# ---------------------------------------------------------------- layout preparation


def _prepare(value, mesh: DeviceMesh, layout: Optional[Placement], desired: Optional[Placement],
             use_local_output: bool):
    """One input or output: annotate it with ``layout``, move it to ``desired``."""
    if layout is None:
        return value
    local, actual, global_shape = from_dtensor(value, layout)
    target = actual if desired is None else normalize(desired, local.dim())
    if use_local_output:
        return local if target == actual else convert(local, actual, target, _group_name(mesh), global_shape)
    if isinstance(actual, Shard) and isinstance(target, Replicate):
        full_size = None if global_shape is None else global_shape[actual.dim]
        return gather_to_replicated_dtensor(local, actual.dim, mesh, _group_name(mesh), full_size)
    # Other moves of a DTensor: let DTensor make them, so that the gradients of
    # what consumes it (partial or not) are reduced as torch reduces them.
    if global_shape is None:
        global_shape = list(local.shape)
        if isinstance(actual, Shard):
            global_shape[actual.dim] *= mesh.size()
    dt = value if isinstance(value, DTensor) else to_dtensor(local, mesh, actual, global_shape)
    return dt if target == actual else dt.redistribute(mesh, (target,))


class PrepareModuleInput(ParallelStyle):
    r"""Change the layouts of a module's inputs before its forward runs.

    Keyword Args:
        input_layouts (Union[Placement, Tuple[Optional[Placement]]]): the layout
            of each positional input (``None``: leave it alone).
        desired_input_layouts (Union[Placement, Tuple[Optional[Placement]]]): the
            layout each should have; same length as ``input_layouts``.
        input_kwarg_layouts (Dict[str, Placement]): the same for keyword inputs.
        desired_input_kwarg_layouts (Dict[str, Placement]): their desired layouts.
        use_local_output (bool, optional): pass local tensors instead of
            DTensors (default ``False``, as in torch).

    Returns:
        A :class:`ParallelStyle` for :func:`parallelize_module`.

    Example::

        >>> from torch_tp import parallelize_module, PrepareModuleInput
        >>> plan = {"attn": PrepareModuleInput(input_layouts=(Shard(1), None),
        ...                                    desired_input_layouts=(Replicate(), None))}
    """

    def __init__(self, *, input_layouts=None, desired_input_layouts=None,
                 input_kwarg_layouts: Optional[Dict[str, Placement]] = None,
                 desired_input_kwarg_layouts: Optional[Dict[str, Placement]] = None,
                 use_local_output: bool = False):
        self.input_layouts = None if input_layouts is None else _placement_tuple(input_layouts)
        self.desired_input_layouts = None if desired_input_layouts is None else _placement_tuple(desired_input_layouts)
        self.use_local_output = use_local_output
        if self.input_layouts is not None:
            if self.desired_input_layouts is None:
                raise AssertionError("desired module inputs should not be None!")
            if len(self.input_layouts) != len(self.desired_input_layouts):
                raise AssertionError("input_layouts and desired_input_layouts should have same length!")
        self.with_kwargs = input_kwarg_layouts is not None
        self.input_kwarg_layouts = input_kwarg_layouts or {}
        self.desired_input_kwarg_layouts = desired_input_kwarg_layouts or {}
        if self.with_kwargs and len(self.input_kwarg_layouts) != len(self.desired_input_kwarg_layouts):
            raise AssertionError("input_kwarg_layouts and desired_input_kwarg_layouts should have same length!")

    def _prepare_inputs(self, inputs, mesh):
        if self.input_layouts is None:
            return inputs
        if not isinstance(inputs, tuple):
            inputs = (inputs,)
        if len(inputs) != len(self.input_layouts):
            raise ValueError("module inputs and input_layouts should have same length!")
        return tuple(_prepare(value, mesh, layout, desired, self.use_local_output)
                     for value, layout, desired in zip(inputs, self.input_layouts, self.desired_input_layouts))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.with_kwargs:
            def hook(_module, inputs, kwargs):
                prepared = {key: _prepare(value, device_mesh, self.input_kwarg_layouts.get(key),
                                          self.desired_input_kwarg_layouts.get(key), self.use_local_output)
                            for key, value in kwargs.items()}
                return self._prepare_inputs(inputs, device_mesh), prepared

            module.register_forward_pre_hook(hook, with_kwargs=True)
        else:
            module.register_forward_pre_hook(lambda _module, inputs: self._prepare_inputs(inputs, device_mesh))
        return module

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}(input_layouts={self.input_layouts}, "
                f"desired_input_layouts={self.desired_input_layouts}, "
                f"input_kwarg_layouts={self.input_kwarg_layouts}, "
                f"desired_input_kwarg_layouts={self.desired_input_kwarg_layouts}, "
                f"use_local_output={self.use_local_output})")


class PrepareModuleOutput(ParallelStyle):
    r"""Change the layouts of a module's outputs after its forward.

    Keyword Args:
        output_layouts (Union[Placement, Tuple[Optional[Placement]]]): the
            layout of each output (``None``: leave it alone).
        desired_output_layouts (Union[Placement, Tuple[Placement]]): the layout
            each should have; same length as ``output_layouts``.
        use_local_output (bool, optional): return local tensors (default
            ``True``) instead of DTensors.

    Returns:
        A :class:`ParallelStyle` for :func:`parallelize_module`.

    Example::

        >>> from torch_tp import parallelize_module, PrepareModuleOutput
        >>> plan = {"block": PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())}
    """

    def __init__(self, *, output_layouts, desired_output_layouts, use_local_output: bool = True):
        self.output_layouts = _placement_tuple(output_layouts)
        self.desired_output_layouts = _placement_tuple(desired_output_layouts)
        self.use_local_output = use_local_output
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise AssertionError("output_layouts and desired_output_layouts should have same length!")

    def _prepare_outputs(self, outputs, mesh):
        single = not isinstance(outputs, tuple)
        values = (outputs,) if single else outputs
        if len(values) != len(self.output_layouts):
            raise ValueError("module outputs and output_layouts should have same length!")
        prepared = tuple(_prepare(value, mesh, layout, desired, self.use_local_output)
                         for value, layout, desired in zip(values, self.output_layouts, self.desired_output_layouts))
        return prepared[0] if single else prepared

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(lambda _module, _inputs, outputs: self._prepare_outputs(outputs, device_mesh))
        return module

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}(output_layouts={self.output_layouts}, "
                f"desired_output_layouts={self.desired_output_layouts}, use_local_output={self.use_local_output})")


class PrepareModuleInputOutput(ParallelStyle):
    r""":class:`PrepareModuleInput` and :class:`PrepareModuleOutput` on one module.

    Keyword Args:
        input_layouts, desired_input_layouts, input_kwarg_layouts,
        desired_input_kwarg_layouts, use_local_input: as
            :class:`PrepareModuleInput` (``use_local_input`` is its
            ``use_local_output``; default ``False``).
        output_layouts, desired_output_layouts, use_local_output: as
            :class:`PrepareModuleOutput` (default ``use_local_output=True``).

    Returns:
        A :class:`ParallelStyle` for :func:`parallelize_module`.

    Example::

        >>> from torch_tp import PrepareModuleInputOutput
        >>> style = PrepareModuleInputOutput(input_layouts=Shard(0), desired_input_layouts=Replicate(),
        ...                                  output_layouts=Replicate(), desired_output_layouts=Shard(0))
    """

    def __init__(self, *, input_layouts=None, desired_input_layouts=None, input_kwarg_layouts=None,
                 desired_input_kwarg_layouts=None, use_local_input: bool = False, output_layouts,
                 desired_output_layouts, use_local_output: bool = True):
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts, desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input)
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.prepare_module_input._apply(module, device_mesh)
        self.prepare_module_output._apply(module, device_mesh)
        return module

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({self.prepare_module_input!r}, {self.prepare_module_output!r})"
