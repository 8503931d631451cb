"""gradcheck and gradgradcheck of a torch_tp op over all ranks at once.

torch.autograd.gradcheck perturbs one input element at a time and compares
the finite difference with the analytic gradient. Over p ranks that works when
the checked function is the same global function on every rank: its inputs
are global tensors, the same on every rank (so every rank perturbs the same
element), and so is its output. The wrappers below build such a function
around a per-rank op with the ops' own conventions (NOTE [tensor-parallel
region pair] in registration.cpp):

* ``shard_in(X, dim)``: this rank's torch.chunk piece of the global X, taken
  through copy_to_tp_region, whose backward sums every rank's gradient into
  the gradient of the one global X.
* ``stack_out(y)``: the global output when each rank's y is its own value
  (a shard, or a per-rank result): [p, *y.shape] with rank r's y in row r,
  summed over ranks by reduce_from_tp_region, whose backward hands row r's
  gradient to rank r.
* a replicated output (row_parallel_linear, reduce_from_tp_region, the vocab
  embedding) is already global and is returned as it is.

The grad_outputs are passed explicitly (seeded), so that they are the same
on every rank; gradgradcheck would otherwise draw different random ones.
"""

import torch
import torch.distributed as dist

from torch_tp import ops


def _group():
    return dist.group.WORLD.group_name


def shard_in(X, dim):
    return torch.chunk(torch.ops.torch_tp.copy_to_tp_region(X, _group()), dist.get_world_size(), dim)[dist.get_rank()]


def stack_out(y):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rows = [y if r == rank else torch.zeros_like(y) for r in range(world_size)]
    return torch.ops.torch_tp.reduce_from_tp_region(torch.stack(rows), _group())


def seeded(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def check_grad_and_gradgrad(fn, inputs, seed=100):
    """gradcheck and gradgradcheck of ``fn(*inputs)`` (global in, global out)
    with seeded grad_outputs; raises on a mismatch."""
    inputs = tuple(t.detach().clone().requires_grad_() if t.is_floating_point() else t for t in inputs)
    out = fn(*inputs)
    grad_out = seeded(out.shape, seed)
    # gradcheck's own float64 tolerances (atol 1e-5, rtol 1e-3): central
    # differences with eps 1e-6 on O(1) values; a wrong formula is off by O(1).
    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs, grad_outputs=(grad_out,))
    return True


__all__ = ["check_grad_and_gradgrad", "seeded", "shard_in", "stack_out", "ops"]
