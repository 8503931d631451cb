"""The gradients of replicated parameters that see only a shard of the sequence.

A SequenceParallel module (a norm) keeps its parameters whole on every rank
but runs on this rank's sequence shard, so each rank computes only a partial
sum of their gradient; the full gradient is the sum over the TP group.

NOTE [deferred replicated-gradient all-reduce]
Reducing each such gradient as backward produces it costs one small
all-reduce per norm, in the middle of backward, where every one of them waits
for the slowest rank (nine per step in the example model; on gloo each costs
well over a millisecond there). So where it is safe, the gradient hook lets
the partial gradient accumulate into ``.grad``, remembers it, and one engine
callback at the end of the backward all-reduces all of them as one flat
tensor per (group, dtype) and writes ``.grad = previous .grad + full sum``:
the same value as the eager path's accumulation of the reduced gradient.
DTensor also completes these gradients after backward (they are ``Partial``
until redistributed).

It is safe only when nothing reads ``.grad`` before the end of the backward
and the gradient goes to ``.grad`` at all, so the hook reduces eagerly when:
  * the backward does not accumulate into this parameter (torch.autograd.grad
    with it as an input: the hook's return value is the result);
  * grad mode is on (create_graph: the gradient is itself differentiated);
  * the forward ran inside a data-parallel wrapper (torch's or torch_tp's
    DistributedDataParallel), whose hooks read ``.grad`` as soon as it is
    accumulated.
Every rank takes the same decisions in the same order, since they depend only
on the program, so the deferred all-reduces line up across the ranks. A
tensor hook a user adds to such a parameter sees the partial gradient when the
reduction is deferred (as a DTensor hook sees a ``Partial`` one).
"""

import functools
import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from ..ddp import DistributedDataParallel

__all__ = ["register_replicated_grad_reduction"]

# Deferred gradients by the graph task (backward) that produced them: (group
# name, dtype) -> [(parameter, partial gradient, .grad before this backward)].
# Keyed by task because backwards nest: a reentrant activation checkpoint runs
# an inner backward, with its own end-of-backward callback, inside the outer one.
_Entry = Tuple[nn.Parameter, torch.Tensor, Optional[torch.Tensor]]
_pending: Dict[int, Dict[Tuple[str, torch.dtype], List[_Entry]]] = {}


def _inside_data_parallel_forward() -> bool:
    return _TorchDDP._get_active_ddp_module() is not None or DistributedDataParallel._active_module is not None


def _drop_unfinished_backwards() -> None:
    """Forgets the deferred gradients of backwards that raised before their end
    (their callback never ran). Called from a forward outside any backward, when
    no backward through these modules is running (one at a time per process)."""
    if torch._C._current_graph_task_id() == -1:
        _pending.clear()


def _finish_backward(task: int) -> None:
    """Task ``task``'s end-of-backward callback: one all-reduce per (group, dtype),
    then .grad = previous + sum for each parameter."""
    with torch.no_grad():
        for (group_name, _dtype), entries in _pending.pop(task).items():
            flat = torch.cat([partial.reshape(-1) for _, partial, _ in entries])
            flat = torch.ops.torch_tp.all_reduce(flat, "sum", group_name)
            offset = 0
            for param, partial, previous in entries:
                full = flat[offset: offset + partial.numel()].view_as(partial)
                offset += partial.numel()
                param.grad.copy_(full if previous is None else previous + full)


def register_replicated_grad_reduction(module: nn.Module, params: List[nn.Parameter], group_name: str) -> None:
    """Sum the gradients of ``params`` (``module``'s own) over the group
    ``group_name``: deferred to the end of the backward where NOTE [deferred
    replicated-gradient all-reduce] allows, at once otherwise."""
    module_ref = weakref.ref(module)

    def record_forward_context(_module, _inputs):
        _drop_unfinished_backwards()
        _module._tp_eager_grad_reduction = _inside_data_parallel_forward()

    module.register_forward_pre_hook(record_forward_context)

    def accumulates(param: nn.Parameter) -> bool:
        # Whether this backward runs param's AccumulateGrad. torch answers for a
        # leaf only in .backward(); under torch.autograd.grad it raises instead,
        # which is the case where the gradient is captured, not accumulated.
        try:
            return torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(param).node)
        except RuntimeError:
            return False

    def reduce_grad(param_ref: "weakref.ref[nn.Parameter]", grad: torch.Tensor) -> torch.Tensor:
        param, module = param_ref(), module_ref()
        defer = (param is not None and module is not None and not torch.is_grad_enabled()
                 and not getattr(module, "_tp_eager_grad_reduction", True) and accumulates(param))
        if not defer:
            return torch.ops.torch_tp.all_reduce(grad, "sum", group_name)
        task = torch._C._current_graph_task_id()
        if task not in _pending:  # this backward's first deferred gradient
            _pending[task] = {}
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_finish_backward, task))
        previous = None if param.grad is None else param.grad.detach().clone()
        _pending[task].setdefault((group_name, grad.dtype), []).append((param, grad, previous))
        return grad

    for param in params:
        param.register_hook(functools.partial(reduce_grad, weakref.ref(param)))
