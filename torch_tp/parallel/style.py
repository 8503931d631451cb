"""Parallel styles with the signatures and defaults of ``torch.distributed.tensor.parallel``.

A style turns a module into its tensor-parallel form on a 1-D mesh. The
parameters it touches become the ``nn.Parameter(DTensor)`` torch's style would
make (NOTE [DTensor parameters, local forward] in ``_params.py``); activations
stay plain local tensors, and the work is done by the torch_tp ops:

=====================  ==========================  ===================================
style                  module                      forward
=====================  ==========================  ===================================
ColwiseParallel        nn.Linear                   column_parallel_linear (W, b: Shard(0))
ColwiseParallel        nn.Embedding                column_parallel_embedding (W: Shard(1))
RowwiseParallel        nn.Linear                   row_parallel_linear (W: Shard(1), b Replicate)
RowwiseParallel        nn.Embedding                vocab_parallel_embedding (W: Shard(0))
SequenceParallel       any (norms, dropout)        the module's own forward on the sequence shard
                                                   and local parameters (Replicate); their
                                                   gradients Partial, completed after backward
PrepareModuleInput/    any                         layouts changed with all-gather / split
Output
=====================  ==========================  ===================================

Where torch hands back a DTensor (``use_local_output=False``), these styles
hand back a DTensor too, wrapping the local result (``DTensor.from_local``, no
communication), and every style accepts DTensor inputs, so code written for
torch's styles keeps working.

A style installs itself on a module through one step (NOTE [installing a style] in
``_install.py``): its parameters' placements, the mixin class whose forward the module
gets (NOTE [torch_tp forwards without replacing module.forward]) and the state that
forward reads. A class that overrides ``forward`` itself (a LoRA or quantized linear)
keeps it: torch's own style parallelizes that module (DTensor parameters, its forward
on DTensors), which runs its computation as written and composes with the torch_tp
modules around it. SequenceParallel's mixin wraps the class's own forward
(``super().forward``).
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import style as _torch_style

from ._layout import (
    ForwardRecords,
    TPGroup,
    convert,
    from_dtensor,
    generation_layout,
    global_shape_of,
    gather_replicated,
    gather_to_replicated_dtensor,
    hand_out,
    normalize,
    partial_grad_local,
    split_replicated,
    to_dtensor,
    tp_group,
)
from ._install import ParallelModule, TPState, install, module_state, refuse_second_style
from ._params import local_tensor

__all__ = [
    "ColwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
]


# ---------------------------------------------------------------- what a parallelized module keeps


@dataclass(eq=False)
class ShardedState(TPState):
    """A ColwiseParallel or RowwiseParallel ``nn.Linear``/``nn.Embedding``."""

    input_layout: Placement
    output_layout: Placement
    use_local_output: bool


@dataclass(eq=False)
class SequenceState(TPState):
    """A SequenceParallel module."""

    parameter_names: Tuple[str, ...]  # the parameters its forward runs on local tensors
    partial_grad: bool  # False on one rank, whose gradient is already the whole sum
    sequence_sharding: Shard
    use_local_output: bool
    fused_rms_norm: bool  # an nn.RMSNorm, run through torch_tp::rms_norm (NOTE [the fused sequence-parallel norm])


# ---------------------------------------------------------------- the classes a style swaps in
# Each forward reads its input (a plain tensor in the declared layout, or a
# DTensor) and its parameters' local tensors, runs one torch_tp op, and hands
# back the output in the requested layout.


class ShardedModule(ParallelModule):
    _tp_state: ShardedState

    def _tp_finish(self, local: torch.Tensor, placement: Placement, global_shape) -> Any:
        state = self._tp_state
        state.records.record_shard(local, placement, state.group, global_shape)
        if state.use_local_output:
            return local
        return hand_out(self, to_dtensor(local, state.mesh, placement, global_shape))


class ColwiseModule(ShardedModule):
    _tp_kind = "ColwiseParallel"

    def _tp_replicated_input(self, x) -> Optional[torch.Tensor]:
        """For a replicated DTensor input (a PrepareModuleInput gather), its local tensor whose
        gradient may stay partial: the sum of its consumers' partial gradients is reduced once, where
        it meets the gather that made x replicated (NOTE [partial grad_x] in linear.cpp; NOTE
        [replicated DTensor inputs without DTensor] in _layout.py). Every linear consumer of such
        an x must take it this way: under torch.compile, the other route backpropagates through
        rank-dependent code. None for any other input."""
        if isinstance(x, DTensor) and x.device_mesh.ndim == 1 and isinstance(x.placements[0], Replicate):
            return partial_grad_local(x, self._tp_state.records)
        return None

    def _tp_gathered_input(self, x, added_dims: int) -> Tuple[torch.Tensor, Optional[int], Optional[int]]:
        """``(local tensor, the dim the op gathers it along, that dim's global size)``: no gather
        (None, None) for a replicated input, d for Shard(d) (sequence parallel). ``added_dims``:
        how many dims the op's output has beyond the input's (an embedding adds its features)."""
        state = self._tp_state
        if type(x) is torch.Tensor and type(state.input_layout) is Replicate:
            return x, None, None  # the plan's usual input (every decode step): nothing to read or gather
        declared = generation_layout(state.input_layout, x.dim() + added_dims, state.records)
        local, layout, global_shape = from_dtensor(x, declared, state.group)
        if isinstance(layout, Replicate):
            return local, None, None
        if isinstance(layout, Shard) and layout.dim != local.dim() + added_dims - 1:
            return local, layout.dim, global_shape_of(local, layout, global_shape, state.group,
                                                      state.records)[layout.dim]
        raise NotImplementedError(f"torch_tp: {type(self).__name__} with input layout {layout} is not supported")

    def _tp_output_sharded_on_last(self, out: torch.Tensor, features: int):
        """out [.., features/p] (Shard(-1)) -> the requested output layout."""
        state = self._tp_state
        wanted = normalize(state.output_layout, out.dim())
        global_shape = out.shape[:-1] + (features,)
        if wanted == Shard(out.dim() - 1):
            if state.records.replicate_sequence and not state.use_local_output:
                # loss_parallel's logits, for generate(): whole and plain (NOTE [generating
                # under a sequence-parallel or loss_parallel plan] in generation.py).
                return gather_replicated(out, out.dim() - 1, state.group, features)
            return self._tp_finish(out, wanted, global_shape)
        if isinstance(wanted, Replicate):
            return self._tp_finish(gather_replicated(out, out.dim() - 1, state.group, features), wanted,
                                   global_shape)
        raise NotImplementedError(f"torch_tp: ColwiseParallel output_layouts={wanted} is not supported "
                                  "(use Shard(-1) or Replicate())")


class ColwiseLinear(ColwiseModule):
    def forward(self, x):
        out = self._tp_linear(x, local_tensor(self.weight), local_tensor(self.bias))
        return self._tp_output_sharded_on_last(out, self.out_features)

    def _tp_linear(self, x, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x (replicated, or Shard(d) to gather) -> x @ weight.T + bias [.., weight rows], ``weight`` and
        ``bias`` this rank's local rows."""
        group_name = self._tp_state.group.name
        local = self._tp_replicated_input(x)
        if local is not None:
            return torch.ops.torch_tp.column_parallel_linear(local, weight, bias, group_name, partial_grad_input=True)
        local, dim, full = self._tp_gathered_input(x, 0)
        return torch.ops.torch_tp.column_parallel_linear(local, weight, bias, group_name, dim, full)


class _ColwiseEmbedding(ColwiseModule):
    def forward(self, ids):
        local, dim, full = self._tp_gathered_input(ids, 1)
        out = torch.ops.torch_tp.column_parallel_embedding(local, local_tensor(self.weight), self._tp_state.group.name,
                                                            self.padding_idx, dim, full)
        return self._tp_output_sharded_on_last(out, self.embedding_dim)


class RowwiseModule(ShardedModule):
    _tp_kind = "RowwiseParallel"

    def _tp_scatter_dim(self, ndim: int) -> Optional[int]:
        layout = self._tp_state.output_layout
        wanted = normalize(generation_layout(layout, ndim, self._tp_state.records), ndim)
        if isinstance(wanted, Replicate):
            return None
        if isinstance(wanted, Shard) and wanted.dim != ndim - 1:
            return wanted.dim
        raise NotImplementedError(f"torch_tp: RowwiseParallel output_layouts={layout} is not supported "
                                  "(use Replicate() or Shard(d) on a non-feature dim)")


class RowwiseLinear(RowwiseModule):
    def forward(self, x):
        state = self._tp_state
        group = state.group
        local, layout, _ = from_dtensor(x, state.input_layout, group)
        last = Shard(local.dim() - 1)
        if layout != last:
            local = convert(local, layout, last, group, None, state.records)
        dim = self._tp_scatter_dim(local.dim())
        out = torch.ops.torch_tp.row_parallel_linear(local, local_tensor(self.weight), local_tensor(self.bias),
                                                      group.name, dim)
        global_shape = local.shape[:-1] + (self.out_features,)
        return self._tp_finish(out, Replicate() if dim is None else Shard(dim), global_shape)


class _RowwiseEmbedding(RowwiseModule):
    def forward(self, ids):
        state = self._tp_state
        group = state.group
        declared = generation_layout(state.input_layout, ids.dim() + 1, state.records)
        local, layout, global_shape = from_dtensor(ids, declared, group)
        if isinstance(layout, Shard):
            full = global_shape_of(local, layout, global_shape, group, state.records)[layout.dim]
            local = torch.ops.torch_tp.all_gather(local, layout.dim, group.name, full)
        global_shape = local.shape + (self.embedding_dim,)
        features = Shard(local.dim())
        if normalize(state.output_layout, local.dim() + 1) == features:
            # Sharded on the embedding dim: the op reduce-scatters along the others only, so
            # reduce to replicated and keep this rank's piece (its backward gathers the pieces).
            out = torch.ops.torch_tp.vocab_parallel_embedding(local, local_tensor(self.weight), group.name,
                                                               self.num_embeddings, self.padding_idx)
            return self._tp_finish(split_replicated(out, local.dim(), group, state.records), features, global_shape)
        dim = self._tp_scatter_dim(local.dim() + 1)
        out = torch.ops.torch_tp.vocab_parallel_embedding(local, local_tensor(self.weight), group.name,
                                                           self.num_embeddings, self.padding_idx, dim)
        return self._tp_finish(out, Replicate() if dim is None else Shard(dim), global_shape)


def _parameter_slot(module: nn.Module, name: str) -> Optional[torch.Tensor]:
    """The tensor ``module.<name>`` reads: a registered parameter, or an attribute that
    stands in for it (torch's DDP sets DTensor views of its local parameters as attributes)."""
    if name in module._parameters:
        return module._parameters[name]
    return module.__dict__.get(name)


def _set_parameter_slot(module: nn.Module, name: str, value: Optional[torch.Tensor]) -> None:
    if name in module._parameters:
        module._parameters[name] = value
    else:
        module.__dict__[name] = value


def swap_in_local_parameters(module: nn.Module, names: Tuple[str, ...], partial_grad: bool) -> Dict[str, DTensor]:
    """Put the local tensor of each of ``module``'s DTensor parameters ``names`` in its place, for the
    module's own forward (``partial_grad``: their gradients arrive as ``Partial()`` sums); returns the
    DTensors set aside, which the caller puts back with :func:`restore_parameters` in a ``finally``
    (the module must get its DTensors back even when its forward raises)."""
    set_aside: Dict[str, DTensor] = {}
    for name in names:
        value = _parameter_slot(module, name)
        if isinstance(value, DTensor):
            set_aside[name] = value
            _set_parameter_slot(module, name, local_tensor(value, partial_grad))
    return set_aside


def restore_parameters(module: nn.Module, set_aside: Dict[str, DTensor]) -> None:
    for name, value in set_aside.items():
        _set_parameter_slot(module, name, value)


# NOTE [the fused sequence-parallel norm]
# An nn.RMSNorm (the class itself: a subclass may compute something else) runs
# through torch_tp::rms_norm, which gives its numbers in one pass forward and
# two backward on the CPU, where nn.RMSNorm's composition of ATen ops costs
# several times more than the arithmetic (NOTE [fused RMSNorm on the CPU] in
# csrc/ops/norm.cpp); on other devices the op is aten::rms_norm. Its weight is
# the local tensor whose gradient arrives as a Partial() sum, as when the
# module's own forward runs. Under torch.compile the module's own forward runs
# instead, which the compiler fuses itself and with its neighbours.
class _SequenceParallelModule(ParallelModule):
    _tp_kind = "SequenceParallel"
    _tp_state: SequenceState

    def forward(self, *args, **kwargs):
        """The module's own forward on this rank's sequence shard, its parameters' local tensors
        in place of the DTensors while it runs (put back even when it raises), or for an
        nn.RMSNorm torch_tp's fused one (NOTE [the fused sequence-parallel norm]); the output is a
        ``Shard(sequence_dim)`` DTensor unless ``use_local_output``."""
        state = self._tp_state
        group, records = state.group, state.records
        # Replicate() inside generation_layouts() (NOTE [generating under a sequence-parallel or
        # loss_parallel plan] in generation.py): the whole sequence, as a plain module would run it.
        sharding = Replicate() if records.replicate_sequence else state.sequence_sharding
        if records.replicate_sequence and state.partial_grad and torch.is_grad_enabled():
            # Each rank's parameter gradient would cover the whole sequence, and the
            # end-of-backward all-reduce would sum it once per rank.
            raise RuntimeError(f"torch_tp: {type(self).__name__} ran with gradients enabled inside "
                               "generation_layouts(), which is for inference; run it under torch.no_grad() "
                               "(generate() does) or train outside it")
        global_shape = None
        if args:
            x = args[0]
            if isinstance(x, DTensor) and isinstance(x.placements[0], Shard) \
                    and normalize(x.placements[0], x.ndim) != normalize(sharding, x.ndim):
                # Sharded on another dim (a batch-sharded Shard(0) input): DTensor moves it, as in torch.
                x = x.redistribute(state.mesh, (sharding,))
            local, layout, global_shape = from_dtensor(x, sharding, group)
            global_shape = global_shape_of(local, layout, global_shape, group, records)
            wanted = normalize(sharding, local.dim())
            if layout != wanted:
                local = convert(local, layout, wanted, group, global_shape, records)
            args = (local,) + args[1:]
        if state.fused_rms_norm and len(args) == 1 and not kwargs and not torch.compiler.is_compiling():
            weight = local_tensor(_parameter_slot(self, "weight"), state.partial_grad)
            output = torch.ops.torch_tp.rms_norm(args[0], self.normalized_shape, weight, self.eps)
        else:
            set_aside = swap_in_local_parameters(self, state.parameter_names, state.partial_grad)
            try:
                output = super().forward(*args, **kwargs)
            finally:
                restore_parameters(self, set_aside)
        if not isinstance(output, torch.Tensor):
            return output
        if isinstance(sharding, Replicate):
            return output if state.use_local_output else hand_out(self, to_dtensor(output, state.mesh, sharding,
                                                                                   output.shape))
        wanted = normalize(sharding, output.dim())
        if global_shape is None or len(global_shape) != output.dim():
            global_shape = list(output.shape)
            global_shape[wanted.dim] *= group.size
        else:  # the input's global size along the sequence, the output's other sizes
            global_shape = output.shape[:wanted.dim] + global_shape[wanted.dim:wanted.dim + 1] \
                + output.shape[wanted.dim + 1:]
        records.record_shard(output, wanted, group, global_shape)
        if state.use_local_output:
            return output
        return hand_out(self, to_dtensor(output, state.mesh, wanted, global_shape))

# ---------------------------------------------------------------- the styles


def leaf_parameter_names(module: nn.Module, style: "ParallelStyle") -> Tuple[str, ...]:
    """The names of ``module``'s parameters, for a style that makes them all ``Replicate()``
    DTensors with partial gradients (NOTE [partial gradients of sequence-parallel parameters]):
    a leaf module whose forward runs on a shard of its input with the parameters' local
    tensors (SequenceParallel; HF's replicated_with_grad_allreduce in hf_plan.py)."""
    for child in module.children():
        if any(True for _ in child.parameters()):
            raise NotImplementedError(f"torch_tp: {type(style).__name__} applies to leaf modules (norms, dropout); "
                                      f"{type(module).__name__} has submodules with parameters")
    return tuple(key for key, param in module._parameters.items() if param is not None)


class ParallelStyle(_torch_style.ParallelStyle, ABC):
    """Base of the torch_tp styles: ``_apply(module, device_mesh)`` parallelizes
    ``module`` in place and returns it. ``src_data_rank`` is set by
    :func:`parallelize_module` (default 0)."""

    src_data_rank: Optional[int] = 0

    @abstractmethod
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module: ...


def _placement_tuple(layout) -> Tuple[Placement, ...]:
    return (layout,) if isinstance(layout, Placement) else tuple(layout)


# The arguments ColwiseParallel and RowwiseParallel share, for their docstrings.
_SHARDED_STYLE_ARGS = """

    Keyword Args:
        input_layouts (Placement, optional): layout of the module input;
            {input} by default.
        output_layouts (Placement, optional): layout of the module output;
            {output} by default.{output_note}
        use_local_output (bool, optional): return the local tensor (default)
            instead of a DTensor.

    Returns:
        A :class:`ParallelStyle` for :func:`parallelize_module`.

    Example::

        >>> from torch_tp import parallelize_module, {style}
        >>> m = parallelize_module(Model(), tp_mesh, {{"{key}": {style}()}})
"""


class ShardedModuleStyle(ParallelStyle):
    """What ColwiseParallel and RowwiseParallel share: shard the parameters of an
    ``nn.Linear``/``nn.Embedding`` and swap in the class with torch_tp's forward for it."""

    # module type -> ({parameter name: placement}, the mixin with its forward); each subclass sets its own.
    _layouts: Dict[type, Tuple[Dict[str, Placement], type]]
    # The layouts an unset input_layouts/output_layouts stand for.
    _default_input_layout: Placement
    _default_output_layout: Placement

    def __init__(self, *, input_layouts: Optional[Placement] = None, output_layouts: Optional[Placement] = None,
                 use_local_output: bool = True):
        super().__init__()
        self.input_layouts = (input_layouts or self._default_input_layout,)
        self.output_layouts = (output_layouts or self._default_output_layout,)
        self.use_local_output = use_local_output

    def _torch_equivalent(self) -> _torch_style.ParallelStyle:
        style = getattr(_torch_style, type(self).__name__)(
            input_layouts=self.input_layouts[0], output_layouts=self.output_layouts[0],
            use_local_output=self.use_local_output)
        style.src_data_rank = self.src_data_rank
        return style

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return self._install(module, device_mesh, ShardedState)

    def _install(self, module: nn.Module, device_mesh: DeviceMesh, state_type: type, *more_state,
                 mixin: Optional[type] = None) -> nn.Module:
        """:meth:`_apply`, with the state ``state_type(..., *more_state)``, a :class:`ShardedState`
        that may keep more (a packed style's layouts), and optionally another ``mixin`` than the
        module type's in ``_layouts``."""
        name = type(self).__name__
        base = next((t for t in self._layouts if isinstance(module, t)), None)
        if base is None:
            raise NotImplementedError(
                f"{name} currently only support nn.Linear and nn.Embedding! got {type(module).__name__}")
        refuse_second_style(module, self)
        if type(module).forward is not base.forward:
            # Its own computation: torch's style runs it on DTensors (NOTE [torch_tp
            # forwards without replacing module.forward]).
            self._torch_equivalent()._apply(module, device_mesh)
            module_state(module, device_mesh).style = repr(self)
            return module
        placements, default_mixin = self._layouts[base]
        install(module, device_mesh, self, placements, mixin or default_mixin, state_type, self.input_layouts[0],
                self.output_layouts[0], self.use_local_output, *more_state)
        return module

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}(input_layouts={self.input_layouts}, "
                f"output_layouts={self.output_layouts}, use_local_output={self.use_local_output})")


class ColwiseParallel(ShardedModuleStyle):
    __doc__ = r"""Partition an ``nn.Linear`` or ``nn.Embedding`` column-wise.

    ``nn.Linear``: weight and bias sharded on dim 0 (output features);
    ``nn.Embedding``: weight sharded on dim 1 (embedding dim). The input is
    replicated (with ``input_layouts=Shard(d)`` it is gathered along ``d``
    first, and its gradient reduce-scattered); the output is sharded on the
    last dim. The parameters become ``DTensor``\ s with those placements.""" + _SHARDED_STYLE_ARGS.format(
        input="``Replicate()``", output="``Shard(-1)``", output_note=" ``Replicate()`` all-gathers it.",
        style="ColwiseParallel", key="w1")

    _layouts = {
        nn.Linear: ({"weight": Shard(0), "bias": Shard(0)}, ColwiseLinear),
        nn.Embedding: ({"weight": Shard(1)}, _ColwiseEmbedding),
    }
    _default_input_layout = Replicate()
    _default_output_layout = Shard(-1)
    desired_input_layouts = (Replicate(),)  # as torch's: the layout the computation takes its input in
class RowwiseParallel(ShardedModuleStyle):
    __doc__ = r"""Partition an ``nn.Linear`` or ``nn.Embedding`` row-wise.

    ``nn.Linear``: weight sharded on dim 1 (input features), bias replicated and
    added once after the reduction; the input is sharded on the last dim.
    ``nn.Embedding``: weight sharded on dim 0 (the vocabulary: ids outside this
    rank's rows are masked, their rows zeroed, then summed over the ranks); the
    input is replicated. The output is replicated (all-reduce) or, with
    ``output_layouts=Shard(d)``, sharded along ``d`` (reduce-scatter). The
    parameters become ``DTensor``\ s with those placements.""" + _SHARDED_STYLE_ARGS.format(
        input="``Shard(-1)`` (nn.Embedding: ``Replicate()``)", output="``Replicate()``", output_note="",
        style="RowwiseParallel", key="w2")

    _layouts = {
        nn.Linear: ({"weight": Shard(1), "bias": Replicate()}, RowwiseLinear),
        nn.Embedding: ({"weight": Shard(0)}, _RowwiseEmbedding),
    }
    _default_input_layout = Shard(-1)
    _default_output_layout = Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # As torch: the layout the module's computation wants its input in.
        self.desired_input_layouts = (Replicate(),) if isinstance(module, nn.Embedding) else (Shard(-1),)
        return super()._apply(module, device_mesh)


class SequenceParallel(ParallelStyle):
    r"""Run a module (a norm, dropout) on this rank's shard of the sequence.

    The module's parameters become ``Replicate()`` DTensors (rank
    ``src_data_rank``'s values). Its own forward runs on the local sequence
    shard with the parameters' local tensors, so each rank's gradient for them
    covers only its shard of the sequence: it arrives as a ``Partial(sum)``
    DTensor, as with torch's style, and torch_tp completes all of a
    backward's with one all-reduce at its end, leaving ``Replicate()``
    gradients (NOTE [partial gradients of sequence-parallel parameters] in
    ``_replicated_grad.py``).

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
        names = leaf_parameter_names(module, self)
        install(module, device_mesh, self, dict.fromkeys(names, Replicate()), _SequenceParallelModule, SequenceState,
                names, device_mesh.size() > 1, self.sequence_sharding[0], self.use_local_output,
                type(module) is nn.RMSNorm, partial_grads=True)
        return module

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(sequence_dim={self.sequence_sharding[0].dim}, " \
               f"use_local_output={self.use_local_output})"



# ---------------------------------------------------------------- layout preparation


def _prepare(value, mesh: DeviceMesh, group: TPGroup, records: ForwardRecords, layout: Optional[Placement],
             desired: Optional[Placement], use_local_output: bool):
    """One input or output: annotate it with ``layout``, move it to ``desired``."""
    if layout is None:
        return value
    if isinstance(value, torch.Tensor):  # NOTE [generating under a sequence-parallel or loss_parallel plan]
        layout = generation_layout(layout, value.dim(), records)
        desired = None if desired is None else generation_layout(desired, value.dim(), records)
    local, actual, global_shape = from_dtensor(value, layout, group)
    target = actual if desired is None else normalize(desired, local.dim())
    if use_local_output and target == actual:
        return local
    global_shape = global_shape_of(local, actual, global_shape, group, records)
    if use_local_output:
        return convert(local, actual, target, group, global_shape, records)
    if isinstance(actual, Shard) and isinstance(target, Replicate):
        return gather_to_replicated_dtensor(local, actual.dim, mesh, group, global_shape[actual.dim], records)
    # Other moves of a DTensor: let DTensor make them, so that the gradients of
    # what consumes it (partial or not) are reduced as torch reduces them.
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

    def _prepare_inputs(self, inputs, mesh: DeviceMesh, group: TPGroup, records: ForwardRecords):
        if self.input_layouts is None:
            return inputs
        if not isinstance(inputs, tuple):
            inputs = (inputs,)
        if len(inputs) != len(self.input_layouts):
            raise ValueError("module inputs and input_layouts should have same length!")
        return tuple(_prepare(value, mesh, group, records, layout, desired, self.use_local_output)
                     for value, layout, desired in zip(inputs, self.input_layouts, self.desired_input_layouts))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = tp_group(device_mesh)
        module_state(module, device_mesh)  # holds the records the hooks read (shared by parallelize_module)
        if self.with_kwargs:
            def hook(module, inputs, kwargs):
                records = module._tp_state.records
                prepared = {key: _prepare(value, device_mesh, group, records, self.input_kwarg_layouts.get(key),
                                          self.desired_input_kwarg_layouts.get(key), self.use_local_output)
                            for key, value in kwargs.items()}
                return hand_out(module, (self._prepare_inputs(inputs, device_mesh, group, records), prepared))

            module.register_forward_pre_hook(hook, with_kwargs=True)
        else:
            module.register_forward_pre_hook(
                lambda module, inputs: hand_out(module, self._prepare_inputs(inputs, device_mesh, group,
                                                                             module._tp_state.records)))
        if not self.use_local_output:
            # Under torch.compile a gathered Replicate DTensor is paired with its local tensor only
            # while the module runs (NOTE [replicated DTensor inputs without DTensor] in _layout.py).
            def forget(module, inputs, kwargs, _output):
                records = module._tp_state.records
                if records.gathered:  # eager mode hands on _HandedDTensors and records none
                    records.forget_gathered(inputs + tuple(kwargs.values()))

            module.register_forward_hook(forget, with_kwargs=True)
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

    def _prepare_outputs(self, outputs, mesh: DeviceMesh, group: TPGroup, records: ForwardRecords):
        single = not isinstance(outputs, tuple)
        values = (outputs,) if single else outputs
        if len(values) != len(self.output_layouts):
            raise ValueError("module outputs and output_layouts should have same length!")
        prepared = tuple(_prepare(value, mesh, group, records, layout, desired, self.use_local_output)
                         for value, layout, desired in zip(values, self.output_layouts, self.desired_output_layouts))
        return prepared[0] if single else prepared

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = tp_group(device_mesh)
        module_state(module, device_mesh)  # holds the records the hook reads (shared by parallelize_module)
        module.register_forward_hook(
            lambda module, _inputs, outputs: hand_out(module, self._prepare_outputs(outputs, device_mesh, group,
                                                                                    module._tp_state.records)))
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
