"""Typed Python wrappers of the ``torch.ops.torch_tp`` collective ops.

Every wrapper takes ``group`` as a :class:`~torch.distributed.ProcessGroup`, a
1-D :class:`~torch.distributed.device_mesh.DeviceMesh`, a group name (the string
``ProcessGroup.group_name`` returns) or ``None`` for the default group, and
calls the op with the group's name. The ops are functional (they return new
tensors), differentiable (autograd in C++) and traceable by ``torch.compile``.
"""

from typing import Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "GroupLike",
    "all_gather",
    "all_reduce",
    "copy_to_tp_region",
    "group_name",
    "reduce_from_tp_region",
    "reduce_scatter",
]

GroupLike = Optional[Union[dist.ProcessGroup, DeviceMesh, str]]


def group_name(group: GroupLike) -> str:
    r"""Return the registered name of ``group``, the string the ops take.

    Args:
        group: a ProcessGroup, a 1-D DeviceMesh, a group name, or ``None`` for
            the default process group.

    Returns:
        str: the name under which c10d's group registry holds the group.
    """
    if isinstance(group, str):
        return group
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError("torch_tp: group=None needs torch.distributed.init_process_group() first")
        return dist.group.WORLD.group_name
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"torch_tp: group must be a 1-D DeviceMesh, got a {group.ndim}-D mesh "
                f"with dims {group.mesh_dim_names}; slice it, e.g. mesh['tp']"
            )
        return group.get_group().group_name
    if isinstance(group, dist.ProcessGroup):
        return group.group_name
    raise TypeError(
        f"torch_tp: group must be a ProcessGroup, a 1-D DeviceMesh, a group name or None, "
        f"got {type(group).__name__}"
    )


def all_reduce(x: torch.Tensor, reduce_op: str = "sum", group: GroupLike = None) -> torch.Tensor:
    r"""Reduce ``x`` over the ranks of ``group``; every rank gets the result.

    Args:
        x (Tensor): this rank's tensor; the same shape on every rank.
        reduce_op (str): ``"sum"``, ``"avg"``, ``"min"``, ``"max"`` or
            ``"product"``. ``"avg"`` needs a floating-point dtype.
        group: the process group (see :func:`group_name`).

    Returns:
        Tensor: a new contiguous tensor holding the reduction. Its gradient is
        the adjoint of the reduction: the gradients of all ranks summed (sum),
        and divided by the world size (avg), routed to the ranks holding the
        extremum (min, max, ties sharing), or multiplied by the other ranks'
        factors (product).

    Example::

        >>> # on each of 2 ranks
        >>> y = torch_tp.ops.all_reduce(torch.ones(3) * (dist.get_rank() + 1), "sum")
        >>> y
        tensor([3., 3., 3.])
    """
    return torch.ops.torch_tp.all_reduce(x, reduce_op, group_name(group))


def all_gather(x: torch.Tensor, dim: int, group: GroupLike = None) -> torch.Tensor:
    r"""Concatenate the ranks' ``x`` along ``dim`` in rank order.

    ``x [.., n, ..]`` on each of ``p`` ranks gives ``[.., p * n, ..]``.

    Args:
        x (Tensor): this rank's piece; the same shape on every rank.
        dim (int): the dimension to concatenate along; negative counts from the end.
        group: the process group (see :func:`group_name`).

    Returns:
        Tensor: a new contiguous tensor. Its gradient is the sum reduce-scatter
        of the output gradient along ``dim``.

    Example::

        >>> # on each of 2 ranks
        >>> torch_tp.ops.all_gather(torch.full((2,), float(dist.get_rank())), 0)
        tensor([0., 0., 1., 1.])
    """
    return torch.ops.torch_tp.all_gather(x, dim, group_name(group))


def reduce_scatter(
    x: torch.Tensor, dim: int, reduce_op: str = "sum", group: GroupLike = None
) -> torch.Tensor:
    r"""Reduce ``x`` over the ranks and keep this rank's piece along ``dim``.

    ``x [.., p * n, ..]`` gives rank ``r`` the reduction of rows ``r*n .. (r+1)*n``.

    Args:
        x (Tensor): this rank's tensor; the same shape on every rank, with
            ``x.size(dim)`` divisible by the world size.
        dim (int): the dimension to scatter along; negative counts from the end.
        reduce_op (str): as for :func:`all_reduce`.
        group: the process group (see :func:`group_name`).

    Returns:
        Tensor: a new contiguous tensor of ``x.size(dim) // p`` along ``dim``.
        Its gradient is the all-gather of the output gradient along ``dim``
        (with the local factor of :func:`all_reduce` for avg, min, max, product).

    Example::

        >>> # on each of 2 ranks
        >>> torch_tp.ops.reduce_scatter(torch.arange(4.0), 0)
        tensor([0., 2.])  # rank 0;  rank 1: tensor([4., 6.])
    """
    return torch.ops.torch_tp.reduce_scatter(x, dim, reduce_op, group_name(group))


def copy_to_tp_region(x: torch.Tensor, group: GroupLike = None) -> torch.Tensor:
    r"""Enter a tensor-parallel region: identity forward, sum all-reduce backward.

    Megatron's ``f``: put it before a column-parallel layer that reads a
    replicated input, whose gradient is a partial sum on each rank.

    Args:
        x (Tensor): the replicated input.
        group: the tensor-parallel group (see :func:`group_name`).

    Returns:
        Tensor: a copy of ``x``.

    Example::

        >>> x = torch_tp.ops.copy_to_tp_region(x, tp_group)
        >>> h = x @ w_column_shard.t()
    """
    return torch.ops.torch_tp.copy_to_tp_region(x, group_name(group))


def reduce_from_tp_region(x: torch.Tensor, group: GroupLike = None) -> torch.Tensor:
    r"""Leave a tensor-parallel region: sum all-reduce forward, identity backward.

    Megatron's ``g``, the adjoint of :func:`copy_to_tp_region`: put it after a
    row-parallel layer whose output is a partial sum on each rank.

    Args:
        x (Tensor): this rank's partial sum.
        group: the tensor-parallel group (see :func:`group_name`).

    Returns:
        Tensor: the sum over the ranks.

    Example::

        >>> y = torch_tp.ops.reduce_from_tp_region(h @ w_row_shard.t(), tp_group)
    """
    return torch.ops.torch_tp.reduce_from_tp_region(x, group_name(group))
