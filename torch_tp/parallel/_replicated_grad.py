"""The gradients of replicated parameters that see only a shard of the sequence.

NOTE [partial gradients of sequence-parallel parameters]
A SequenceParallel module (a norm) keeps its parameters whole on every rank
(``Replicate()`` DTensors) but runs on this rank's sequence shard, so each
rank's gradient is a partial sum; the full gradient is the sum over the TP
group. The style hands the module local tensors whose gradient is declared
``Partial()`` (``to_local(grad_placements=...)``), so autograd delivers a
``Partial(sum)`` DTensor: the truth, which every DTensor-aware reader reduces
when it needs the value (FSDP2 before its reduce-scatter, torch's DDP through
its DTensor views, DTensor's own ops). torch's SequenceParallel stops there:
``.grad`` stays ``Partial`` after backward, and the optimizer's first DTensor
op all-reduces each such gradient on its own.

torch_tp completes them where it is cheapest. A tensor hook (it runs before
AccumulateGrad) records every parameter whose gradient arrives ``Partial``,
and one engine callback at the end of the backward all-reduces all recorded
gradients as one flat tensor per (group, dtype, device) and makes each
``.grad`` a ``Replicate()`` DTensor: one all-reduce per backward instead of
one per norm (nine in the example model). A ``.grad`` that is already complete
when a new partial gradient arrives (gradient accumulation) is first turned
into partial sums without communication (rank 0 keeps it, the others hold
zeros), so AccumulateGrad adds locally and the one all-reduce covers it too.

The cases:
  * ``torch.autograd.grad``: nothing accumulates, the caller gets the
    ``Partial`` DTensor, as from torch's TP. (The hook cannot tell this case
    apart: a ``.grad`` the parameter already holds is turned into partial sums
    and completed again at the end, unchanged in value.)
  * ``create_graph``: the gradient is itself differentiated, so the hook
    reduces it at once (``redistribute``, differentiable).
  * FSDP2, torch's and torch_tp's DistributedDataParallel: the tensor they make
    the module use (FSDP2's unsharded parameter, DDP's DTensor view of its
    local parameter) is not the hooked one; the ``Partial`` gradient reaches
    them and they reduce it, each parameter eagerly, as with torch's TP.
  * A backward that raises part-way: what it recorded stays recorded, with
    ``Partial`` gradients (correct, as DTensors); the next backward's callback
    completes them.

Every rank records the same parameters (the same program), and the callback
takes them in registration order, so the flat all-reduces line up across ranks.
"""

import functools
import itertools
from typing import Dict, List, Tuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from .._torch_private import (disable_torch_function_subclass, dtensor_from_spec, dtensor_local, dtensor_spec,
                              queue_autograd_callback)

# id(parameter) -> (registration number, parameter): parameters whose .grad
# holds Partial sums that the next end-of-backward callback completes. Strong
# references, here and in the hooks: a weak reference to a parameter would
# stop nn.Module._apply (to_empty, .to(), .double()) from swapping its
# DTensor for a new one.
_pending: Dict[int, Tuple[int, nn.Parameter]] = {}
_registration = itertools.count()


def _is_partial(grad) -> bool:
    return isinstance(grad, DTensor) and grad.placements[0].is_partial()


def _as_partial(grad: DTensor) -> DTensor:
    """A complete (Replicate) gradient as partial sums whose sum is itself: rank 0 keeps it."""
    local = grad.to_local()
    if grad.device_mesh.get_local_rank() != 0:
        local = torch.zeros_like(local)
    return DTensor.from_local(local, grad.device_mesh, [Partial()], run_check=False, shape=grad.shape,
                              stride=grad.stride())


def _complete_pending() -> None:
    """End-of-backward callback: one all-reduce per (group, dtype, device) of every recorded
    Partial gradient, which then becomes Replicate. Queued by every recording hook; the first
    one to run in a backward finds the work, the others find nothing."""
    if not _pending:
        return
    # A backward inside loss_parallel() has DTensor's torch functions on; reading and setting
    # .grad of a DTensor parameter needs none of them.
    with disable_torch_function_subclass():
        _complete()


def _complete() -> None:
    entries = sorted(_pending.values(), key=lambda entry: entry[0])
    _pending.clear()
    buckets: Dict[Tuple[str, torch.dtype, torch.device], List[Tuple[nn.Parameter, DTensor]]] = {}
    for _, param in entries:
        grad = param.grad
        if _is_partial(grad):
            key = (grad.device_mesh.get_group().group_name, grad.dtype, grad.device)
            buckets.setdefault(key, []).append((param, grad))
    with torch.no_grad():
        for (group_name, _, _), items in buckets.items():
            locals_ = [dtensor_local(grad) for _, grad in items]
            flat = torch.ops.torch_tp.all_reduce(torch.cat([t.reshape(-1) for t in locals_]), "sum", group_name)
            offset = 0
            for (param, _), local in zip(items, locals_):
                full = flat[offset: offset + local.numel()].view_as(local)
                offset += local.numel()
                # The parameter is Replicate() on the gradient's mesh with its global shape, stride
                # and dtype: its own spec is the complete gradient's.
                param.grad = dtensor_from_spec(full, dtensor_spec(param), requires_grad=False)

def _record(param: nn.Parameter, number: int, grad: torch.Tensor):
    if not _is_partial(grad):
        return None
    if torch.is_grad_enabled():  # create_graph: the gradient must stay part of the graph
        return grad.redistribute(placements=[Replicate()])
    previous = param.grad
    if isinstance(previous, DTensor) and not _is_partial(previous):
        param.grad = _as_partial(previous)
    _mark_pending(param, number)
    return None


def _mark_pending(param: nn.Parameter, number: int) -> None:
    """``param``'s ``.grad`` holds Partial sums: complete it at the end of this backward."""
    _pending[id(param)] = (number, param)
    queue_autograd_callback(_complete_pending)


def complete_partial_grads_after_backward(params: List[nn.Parameter]) -> None:
    """NOTE [partial gradients of sequence-parallel parameters] for ``params``
    (Replicate DTensor parameters of one module, in a fixed order)."""
    for param in params:
        param.register_hook(functools.partial(_record, param, next(_registration)))
