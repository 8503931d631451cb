"""Moving plain local tensors between DTensor layouts with the torch_tp ops.

The styles keep activations as plain local tensors. A layout is one of torch's
placements on a 1-D mesh: ``Replicate()``, ``Shard(d)`` (this rank's
``torch.chunk`` piece along ``d``) or, for a row-parallel product, partial sums
(handled inside the ops). Gradients follow Megatron's convention: the gradient
of a replicated tensor is complete and identical on every rank, and the
gradient of a shard is complete for that piece. So a gather to ``Replicate``
is differentiated by taking this rank's piece of the gradient, and a split
from ``Replicate`` by gathering the pieces; neither sums.
"""

import weakref
from collections import OrderedDict
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.utils.hooks import RemovableHandle

from .._torch_private import (DTensorSpec, TensorMeta, disable_torch_function_subclass, dtensor_from_spec,
                              dtensor_local, dtensor_spec, global_backward_hooks, global_backward_pre_hooks,
                              set_post_accumulate_grad_hooks, tree_map_only)
from ..ops import chunk_range


class TPGroup(NamedTuple):
    """A mesh dim's process group as the layouts use it: its registered name (what the
    ops take), this rank's position in it and its size (which ``torch.chunk`` piece is
    ours). Read once, when a style is applied: resolving a group by name while the
    model runs is a C++ call that torch.compile cannot trace, and a per-call cost."""

    name: str
    rank: int
    size: int


def tp_group(mesh: DeviceMesh, dim: int = -1) -> TPGroup:
    """The group of ``mesh``'s dim ``dim``; by default its last, the TP dim of an (ep, tp) mesh
    (a 1-D mesh's only one)."""
    dim %= mesh.ndim
    return TPGroup(mesh.get_group(dim).group_name, mesh.get_local_rank(dim), mesh.size(dim))


def normalize(placement: Placement, ndim: int) -> Placement:
    """``Shard(-1)`` on a 3-d tensor is ``Shard(2)``: compare placements after this."""
    if isinstance(placement, Shard) and placement.dim < 0:
        return Shard(placement.dim + ndim)
    return placement


class _GatherReplicated(torch.autograd.Function):
    """Shard(dim) -> Replicate: all-gather forward, this rank's piece of the (complete) gradient backward."""

    @staticmethod
    def forward(ctx, x, dim, group_name, rank, size, full_size):
        ctx.dim, ctx.rank, ctx.size = dim, rank, size
        return torch.ops.torch_tp.all_gather(x, dim, group_name, full_size)

    @staticmethod
    def backward(ctx, grad):
        start, length = chunk_range(grad.size(ctx.dim), ctx.size, ctx.rank)
        return grad.narrow(ctx.dim, start, length).contiguous(), None, None, None, None, None


class _SplitReplicated(torch.autograd.Function):
    """Replicate -> Shard(dim): this rank's piece forward, all-gather of the pieces' gradients backward."""

    @staticmethod
    def forward(ctx, x, dim, group_name, rank, size):
        ctx.dim, ctx.group_name, ctx.full = dim, group_name, x.size(dim)
        start, length = chunk_range(x.size(dim), size, rank)
        return x.narrow(dim, start, length).clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, grad):
        full = torch.ops.torch_tp.all_gather(grad.contiguous(), ctx.dim, ctx.group_name, ctx.full)
        return full, None, None, None, None


class _CompleteGradAsPartial(torch.autograd.Function):
    """Identity forward; backward hands on a complete (replicated) gradient as
    partial sums: rank 0 keeps it and the others pass zeros, which sum to it
    over the ranks exactly and without communication.

    Under torch.compile every rank's backward graph must order its collectives
    alike. Zeros made from the gradient's shape alone would free the collective
    that consumes them from waiting for the gradient's producer on ranks other
    than 0, and inductor may then schedule it before collectives that rank 0
    issues first: the ranks wait on each other forever. So there the gradient
    is scaled by 1 or 0, one graph on every rank."""

    @staticmethod
    def forward(ctx, x, rank):
        ctx.rank = rank
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if torch.compiler.is_compiling():
            return grad * (1.0 if ctx.rank == 0 else 0.0), None
        return (grad if ctx.rank == 0 else torch.zeros_like(grad)), None


# NOTE [replicated DTensor inputs without DTensor]
# PrepareModuleInput with use_local_output=False must hand the module a
# DTensor, as torch does; under torchtitan's plan the module passes it straight
# to column-parallel linears (wq/wk/wv, w1/w3), whose partial input gradients
# DTensor would sum with one reduce-scatter. torch_tp gets the same without
# DTensor's redistribute in either direction: it all-gathers the local shard
# with torch_tp's all_gather (backward: sum reduce-scatter of partial
# gradients) and hands the result on as a DTensor that carries the gathered
# tensor (NOTE [DTensors handed between torch_tp modules]); torch_tp's
# column-parallel layers take it from there with partial_grad_input, so their
# gradients meet at the all_gather as partial sums. Any other consumer uses
# the DTensor as a DTensor; its (complete) gradient reaches the gathered
# tensor as partial sums through _CompleteGradAsPartial, so both kinds of
# consumer can be mixed. Under torch.compile the wrapper is DTensor.from_local's
# and the root's ForwardRecords pair it with the gathered tensor instead, in a
# plain list that lives only as long as the prepared module's forward (its
# forward hook drops them): torch.compile traces the appends and the removal
# within one graph, and the list is empty again, as its guard expects, when
# the next block starts.

# NOTE [DTensors handed between torch_tp modules]
# Where torch returns a DTensor (SequenceParallel's output, PrepareModuleInput's
# gathered input, a linear with use_local_output=False), torch_tp hands back a
# HandedDTensor: a DTensor of the same global shape, placements and values,
# made without an autograd node. Made and read back by the next module, it
# costs a fraction of DTensor.from_local and to_local, which also add two
# backward nodes (benchmarks/bench_handoff.py times both).
# It carries the local tensor it wraps, with that tensor's autograd history,
# and the next torch_tp module (a PrepareModuleInput after a SequenceParallel
# norm, the column-parallel linears after a PrepareModuleInput) computes on the
# local tensor directly, as loss_parallel's kernels do with handed logits
# (parallel/loss.py replaces this class's __torch_function__ inside the
# context for the functions it handles). Anything else that uses it as a tensor (a torch function or
# Tensor method, through its __torch_function__; DTensor's to_local,
# redistribute, full_tensor) gets its twin: an ordinary differentiable DTensor
# over the same local tensor, made the first time one is needed. Reading its
# metadata (shape, size(), dtype, device, requires_grad, placements,
# device_mesh) needs no twin. Gradients: the torch_tp consumers' reach the
# local tensor directly, the twin's through the twin's backward, and autograd
# sums them there, as it sums a DTensor's consumers' gradients.
#
# What differs from the DTensor torch makes: its type is a subclass of
# DTensor; a hook registered on it sees only the gradient that went through
# the twin, and torch.autograd.grad with respect to it raises (the handed
# tensor itself is not in the graph; ask for the module's input instead).
# A custom autograd.Function given it as an input directly (Function.apply runs
# no __torch_function__) would send the gradient to the handed tensor, where
# nothing reads it: that raises in backward, naming the cause. Under
# torch.compile DTensor.from_local is what gets traced, and none of this applies.
#
# Module backward hooks are such a Function: with a full backward hook or a
# backward pre-hook on a module (register_full_backward_hook, or process-wide
# register_module_full_backward_pre_hook, as CommDebugMode's module tracker
# does), nn.Module passes the module's inputs and outputs through
# BackwardHookFunction. So while a process-wide one is registered, nothing is
# handed: the twin is given out instead (_hand), and a module with hooks of its
# own gives out twins (hand_out).


_NO_TWIN_NEEDED = frozenset({
    torch.Tensor.shape.__get__, torch.Tensor.ndim.__get__, torch.Tensor.dtype.__get__,
    torch.Tensor.device.__get__, torch.Tensor.layout.__get__, torch.Tensor.requires_grad.__get__,
    torch.Tensor.is_cuda.__get__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel,
    torch.Tensor.stride, torch.Tensor.element_size, torch.Tensor.is_floating_point, torch.Tensor.__len__,
})


class HandedDTensor(DTensor):
    """A DTensor torch_tp hands from one of its modules to the next (NOTE [DTensors handed
    between torch_tp modules]). ``_tp_local``: the local tensor, whose gradient is complete
    (a shard's piece, or the whole of a replicated tensor); None until :meth:`local` makes
    it from ``_tp_partial``, a gathered replicated tensor whose consumers' gradients are
    partial sums (passed on as such from rank ``_tp_rank``: _CompleteGradAsPartial);
    ``_tp_twin``: the differentiable DTensor, once something needed it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NO_TWIN_NEEDED:
            with disable_torch_function_subclass():
                return func(*args, **kwargs)
        if func in _LEADING_DIMS_OPS and not kwargs:
            with disable_torch_function_subclass():
                reshaped = _reshape_leading_dims(func, args)
            if reshaped is not None:
                return reshaped
        args, kwargs = tree_map_only(HandedDTensor, HandedDTensor.twin, (args, kwargs))
        return func(*args, **kwargs)

    def local(self) -> torch.Tensor:
        """The local tensor, with a complete gradient (what DTensor's to_local hands back)."""
        if self._tp_local is None:
            self._tp_local = _CompleteGradAsPartial.apply(self._tp_partial, self._tp_rank)
        return self._tp_local

    def twin(self) -> DTensor:
        if self._tp_twin is None:
            self._tp_twin = _WrapLocal.apply(self.local(), dtensor_spec(self))
        return self._tp_twin

    def to_local(self, *, grad_placements=None) -> torch.Tensor:
        return self.twin().to_local(grad_placements=grad_placements)

    def redistribute(self, *args, **kwargs) -> DTensor:
        return self.twin().redistribute(*args, **kwargs)

    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:
        return self.twin().full_tensor(grad_placements=grad_placements)


# NOTE [reshaping the leading dims of a handed DTensor]
# A loss reshapes the logits that ColwiseParallel(use_local_output=False) hands
# it (Shard on the class dim, the last) before it reads them: torchtitan's loss
# takes logits.flatten(0, 1).float(), Hugging Face's logits.view(-1, V). On a
# DTensor each is a pass through DTensor's dispatch and sharding propagation,
# forward and again backward. When only the last dim is sharded, the leading
# dims are whole on every rank, so the same op on the local tensor gives this
# rank's piece of the result, sharded on its last dim, with the class dim
# untouched:
#     flatten(s, e), e < n - 1:   [.., V/p] -> [.., prod(dims s..e), .., V/p]   Shard(last)
#     view/reshape(sizes), sizes[-1] == V (-1 inferred from the global size)
#     float(), to(dtype):         the same shapes, in that dtype (the tensor
#                                 itself when it has it already, as torch's)
# The result is handed on like its source, over the reshaped local tensor,
# whose autograd history reaches the producer directly. Any other shape (the
# class dim merged or split, a non-contiguous source, named dims, keyword
# arguments) goes through the twin and DTensor, as before.

_LEADING_DIMS_OPS = frozenset({torch.Tensor.flatten, torch.flatten, torch.Tensor.view, torch.Tensor.reshape,
                               torch.reshape, torch.Tensor.float, torch.Tensor.to})


def _flatten_dims(_input, start_dim=0, end_dim=-1):
    return start_dim, end_dim


def _reshape_leading_dims(func, args) -> Optional["HandedDTensor"]:
    """``func(*args)`` on a handed DTensor sharded on its last dim only, when it keeps that dim: the
    same op on the local tensor, handed on (NOTE [reshaping the leading dims of a handed DTensor]);
    None for anything else."""
    x = args[0]
    if type(x) is not HandedDTensor or x._tp_local is None:
        return None
    spec = dtensor_spec(x)
    shape = spec.shape
    ndim = len(shape)
    if spec.mesh.ndim != 1 or spec.placements[0] != Shard(ndim - 1) or ndim < 2 \
            or spec.stride != contiguous_stride(shape):
        return None
    local = x._tp_local
    if func is torch.Tensor.float or func is torch.Tensor.to:
        if func is torch.Tensor.float and len(args) == 1:
            dtype = torch.float32
        elif func is torch.Tensor.to and len(args) == 2 and isinstance(args[1], torch.dtype):
            dtype = args[1]
        else:
            return None
        if local.dtype == dtype:
            return x  # as Tensor.float() and Tensor.to() return the tensor itself
        out, new_shape = local.to(dtype), shape
    elif func is torch.Tensor.flatten or func is torch.flatten:
        if len(args) > 3:  # flatten(dims, out_dim): named dims
            return None
        start, end = _flatten_dims(*args)
        if type(start) is not int or type(end) is not int or not -ndim <= start < ndim or not -ndim <= end < ndim:
            return None
        start, end = start % ndim, end % ndim
        if start > end or end == ndim - 1:
            return None
        merged = 1
        for size in shape[start:end + 1]:
            merged *= size
        out, new_shape = local.flatten(start, end), (*shape[:start], merged, *shape[end + 1:])
    else:  # view, reshape
        sizes = args[1:]
        if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
            sizes = tuple(sizes[0])
        if not sizes or any(type(size) is not int for size in sizes) or sizes.count(-1) > 1:
            return None
        known = 1
        for size in sizes:
            known *= size if size != -1 else 1
        numel = spec.tensor_meta.shape.numel()
        if known <= 0 or numel % known:
            return None
        new_shape = tuple(numel // known if size == -1 else size for size in sizes)
        if new_shape[-1] != shape[-1] or torch.Size(new_shape).numel() != numel:
            return None
        out = func(local, (*new_shape[:-1], local.size(-1)))
    new_shape = torch.Size(new_shape)
    return _hand(out, None, x._tp_rank, layout_spec(spec.mesh, Shard(len(new_shape) - 1), new_shape, out.dtype),
                 out.requires_grad)


def _gradient_went_astray(_tensor: torch.Tensor) -> None:
    raise RuntimeError(
        "torch_tp: a gradient reached a DTensor that torch_tp handed from one of its modules to the next, "
        "where nothing reads it: a custom torch.autograd.Function took that DTensor as an input (Function.apply "
        "bypasses torch functions), or a module with a full backward hook returned it from another module. "
        "Pass the Function x.to_local() or a DTensor made from it by a torch op instead "
        "(NOTE [DTensors handed between torch_tp modules] in torch_tp/parallel/_layout.py).")


# One dict for every handed DTensor: nothing else registers hooks on them (a user's
# register_post_accumulate_grad_hook reaches the twin), so it is never changed.
_ASTRAY_HOOKS = {0: _gradient_went_astray}


def hand_local(local: torch.Tensor, spec: DTensorSpec) -> "HandedDTensor":
    """``local``, a piece with a complete gradient, handed on as the DTensor ``spec`` describes."""
    return _hand(local, None, 0, spec, local.requires_grad)


def _hand(local: Optional[torch.Tensor], partial: Optional[torch.Tensor], rank: int, spec: DTensorSpec,
          requires_grad: bool) -> HandedDTensor:
    source = local if local is not None else partial
    handed = dtensor_from_spec(source.detach(), spec, requires_grad=requires_grad, subclass=HandedDTensor)
    handed._tp_local, handed._tp_partial, handed._tp_rank, handed._tp_twin = local, partial, rank, None
    if requires_grad:
        with disable_torch_function_subclass():
            set_post_accumulate_grad_hooks(handed, _ASTRAY_HOOKS)
    if global_backward_hooks or global_backward_pre_hooks:
        return handed.twin()
    return handed


def hand_out(module: nn.Module, value):
    """``value`` (an input or output of ``module``) with each handed DTensor swapped for its twin where
    ``module`` has backward hooks of its own, which pass its inputs and outputs through an
    autograd.Function (NOTE [DTensors handed between torch_tp modules])."""
    if module._backward_hooks or module._backward_pre_hooks:
        return tree_map_only(HandedDTensor, HandedDTensor.twin, value)
    return value


def gather_to_replicated_dtensor(local: torch.Tensor, dim: int, mesh: DeviceMesh, group: TPGroup,
                                 full_size: Optional[int], records: "ForwardRecords") -> DTensor:
    """Shard(dim) -> a Replicate DTensor (NOTE [replicated DTensor inputs without DTensor]);
    under torch.compile the caller drops the pair with ``records.forget_gathered`` when its
    module's forward ends."""
    full = torch.ops.torch_tp.all_gather(local, dim, group.name, full_size)
    if not torch.compiler.is_compiling():
        return _hand(None, full, group.rank, layout_spec(mesh, Replicate(), full.shape, full.dtype), full.requires_grad)
    dt = to_dtensor(_CompleteGradAsPartial.apply(full, group.rank), mesh, Replicate(), full.shape)
    records.gathered.append((dt, full))
    return dt


def partial_grad_local(x: DTensor, records: "ForwardRecords") -> torch.Tensor:
    """A Replicate DTensor's local tensor, for a consumer whose input gradient is a partial sum."""
    if type(x) is HandedDTensor and x._tp_partial is not None:
        return x._tp_partial
    for made, full in records.gathered:
        if made is x:
            return full
    return x.to_local(grad_placements=(Partial(),))


def gather_replicated(x: torch.Tensor, dim: int, group: TPGroup, full_size: Optional[int]) -> torch.Tensor:
    return _GatherReplicated.apply(x, dim, group.name, group.rank, group.size, full_size)


def split_replicated(x: torch.Tensor, dim: int, group: TPGroup, records: "ForwardRecords") -> torch.Tensor:
    piece = _SplitReplicated.apply(x, dim, group.name, group.rank, group.size)
    records.record_shard(piece, Shard(dim), group, x.shape)
    return piece


# NOTE [global sizes of plain shards]
# A plain tensor carries no global shape, and torch.chunk pieces need not be
# even (a sequence of 16 over 3 ranks: 6, 6, 4), so a plain Shard(d) input
# does not say how many rows a gather must produce. Under torchtitan's plan
# the sequence shards between the layers are plain tensors: the embedding and
# the row-parallel wo/w2 hand them back with use_local_output=True, and the
# residual adds make new tensors, so nothing can ride on the tensor itself.
# But torch_tp made those shards and knew their global size then. Each style
# that produces a Shard(d) piece records the global size under (group, ndim,
# d), and a style that needs the global size of a plain Shard(d) input reads
# it back.
#
# Whether the ranks communicate for it must not depend on a rank's own piece:
# the ranks would then make different calls (one a size exchange, another the
# data gather) and fail in a collective size mismatch. So it rests only on
# what every rank has alike, whether a record exists (every rank runs the
# same program and records the same keys):
# * a record: a rank whose piece is its torch.chunk piece of the recorded size
#   takes that size; where that holds on every rank, the pieces are exactly
#   the torch.chunk split of it. A rank whose piece does not fit (a record of
#   another tensor with the same key) takes its pieces to be even, as
#   DTensor.from_local does;
# * no record (a shard that torch_tp did not make): the ranks all-gather their
#   piece sizes (one int64 each) and check them against the torch.chunk split
#   of their sum, all alike, before any data moves. The layers of a torch_tp
#   model find a record, so only such inputs pay this collective.
# A DTensor input carries its global shape and needs neither.
#
# A record must not outlive the forward that made it: a user's own plain
# input of another length in the next step (18 rows at 3 ranks: 6, 6, 6,
# after 16: 6, 6, 4) fits the old record on ranks 0 and 1 but not on rank 2,
# and the ranks would compute with different global sizes and no error (a
# rank cannot see another rank's misfit). So the forward of every module
# handed to parallelize_module that no other such module contains (the
# model, under torchtitan's calls on the model and then on each block) starts
# with no records, on every rank alike. The records belong to that outermost
# module (ForwardRecords, shared by every torch_tp module below it, whichever
# parallelize_module call parallelized them), so two models in one process
# never read each other's. Only the outermost modules get the hook: an
# activation-checkpointed block recomputed in backward keeps the records of
# the forward it repeats, and a per-block torch.compile traces no hook.


# Shards of up to this many dims find their keys in the records from the start
# (ForwardRecords.expect_group): a record then only changes a value, so
# torch.compile, which guards on a dict's keys, finds the same keys at every
# block from the first step on, and the blocks share one graph.
_PRESET_NDIM = 8


class ForwardRecords:
    """What the torch_tp modules below one parallelized root (the outermost module handed
    to :func:`parallelize_module`) tell each other during its forward."""

    def __init__(self) -> None:
        # (group name, ndim, sharded dim) -> global size (NOTE [global sizes of plain shards]).
        self.shard_sizes: Dict[Tuple[str, int, int], Optional[int]] = {}
        # Under torch.compile: (Replicate DTensor, the gathered tensor it wraps), while the
        # prepared module's forward runs (NOTE [replicated DTensor inputs without DTensor]).
        self.gathered: List[Tuple[DTensor, torch.Tensor]] = []
        # Inside generation_layouts(): sequence shards are replicated and the loss_parallel
        # logits gathered (NOTE [generating under a sequence-parallel or loss_parallel plan]).
        self.replicate_sequence = False

    def __reduce__(self):
        # Records hold this forward's tensors: a copy or an unpickled model starts with none.
        return (ForwardRecords, ())

    def expect_group(self, group: TPGroup) -> None:
        """Make the size keys of ``group``'s shards of up to _PRESET_NDIM dims, with no record."""
        for ndim in range(1, _PRESET_NDIM + 1):
            for dim in range(ndim):
                self.shard_sizes.setdefault((group.name, ndim, dim), None)

    def forget(self, _module: nn.Module, _args) -> None:
        """Forward pre-hook of the root: its forward starts with no records. The sizes are
        emptied in place and never shrunk: torch.compile guards on their keys, so a compiled
        block traced once stays valid from step to step."""
        for key in self.shard_sizes:
            self.shard_sizes[key] = None
        self.gathered.clear()  # left only by a forward that raised

    def record_shard(self, local: torch.Tensor, placement: Placement, group: TPGroup, global_shape) -> None:
        """``local`` is this rank's ``placement`` piece of ``global_shape``."""
        if isinstance(placement, Shard):
            self.shard_sizes[(group.name, local.dim(), placement.dim)] = global_shape[placement.dim]

    def forget_gathered(self, values) -> None:
        """Forward hook of a prepared module: drop the pairs of the DTensors among its inputs."""
        self.gathered[:] = [pair for pair in self.gathered if not any(pair[0] is value for value in values)]


# Parallelized root -> (its records, its forget hook).
_roots: "weakref.WeakKeyDictionary[nn.Module, Tuple[ForwardRecords, RemovableHandle]]" = weakref.WeakKeyDictionary()


def records_root(module: nn.Module) -> Tuple[nn.Module, ForwardRecords]:
    """The parallelized root whose records ``module``'s torch_tp modules share, and those
    records: the root that contains ``module``, or else ``module`` itself, which becomes a
    root (its forward starts with no records) and takes over the roots inside it. The caller
    gives every torch_tp module below the root these records."""
    for root, (records, _) in _roots.items():
        if any(module is inner for inner in root.modules()):
            return root, records
    for inner in [m for m in module.modules() if m in _roots]:
        _roots.pop(inner)[1].remove()
    records = ForwardRecords()
    _roots[module] = (records, module.register_forward_pre_hook(records.forget))
    return module, records


def generation_layout(placement: Placement, ndim: int, records: ForwardRecords) -> Placement:
    """``placement`` of an activation of ``ndim`` dims (features last), as the plan has it; inside
    ``generation_layouts()`` a shard of a dim other than the features (the sequence) is ``Replicate()``
    (NOTE [generating under a sequence-parallel or loss_parallel plan] in generation.py)."""
    if records.replicate_sequence and isinstance(placement, Shard) and normalize(placement, ndim).dim != ndim - 1:
        return Replicate()
    return placement


def from_dtensor(x, declared: Placement, group: TPGroup) -> Tuple[torch.Tensor, Placement, Optional[torch.Size]]:
    """``(local tensor, its placement, global shape or None)``.

    A DTensor brings its own placement and global shape; a plain tensor is
    taken to be in the ``declared`` layout, and its global shape is None here:
    a caller that needs it asks ``global_shape_of`` (NOTE [global sizes of
    plain shards]), so that only the calls that use it may pay for it.
    """
    if type(x) is HandedDTensor:  # torch_tp's own, on a 1-D mesh: its spec says all, without torch functions
        spec = dtensor_spec(x)
        return x.local(), normalize(spec.placements[0], len(spec.shape)), spec.shape
    if isinstance(x, DTensor):
        if x.device_mesh.ndim != 1:
            raise ValueError(f"torch_tp: expected a DTensor on a 1-D mesh, got one on {x.device_mesh}")
        local = x.to_local()
        placement, global_shape = normalize(x.placements[0], x.ndim), x.shape
        if isinstance(placement, Shard) and torch.compiler.is_compiling():
            _refuse_empty_pieces_under_compile(global_shape, placement.dim, group)
        return local, placement, global_shape
    if isinstance(x, torch.Tensor):
        return x, normalize(declared, x.ndim), None
    raise TypeError(f"torch_tp: expected a torch.Tensor or DTensor input, got {type(x).__name__}")


def global_shape_of(local: torch.Tensor, placement: Placement, global_shape: Optional[torch.Size],
                    group: TPGroup, records: ForwardRecords) -> torch.Size:
    """The global shape of ``local`` in layout ``placement``: ``global_shape`` when
    ``from_dtensor`` knew it, else NOTE [global sizes of plain shards]."""
    if global_shape is not None:
        return global_shape
    if not isinstance(placement, Shard):
        return local.shape
    dim = placement.dim
    size = records.shard_sizes.get((group.name, local.dim(), dim))
    if size is None:
        size = _exchanged_global_size(local, dim, group)
    elif chunk_range(size, group.size, group.rank)[1] != local.size(dim):
        size = local.size(dim) * group.size
    shape = list(local.shape)
    shape[dim] = size
    shape = torch.Size(shape)
    if torch.compiler.is_compiling():
        _refuse_empty_pieces_under_compile(shape, dim, group)
    return shape


@torch.compiler.disable
def _exchanged_global_size(local: torch.Tensor, dim: int, group: TPGroup) -> int:
    """Every rank's piece size along ``dim``; their sum, once they are checked to be its torch.chunk split.
    (A metadata exchange with a host sync, so torch.compile runs it outside the graph.)"""
    mine = torch.tensor([local.size(dim)], dtype=torch.int64, device=local.device)
    pieces = torch.ops.torch_tp.all_gather(mine, 0, group.name, None).tolist()
    size = sum(pieces)
    expected = [chunk_range(size, group.size, rank)[1] for rank in range(group.size)]
    if pieces != expected:
        raise ValueError(
            f"torch_tp: a plain Shard({dim}) input has pieces of {pieces} along dim {dim} on ranks "
            f"0..{group.size - 1} (this rank: shape {tuple(local.shape)}), which is not torch.chunk's split of "
            f"their sum {size} ({expected}). Shard inputs must be torch.chunk pieces; pass another layout as a "
            "DTensor that describes it.")
    return size


def _refuse_empty_pieces_under_compile(global_shape: torch.Size, dim: int, group: TPGroup) -> None:
    """Each rank compiles its own graph for its own piece. A rank whose piece is empty has
    no data dependence between the layers it runs, so its compiled backward may issue the
    collectives in another order than the other ranks' (it did for a Llama block: the
    attention's before the MLP's), and they would exchange the wrong tensors. Every rank
    knows every piece's size, so every rank refuses, before any communication."""
    size = global_shape[dim]
    empty = [rank for rank in range(group.size) if chunk_range(size, group.size, rank)[1] == 0]
    if empty:
        raise ValueError(
            f"torch_tp: under torch.compile, a size of {size} along dim {dim} (global shape "
            f"{tuple(global_shape)}) over {group.size} ranks leaves rank(s) {empty} an empty torch.chunk piece, "
            "whose compiled graph may order the collectives differently from the other ranks'. Use a size "
            "that gives every rank at least one row, or run this model eagerly, where empty pieces work.")


class _WrapLocal(torch.autograd.Function):
    """``local`` -> a DTensor with ``spec``, sharing its memory: the twin of a
    :class:`HandedDTensor` (NOTE [DTensors handed between torch_tp modules]), which is
    ``DTensor.from_local`` without its checks and with a spec built once per layout and
    shape. Backward, as from_local's: the gradient's local tensor, redistributed first if
    it arrives in other placements."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: DTensorSpec) -> DTensor:
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        return dtensor_from_spec(local.view_as(local), spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor):
            spec = ctx.spec
            if grad.placements != spec.placements:
                grad = grad.redistribute(spec.mesh, spec.placements)
            grad = grad.to_local() if torch.is_grad_enabled() else dtensor_local(grad)
        return grad, None


def contiguous_stride(shape: torch.Size) -> Tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (as torch computes them: a size-0 dim counts as 1)."""
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


# (mesh, placement, global shape, dtype) -> the DTensorSpec; bounded, as shapes may vary.
_specs: "OrderedDict[tuple, DTensorSpec]" = OrderedDict()
_SPECS_KEPT = 256


def layout_spec(mesh, placement: Placement, global_shape: torch.Size, dtype: torch.dtype) -> DTensorSpec:
    """The spec of a DTensor torch_tp hands on, made once per layout, shape and dtype."""
    key = (mesh, placement, global_shape, dtype)
    spec = _specs.get(key)
    if spec is None:
        meta = TensorMeta(global_shape, contiguous_stride(global_shape), dtype)
        spec = _specs[key] = DTensorSpec(mesh, (placement,), tensor_meta=meta)
        if len(_specs) > _SPECS_KEPT:
            _specs.popitem(last=False)
    return spec


def to_dtensor(local: torch.Tensor, mesh, placement: Placement, global_shape) -> DTensor:
    """Wrap ``local`` as the DTensor torch would hand back, with the global shape
    given explicitly so that uneven shards are described correctly."""
    global_shape = torch.Size(global_shape)
    if torch.compiler.is_compiling():  # from_local is what dynamo traces
        stride = contiguous_stride(global_shape)
        return DTensor.from_local(local, mesh, (placement,), run_check=False, shape=global_shape, stride=stride)
    return hand_local(local, layout_spec(mesh, placement, global_shape, local.dtype))


def convert(local: torch.Tensor, src: Placement, dst: Placement, group: TPGroup,
            global_shape: Optional[torch.Size], records: ForwardRecords) -> torch.Tensor:
    """Move ``local`` from layout ``src`` to ``dst`` (both normalized)."""
    if src == dst:
        return local
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        full = None if global_shape is None else global_shape[src.dim]
        return gather_replicated(local, src.dim, group, full)
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        return split_replicated(local, dst.dim, group, records)
    raise NotImplementedError(f"torch_tp: redistributing a tensor from {src} to {dst} is not supported")
