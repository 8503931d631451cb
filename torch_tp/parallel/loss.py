"""Vocab-parallel cross entropy: ``loss_parallel()``, a drop-in for
``torch.distributed.tensor.parallel.loss_parallel``.

Inside ``with loss_parallel():`` DTensor's ``__torch_function__`` (off
otherwise, as torch defines DTensor) intercepts ``F.cross_entropy`` (so
``nn.CrossEntropyLoss``), ``F.nll_loss``
(``nn.NLLLoss``) and ``log_softmax`` (``F.``, ``torch.``, ``torch.special.``,
``Tensor.``; ``nn.LogSoftmax``) when their input is a DTensor sharded on the
class dimension by one mesh dim (NOTE [loss_parallel on a multi-dimensional
mesh] for the others): the output of
``ColwiseParallel(use_local_output=False)`` on the output projection. It
unwraps the local shard and computes on plain tensors with
``torch.ops.torch_tp.all_reduce``. Everything else, plain tensors included,
runs the normal op untouched. A call on plain tensors alone never reaches
Python: a training step that runs its forward inside the context (as
torchtitan does) pays nothing for the context there; a
:class:`~torch.overrides.TorchFunctionMode`, which sees every call, would run
Python on each of the hundreds of calls in a step of the example model. Like torch's loss_parallel, which
patches DTensor's op dispatcher, the context changes the DTensor class for the
process while it is open; it nests, and the outermost exit restores it.

F.cross_entropy runs torch_tp::vocab_parallel_cross_entropy on the local
shard: one all-gather forward, no communication backward, fused on the CPU
(NOTE [vocab-parallel cross entropy] and NOTE [fused cross entropy on the
CPU] in csrc/ops/cross_entropy.cpp). Rows count with their weight w_t =
weight[t] (1 without weight) and 0 when t == ignore_index; mean divides by
sum(w_t), as F.cross_entropy does.

NOTE [log_softmax then nll_loss]
    ``F.nll_loss(F.log_softmax(x, c), t)`` is cross entropy in two calls. A
    side table keyed by the log_softmax output (``_log_softmax_records``)
    remembers its input shard and the global m and S; when
    nll_loss receives exactly that DTensor (same class dim, not modified in
    place), it computes the cross-entropy gradient straight into x (the
    backward of torch_tp::vocab_parallel_cross_entropy), so the
    log_softmax node is not on the loss's backward path and backward needs no
    communication. Used any other way, log_softmax has its exact gradient
    g - softmax * sum_c g (one all-reduce of sum_c g, a [..]-sized tensor).
"""

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.utils.weak import WeakIdKeyDictionary

from .._torch_private import (assert_async, disable_torch_function_subclass, dtensor_from_spec, dtensor_local,
                              dtensor_spec, legacy_get_string, tree_map_only)
from ..ops import chunk_range
from ._layout import HandedDTensor, contiguous_stride

__all__ = ["loss_parallel"]

_REDUCTIONS = ("none", "mean", "sum")


def _err(fn: str, msg: str) -> str:
    return f"torch_tp.loss_parallel: {fn}: {msg}"


# ---------------------------------------------------------------- input checks


@dataclass(frozen=True)
class _ClassShard:
    """Where the classes of a class-sharded DTensor live."""

    group: str  # the process group name of the mesh dim that shards the classes
    mesh_dim: int  # that mesh dim (0 on a 1-D mesh)
    start: int  # first class this rank holds
    length: int  # classes this rank holds (0 for a rank past the last piece)
    num_classes: int  # V, the global size of the class dim
    world: int  # ranks of that mesh dim
    rank: int  # this rank's place among them


# NOTE [loss_parallel on a multi-dimensional mesh]
# As torch's: exactly one mesh dim shards the class dim (the TP dim); each other
# mesh dim shards another tensor dim (a batch dim: data or context parallelism)
# or replicates. The classes are reduced over the TP dim's group only; every
# other mesh dim is carried through. So the target is sharded like the input
# without its class dim (the TP dim replicated, Shard(d) for d > class dim
# shifted down), reduction="none" is sharded like the target, and "sum" is
# Replicate() on the TP dim and Partial() on each batch-sharded dim (each rank
# summed its own rows). "mean" would need the global count of rows and is
# refused, as torch refuses it.


# Checked (spec, class dim) -> (spec, _ClassShard), by id: the spec is the same object from one step
# to the next for the logits torch_tp hands on (its specs are shared, _layout.layout_spec), and the checks
# and DeviceMesh lookups behind a _ClassShard are Python work that would run on every call. An entry holds its
# spec, so the id is not reused while it exists; the table is cleared when it outgrows _KEPT_SHARDS.
_class_shards: Dict[Tuple[int, int], Tuple[Any, _ClassShard]] = {}
_KEPT_SHARDS = 1024


def _class_shard(x: DTensor, dim: int, fn: str, what: str) -> _ClassShard:
    """Check that ``x`` is sharded on ``dim`` (normalized) over exactly one mesh dim, as
    torch.chunk pieces, and say which classes this rank holds (NOTE [loss_parallel on a
    multi-dimensional mesh])."""
    spec = dtensor_spec(x)
    cached = _class_shards.get((id(spec), dim))
    if cached is not None:
        shard = cached[1]
    else:
        shard = _layout_class_shard(x, dim, fn, what)
        if len(_class_shards) >= _KEPT_SHARDS:
            _class_shards.clear()
        _class_shards[(id(spec), dim)] = (spec, shard)
    local = dtensor_local(x).size(dim)
    if local != shard.length:
        raise ValueError(_err(
            fn, f"{what}'s local shard holds {local} of {shard.num_classes} classes on mesh rank {shard.rank} "
            f"of {shard.world}, but torch.chunk gives it {shard.length}; shards must be torch.chunk pieces"))
    return shard


def _layout_class_shard(x: DTensor, dim: int, fn: str, what: str) -> _ClassShard:
    """The checks of :func:`_class_shard` that read ``x``'s spec alone, and the shard it describes."""
    mesh: DeviceMesh = x.device_mesh
    on_dim = [i for i, p in enumerate(x.placements) if type(p) is Shard and p.dim % max(x.ndim, 1) == dim]
    if not on_dim:
        last_dim_sharded = x.ndim > 2 and any(type(p) is Shard and p.dim % x.ndim == x.ndim - 1
                                              for p in x.placements)
        raise ValueError(_err(
            fn, f"{what} must be sharded on its class dim {dim} (Shard({dim}) or Shard(-1) when "
            f"it is the last dim), got placements {x.placements} for shape {tuple(x.shape)}"
            + ("; for [batch, seq, vocab] logits flatten them first: "
               "F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1))" if last_dim_sharded else "")))
    if len(on_dim) > 1:
        raise ValueError(_err(
            fn, f"{what} must be sharded on its class dim {dim} by exactly one mesh dim, got placements "
            f"{x.placements} on {mesh}"))
    if any(i != on_dim[0] and not isinstance(p, (Shard, Replicate)) for i, p in enumerate(x.placements)):
        raise ValueError(_err(
            fn, f"{what}'s mesh dims other than the class-sharding one must be Shard or Replicate, got "
            f"placements {x.placements}"))
    mesh_dim = on_dim[0]
    num_classes = x.shape[dim]
    world, rank = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    start, length = chunk_range(num_classes, world, rank)
    return _ClassShard(mesh.get_group(mesh_dim).group_name, mesh_dim, start, length, num_classes, world, rank)


def _target_placements(x: DTensor, class_dim: int, shard: _ClassShard) -> Tuple[Placement, ...]:
    """The input's placements without its class dim (NOTE [loss_parallel on a multi-dimensional mesh])."""
    placements = []
    for i, p in enumerate(x.placements):
        if i == shard.mesh_dim or not isinstance(p, Shard):
            placements.append(Replicate())
        else:
            d = p.dim % x.ndim
            placements.append(Shard(d - 1 if d > class_dim else d))
    return tuple(placements)


def _replicated_local(t: torch.Tensor, mesh: DeviceMesh, fn: str, what: str) -> torch.Tensor:
    """A plain tensor, or the local tensor of a DTensor replicated on ``mesh``."""
    if isinstance(t, DTensor):
        if t.device_mesh != mesh or not all(isinstance(p, Replicate) for p in t.placements):
            raise ValueError(_err(
                fn, f"{what} must be a plain tensor or a DTensor replicated on the input's mesh, "
                f"got placements {t.placements} on {t.device_mesh}"))
        return t.to_local()
    return t


def _check_target(target: Any, x: DTensor, class_dim: int, placements: Tuple[Placement, ...], fn: str
                  ) -> torch.Tensor:
    if not isinstance(target, torch.Tensor):
        raise TypeError(_err(fn, f"target must be a Tensor, got {type(target).__name__}"))
    mesh = x.device_mesh
    expected = x.shape[:class_dim] + x.shape[class_dim + 1:]
    if any(isinstance(p, Shard) for p in placements):  # a batch-sharded mesh dim: the target must say so
        if not isinstance(target, DTensor) or target.device_mesh != mesh or tuple(target.placements) != placements:
            got = (f"placements {tuple(target.placements)} on {target.device_mesh}" if isinstance(target, DTensor)
                   else "a plain tensor")
            # "requires a DTensor": torch's words, which code written for torch matches.
            raise ValueError(_err(
                fn, f"target must be a DTensor on the input's mesh with placements {placements} (the input's "
                f"{tuple(x.placements)} without the class dim), got {got}: a mesh dim that shards a batch dim "
                "requires a DTensor target, as in torch's loss_parallel"))
        if target.shape != expected:
            raise ValueError(_err(
                fn, f"target.shape={tuple(target.shape)} does not match input.shape={tuple(x.shape)} "
                f"without the class dim {class_dim}: expected {tuple(expected)}"))
        target = target.to_local()
        local_shape = dtensor_local(x).shape
        expected = local_shape[:class_dim] + local_shape[class_dim + 1:]
    target = _replicated_local(target, mesh, fn, "target")
    if target.is_floating_point() or target.is_complex():
        raise NotImplementedError(_err(
            fn, f"target of dtype {target.dtype} (class probabilities) is not supported, as in "
            "torch's loss_parallel; pass class indices"))
    if target.dtype == torch.bool:
        raise TypeError(_err(fn, "target must hold integer class indices, got dtype torch.bool"))
    if target.device != x.device:
        raise ValueError(_err(fn, f"target is on {target.device} but input is on {x.device}"))
    if target.shape != expected:
        raise ValueError(_err(
            fn, f"target.shape={tuple(target.shape)} does not match input.shape={tuple(x.shape)} "
            f"without the class dim {class_dim}: expected {tuple(expected)}"))
    return target.long()


def _check_weight(weight: Any, mesh: DeviceMesh, num_classes: int, fn: str) -> Optional[torch.Tensor]:
    if weight is None:
        return None
    weight = _replicated_local(weight, mesh, fn, "weight")
    if weight.shape != (num_classes,):
        raise ValueError(_err(
            fn, f"weight.shape={tuple(weight.shape)} must be ({num_classes},), one per class"))
    if weight.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(_err(
            fn, "weight requires grad, but the loss is not differentiable with respect to weight "
            "(F.cross_entropy and F.nll_loss refuse it too)"))
    return weight


def _check_reduction(size_average: Any, reduce: Any, reduction: str, fn: str) -> str:
    if size_average is not None or reduce is not None:
        reduction = legacy_get_string(size_average, reduce)
    if reduction not in _REDUCTIONS:
        raise ValueError(_err(fn, f"reduction={reduction!r} is not one of {_REDUCTIONS}"))
    return reduction


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16 are computed in fp32 (as torch's log_softmax kernels do)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# ---------------------------------------------------------------- kernels on plain tensors


def _row_weights(target: torch.Tensor, weight: Optional[torch.Tensor], ignore_index: int,
                 num_classes: int, dtype: torch.dtype) -> torch.Tensor:
    """w_t per row: weight[t] (1 without weight), 0 where t == ignore_index."""
    valid = target != ignore_index
    # F.cross_entropy raises "Target 12 is out of bounds."; on CUDA this is a
    # device-side assert, so the check costs no host synchronisation.
    assert_async(
        ((target >= 0) & (target < num_classes) | ~valid).all(),
        f"torch_tp.loss_parallel: a target is outside [0, {num_classes}) and not ignore_index={ignore_index}")
    if weight is None:
        return valid.to(dtype)
    return torch.where(valid, weight.to(dtype)[torch.where(valid, target, 0)], 0)


def _local_target(target: torch.Tensor, shard: _ClassShard) -> Tuple[torch.Tensor, torch.Tensor]:
    """(index into this rank's classes, clamped to 0 elsewhere; whether t is here)."""
    local = target - shard.start
    here = (local >= 0) & (local < shard.length)
    return torch.where(here, local, 0), here


def _pick(values: torch.Tensor, index: torch.Tensor, here: torch.Tensor) -> torch.Tensor:
    """values[..., index] where ``here``, else 0 (values: [.., n_r], index: [..])."""
    if values.size(-1) == 0:  # a rank holding no classes
        return values.new_zeros(index.shape)
    picked = values.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    return torch.where(here, picked, 0)


def _max_and_sum_exp(x: torch.Tensor, group: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global m = max_c x_c, shifted x_r - m and the local sum of exp(x_r - m)."""
    if x.size(-1) == 0:
        local_max = x.new_full(x.shape[:-1], float("-inf"))
    else:
        local_max = x.amax(-1)
    m = torch.ops.torch_tp.all_reduce(local_max, "max", group)
    shifted = x - m.unsqueeze(-1)
    return m, shifted, shifted.exp().sum(-1)


def _reduce(loss: torch.Tensor, w: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / w.sum()


def _row_grad_scale(grad: torch.Tensor, w: torch.Tensor, reduction: str) -> torch.Tensor:
    """d reduced / d loss_row, times w_t: [..]."""
    if reduction == "mean":
        # where: a batch whose targets are all ignored has sum(w) = 0; its
        # gradient is 0 (as F.cross_entropy's), not 0 * inf.
        return torch.where(w == 0, 0, grad * w / w.sum())
    return grad * w


class _NLLOfLogSoftmax(torch.autograd.Function):
    """nll_loss of a log_softmax output, differentiated straight into the log_softmax's class-last
    local input ``x [.., n_r]`` (NOTE [log_softmax then nll_loss]): forward picks -logp_t (one
    all-reduce); backward is the cross-entropy gradient, torch_tp::vocab_parallel_cross_entropy's,
    from the global max m and sum of exp S of the log_softmax."""

    @staticmethod
    def forward(ctx, x, target, w, reduction, shard, m, sum_exp, logp):  # noqa: D102
        index, here = _local_target(target, shard)
        loss = -torch.ops.torch_tp.all_reduce(_pick(logp.to(w.dtype), index, here), "sum", shard.group)
        loss = torch.where(w != 0, loss * w, 0)
        ctx.save_for_backward(x, target, m, sum_exp, w)
        ctx.reduction, ctx.shard = reduction, shard
        return _reduce(loss, w, reduction).to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # noqa: D102
        x, target, m, sum_exp, w = ctx.saved_tensors
        grad_x = torch.ops.torch_tp._vocab_parallel_cross_entropy_backward(
            grad, x, target, m, sum_exp, w, ctx.shard.group, ctx.shard.num_classes, ctx.reduction)
        return grad_x, None, None, None, None, None, None, None


class _NLLLoss(torch.autograd.Function):
    """-values_t of class-last local values ``[.., n_r]``: one all-reduce
    forward; backward is local (-w_t * grad on the rank holding t)."""

    @staticmethod
    def forward(ctx, values, target, w, reduction, shard):  # noqa: D102
        index, here = _local_target(target, shard)
        picked = torch.ops.torch_tp.all_reduce(
            _pick(values.to(w.dtype), index, here), "sum", shard.group)
        loss = torch.where(w != 0, -picked * w, 0)
        ctx.save_for_backward(index, here, w)
        ctx.reduction, ctx.shape, ctx.dtype = reduction, values.shape, values.dtype
        return _reduce(loss, w, reduction).to(values.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # noqa: D102
        index, here, w = ctx.saved_tensors
        scale = _row_grad_scale(grad.to(w.dtype), w, ctx.reduction)
        grad_values = w.new_zeros(ctx.shape)
        if grad_values.size(-1) > 0:
            grad_values.scatter_(-1, index.unsqueeze(-1), torch.where(here, -scale, 0).unsqueeze(-1))
        return grad_values.to(ctx.dtype), None, None, None, None


class _LogSoftmax(torch.autograd.Function):
    """log_softmax of class-last local ``x [.., n_r]`` over all ranks' classes.
    Returns (logp, m, S); m and S feed NOTE [log_softmax then nll_loss]."""

    @staticmethod
    def forward(ctx, x, group):  # noqa: D102
        m, shifted, sum_exp_local = _max_and_sum_exp(x.to(_compute_dtype(x.dtype)), group)
        sum_exp = torch.ops.torch_tp.all_reduce(sum_exp_local, "sum", group)
        logp = (shifted - sum_exp.log().unsqueeze(-1)).to(x.dtype)
        # Save the input, not logp: logp becomes the user's DTensor, and an
        # in-place op on a DTensor does not bump its local tensor's version
        # counter, so a modified saved logp would go unnoticed.
        ctx.save_for_backward(x, m, sum_exp)
        ctx.group = group
        ctx.mark_non_differentiable(m, sum_exp)
        return logp, m, sum_exp

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, _grad_m, _grad_sum_exp):  # noqa: D102
        x, m, sum_exp = ctx.saved_tensors
        g = grad.to(m.dtype)
        # d/dx_j sum_i g_i logp_i = g_j - softmax_j * sum_i g_i, the sum over all classes.
        total = torch.ops.torch_tp.all_reduce(g.sum(-1), "sum", ctx.group)
        softmax = (x.to(m.dtype) - m.unsqueeze(-1)).exp_().div_(sum_exp.unsqueeze(-1))
        return (g - softmax * total.unsqueeze(-1)).to(x.dtype), None


# NOTE [the input's gradient keeps its layout]
# DTensor.to_local()'s backward wraps the local gradient in a spec whose global
# strides it recomputes from the local strides as if every shard were as large
# as this rank's: [10, 4] of [10, 10] split 4, 4, 2 gets strides (12, 1), not
# (10, 1). AccumulateGrad then finds strides other than the leaf's and copies
# the gradient into grad.new_empty_strided(leaf's sizes and strides), and torch
# 2.11's DTensor rule for new_empty_strided allows only Replicate() on a shape
# that does not split evenly (2.12 lifted that): the input's .grad came back
# Replicate(), all-gathered. _LocalShard gives the gradient back with the
# input's own spec instead, in the layout of the forward's local tensor, so
# on every torch the strides are the leaf's and the gradient is taken as it is.


class _LocalShard(torch.autograd.Function):
    """A DTensor -> a view of its local tensor; the local gradient goes back as a DTensor
    with the DTensor's own spec (NOTE [the input's gradient keeps its layout])."""

    @staticmethod
    def forward(ctx, x):  # noqa: D102
        local = dtensor_local(x)
        ctx.spec, ctx.stride = dtensor_spec(x), local.stride()
        return local.view_as(local)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # noqa: D102
        if grad.stride() != ctx.stride:  # the spec's strides describe the forward's layout
            grad = grad.new_empty_strided(grad.shape, ctx.stride).copy_(grad)
        return dtensor_from_spec(grad, ctx.spec, requires_grad=False)


def _local_shard(x: DTensor) -> torch.Tensor:
    """The local shard of the loss input, on the input's autograd path. A DTensor torch_tp handed on
    (the logits of its ColwiseParallel) carries its local tensor, whose gradient reaches the producer
    directly (NOTE [DTensors handed between torch_tp modules] in _layout.py)."""
    if type(x) is HandedDTensor:
        return x.local()
    return _LocalShard.apply(x)


# ---------------------------------------------------------------- handlers


@dataclass
class _LogSoftmaxRecord:
    """What nll_loss needs of a log_softmax output DTensor; see NOTE [log_softmax then nll_loss]."""

    x: torch.Tensor  # the input's local shard, class dim last (on the autograd path of the input)
    m: torch.Tensor
    sum_exp: torch.Tensor
    logp: torch.Tensor  # class dim last
    dim: int
    versions: Tuple[int, int]


# log_softmax output DTensor -> its record, for as long as that DTensor lives. A
# side table, not an attribute: the output is the user's tensor. Keyed by identity
# (torch.utils.weak), as a tensor's == compares values.
_log_softmax_records: "WeakIdKeyDictionary[DTensor, _LogSoftmaxRecord]" = WeakIdKeyDictionary()


def _versions(dt: DTensor) -> Tuple[int, int]:
    # In-place ops on the DTensor bump its own counter; on a to_local() view, the local tensor's.
    return dt._version, dtensor_local(dt)._version


def _loss(fn: str, input: DTensor, target: Any, weight: Any, ignore_index: int,
          reduction: str, cross_entropy: bool) -> torch.Tensor:
    class_dim = 0 if input.ndim == 1 else 1
    if input.ndim == 0:
        raise ValueError(_err(fn, "input must have a class dim, got a 0-d DTensor"))
    if not input.is_floating_point():
        raise TypeError(_err(fn, f"input must be floating point, got dtype {input.dtype}"))
    shard = _class_shard(input, class_dim, fn, "input")
    mesh = input.device_mesh
    mesh_ndim = mesh.ndim  # a property that computes it, on torch's DeviceMesh
    target_placements = _target_placements(input, class_dim, shard)
    global_target_shape = input.shape[:class_dim] + input.shape[class_dim + 1:]
    target = _check_target(target, input, class_dim, target_placements, fn)
    weight = _check_weight(weight, mesh, shard.num_classes, fn)
    if mesh_ndim > 1 and reduction == "mean":
        # "one-dimensional": torch's words, which code written for torch matches.
        raise NotImplementedError(_err(
            fn, f"reduction='mean' on a {mesh_ndim}-D DeviceMesh: each rank holds only its rows, so their mean "
            "is not the global mean; as in torch's loss_parallel, 'mean' is only supported on a one-dimensional "
            "DeviceMesh; use reduction='sum' or 'none' and divide by the global count"))
    if not isinstance(ignore_index, int):
        raise TypeError(_err(fn, f"ignore_index must be an int, got {ignore_index!r}"))
    if cross_entropy:
        local = _local_shard(input)
        if class_dim != input.ndim - 1:
            local = local.movedim(class_dim, -1)
        loss = torch.ops.torch_tp.vocab_parallel_cross_entropy(
            local, target, shard.group, shard.num_classes, weight, ignore_index, reduction)
    else:
        w = _row_weights(target, weight, ignore_index, shard.num_classes, _compute_dtype(input.dtype))
        record: Optional[_LogSoftmaxRecord] = _log_softmax_records.get(input)
        if record is not None and record.dim == class_dim and record.versions == _versions(input):
            # NOTE [log_softmax then nll_loss]: differentiate straight into the logits.
            loss = _NLLOfLogSoftmax.apply(record.x, target, w, reduction, shard, record.m, record.sum_exp,
                                          record.logp)
        else:
            loss = _NLLLoss.apply(_local_shard(input).movedim(class_dim, -1), target, w, reduction, shard)
    if mesh_ndim == 1:
        return loss  # complete on every rank
    # NOTE [loss_parallel on a multi-dimensional mesh]
    if reduction == "none":
        placements, shape = target_placements, global_target_shape
    else:
        placements = tuple(Replicate() if i == shard.mesh_dim else Partial() if isinstance(p, Shard) else p
                           for i, p in enumerate(input.placements))
        shape = torch.Size()
    return DTensor.from_local(loss, mesh, placements, run_check=False, shape=shape,
                              stride=contiguous_stride(shape))


def _cross_entropy_args(input, target, weight=None, size_average=None, ignore_index=-100,
                        reduce=None, reduction="mean", label_smoothing=0.0):
    return input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing


def _cross_entropy(args: tuple, kwargs: dict) -> torch.Tensor:
    input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing = \
        _cross_entropy_args(*args, **kwargs)
    fn = "cross_entropy"
    reduction = _check_reduction(size_average, reduce, reduction, fn)
    if label_smoothing != 0.0:
        raise NotImplementedError(_err(
            fn, f"label_smoothing={label_smoothing} is not supported (torch's loss_parallel does "
            "not support it either); use label_smoothing=0.0"))
    return _loss(fn, input, target, weight, ignore_index, reduction, cross_entropy=True)


def _nll_loss_args(input, target, weight=None, size_average=None, ignore_index=-100,
                   reduce=None, reduction="mean"):
    return input, target, weight, size_average, ignore_index, reduce, reduction


def _nll_loss(args: tuple, kwargs: dict) -> torch.Tensor:
    input, target, weight, size_average, ignore_index, reduce, reduction = _nll_loss_args(*args, **kwargs)
    reduction = _check_reduction(size_average, reduce, reduction, "nll_loss")
    return _loss("nll_loss", input, target, weight, ignore_index, reduction, cross_entropy=False)


def _log_softmax_dt(x: DTensor, dim: Any, dtype: Optional[torch.dtype]) -> Any:
    fn = "log_softmax"
    if isinstance(dim, str):  # a named dim: DTensors have none; let the normal op say so
        return NotImplemented
    if dim is None:  # F.log_softmax's legacy implicit dim
        warnings.warn("Implicit dimension choice for log_softmax has been deprecated. "
                      "Change the call to include dim=X as an argument.", stacklevel=4)
        dim = 0 if x.ndim in (0, 1, 3) else 1
    if x.ndim == 0:
        raise ValueError(_err(fn, "input must have a class dim, got a 0-d DTensor"))
    dim = dim % x.ndim
    shard = _class_shard(x, dim, fn, "input")
    local = _local_shard(x)
    if dtype is not None:
        local = local.to(dtype)
    if not local.is_floating_point():
        raise TypeError(_err(fn, f"input must be floating point, got dtype {local.dtype}"))
    local = local.movedim(dim, -1)
    logp, m, sum_exp = _LogSoftmax.apply(local, shard.group)
    out_local = logp.movedim(-1, dim).contiguous()
    out = DTensor.from_local(out_local, x.device_mesh, x.placements, run_check=False,
                             shape=x.shape, stride=contiguous_stride(x.shape))
    _log_softmax_records[out] = _LogSoftmaxRecord(local, m, sum_exp, logp.detach(), dim, _versions(out))
    return out


def _F_log_softmax_args(input, dim=None, _stacklevel=3, dtype=None):
    return input, dim, dtype


def _log_softmax_args(input, dim, dtype=None):
    return input, dim, dtype


def _log_softmax(binder: Callable) -> Callable[[tuple, dict], DTensor]:
    def handler(args: tuple, kwargs: dict) -> Any:
        input, dim, dtype = binder(*args, **kwargs)
        return _log_softmax_dt(input, dim, dtype)
    return handler


def _first_is_dtensor(args: tuple, kwargs: dict) -> bool:
    first = args[0] if args else kwargs.get("input", kwargs.get("self"))
    return isinstance(first, DTensor)


_HANDLERS: Dict[Callable, Callable[[tuple, dict], Any]] = {
    F.cross_entropy: _cross_entropy,
    F.nll_loss: _nll_loss,
    F.log_softmax: _log_softmax(_F_log_softmax_args),
    torch.log_softmax: _log_softmax(_log_softmax_args),
    torch.special.log_softmax: _log_softmax(_log_softmax_args),
    torch.Tensor.log_softmax: _log_softmax(_log_softmax_args),
}


def _handled(func: Callable, args: tuple, kwargs: dict) -> Any:
    """The vocab-parallel result of a handled ``func`` whose input is a DTensor, or NotImplemented
    (torch functions off for subclasses)."""
    handler = _HANDLERS.get(func)
    if handler is None or not _first_is_dtensor(args, kwargs):
        return NotImplemented
    # The handlers pass DTensors to autograd Functions, which would bypass a handed DTensor's
    # torch functions (NOTE [DTensors handed between torch_tp modules]); the input itself, given
    # first, is the exception: the handlers read its local tensor through _local_shard. pytree
    # only where there is one, or a container to look into: on the usual plain target and
    # options it is a pass over nothing, paid on every call.
    rest = args[1:]
    if any(type(v) is HandedDTensor or isinstance(v, (list, tuple, dict)) for v in (*rest, *kwargs.values())):
        rest, kwargs = tree_map_only(HandedDTensor, HandedDTensor.twin, (rest, kwargs))
    return handler(args[:1] + rest, kwargs)


@classmethod
def _loss_parallel_torch_function(cls, func, types, args=(), kwargs=None):
    """DTensor's ``__torch_function__`` inside :func:`loss_parallel`: the handled functions on DTensor
    inputs go to the vocab-parallel kernels; every other call runs as DTensor runs it (torch functions
    off for subclasses, as DTensor has them)."""
    kwargs = kwargs or {}
    with disable_torch_function_subclass():
        result = _handled(func, args, kwargs)
        if result is not NotImplemented:
            return result
        return func(*args, **kwargs)


@classmethod
def _handed_loss_parallel_torch_function(cls, func, types, args=(), kwargs=None):
    """A handed DTensor's ``__torch_function__`` inside :func:`loss_parallel`. Its own runs first (the
    subclass's), and would replace it by its twin, a DTensor on an autograd Function of its own, before
    DTensor's above saw the call: per loss, a Function forward and backward and a pytree pass over the
    arguments, for a gradient the handed DTensor's local tensor carries to its producer directly (that
    detour cost about as much as the op itself). So the handled functions go
    to the kernels with the handed DTensor itself; anything else, or what they decline, takes the handed
    DTensor's own path."""
    if func in _HANDLERS:
        with disable_torch_function_subclass():
            result = _handled(func, args, kwargs or {})
        if result is not NotImplemented:
            return result
    return _HANDED_TORCH_FUNCTION.__func__(cls, func, types, args, kwargs)


_DTENSOR_TORCH_FUNCTION = DTensor.__dict__["__torch_function__"]
_HANDED_TORCH_FUNCTION = HandedDTensor.__dict__["__torch_function__"]
_loss_parallel_depth = 0


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    r"""Compute cross entropy on logits sharded on the class dimension without gathering them.

    A drop-in for :func:`torch.distributed.tensor.parallel.loss_parallel`.
    Inside the context, :func:`~torch.nn.functional.cross_entropy`
    (:class:`~torch.nn.CrossEntropyLoss`), :func:`~torch.nn.functional.nll_loss`
    (:class:`~torch.nn.NLLLoss`) and ``log_softmax`` (``F.``, ``torch.``,
    ``torch.special.``, ``Tensor.``; :class:`~torch.nn.LogSoftmax`) compute
    vocab-parallel results when their input is a
    :class:`~torch.distributed.tensor.DTensor` sharded on the class dimension
    (dim 1, or 0 for a 1-D input) by one dim of a DeviceMesh, e.g. the output of
    ``ColwiseParallel(use_local_output=False)`` on the output projection,
    flattened to ``[batch * seq, vocab]``. A vocabulary that does not divide
    the mesh size is split as ``torch.chunk`` splits it. Calls on plain tensors
    are unchanged.

    Cross entropy takes one collective forward (an all-gather of each rank's
    max, sum of exp and target logit) and no communication backward. Logits that
    torch_tp's ``ColwiseParallel`` handed on may be reshaped first
    (``flatten(0, 1)``, ``view(-1, V)``, ``.float()``) without leaving their
    local tensor.

    Args (of the intercepted calls):
        input (DTensor): logits (log-probabilities for ``nll_loss``) with
            placements ``(Shard(class_dim),)``; ``Shard(-1)`` when the class
            dim is the last one.
        target (Tensor or DTensor): class indices, replicated: a plain tensor
            (the same on every rank) or a ``Replicate()`` DTensor. On a mesh
            whose other dims shard a batch dim, a DTensor sharded like the
            input without its class dim (as torch requires). Class
            probabilities are not supported.
        weight (Tensor or DTensor, optional): a replicated rescaling weight of
            one entry per class.
        ignore_index, reduction: as for ``F.cross_entropy``.
        label_smoothing: must be 0.0 (as in torch's loss_parallel).

    Returns:
        ``cross_entropy`` and ``nll_loss`` return a plain Tensor holding the
        complete loss on every rank, where torch returns a ``Replicate()``
        DTensor holding the same value: ``.backward()``, ``.item()``,
        ``.detach()``, arithmetic and logging behave the same; DTensor-only
        methods (``.full_tensor()``, ``.to_local()``, ``.placements``) do not
        exist on it. On a multi-dimensional mesh they return torch's DTensors:
        ``reduction="none"`` sharded like the target, ``"sum"`` ``Replicate()``
        on the class dim's mesh dim and ``Partial()`` on batch-sharded ones;
        ``"mean"`` is refused there, as by torch. ``log_softmax`` returns a
        DTensor sharded like its input.

    Differences from torch's loss_parallel:

    - ``backward()`` may run inside or outside the context (torch's must run
      inside).
    - ``log_softmax`` and ``nll_loss`` have exact gradients however they are
      combined (torch's assume ``nll_loss(log_softmax(x))``).
    - A rank holding no classes (vocabulary smaller than mesh size times the
      chunk size, e.g. 5 classes on 4 ranks) works; out-of-range targets
      raise, as in ``F.cross_entropy``.
    - The context nests and survives exceptions.

    Example::

        >>> # xdoctest: +SKIP("distributed")
        >>> from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
        >>> from torch_tp import loss_parallel
        >>> parallelize_module(model, tp_mesh, {"output": ColwiseParallel(use_local_output=False)})
        >>> with loss_parallel():
        >>>     pred = model(tokens)                         # DTensor [b, s, V], Shard(-1)
        >>>     loss = F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1))
        >>>     loss.backward()
    """
    global _loss_parallel_depth
    if _loss_parallel_depth == 0:
        DTensor.__torch_function__ = _loss_parallel_torch_function
        HandedDTensor.__torch_function__ = _handed_loss_parallel_torch_function
    _loss_parallel_depth += 1
    try:
        yield
    finally:
        _loss_parallel_depth -= 1
        if _loss_parallel_depth == 0:
            DTensor.__torch_function__ = _DTENSOR_TORCH_FUNCTION
            HandedDTensor.__torch_function__ = _HANDED_TORCH_FUNCTION
