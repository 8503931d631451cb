"""Typed Python wrappers of the ``torch.ops.torch_tp`` ops: the collectives, the sharded layers, the
vocab-parallel cross entropy and the fused RMSNorm that sequence-parallel norms run.

Every wrapper takes ``group`` as a :class:`~torch.distributed.ProcessGroup`, a
1-D :class:`~torch.distributed.device_mesh.DeviceMesh`, a group name (the string
``ProcessGroup.group_name`` returns) or ``None`` for the default group, and
calls the op with the group's name. The ops are functional (they return new
tensors), differentiable (autograd in C++) and traceable by ``torch.compile``.
"""

from typing import Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.weak import WeakIdKeyDictionary

from ._torch_private import LocalTensor, LocalTensorMode, resolve_process_group

__all__ = [
    "GroupLike",
    "all_gather",
    "all_reduce",
    "all_reduce_",
    "all_to_all_single",
    "chunk_range",
    "column_parallel_embedding",
    "column_parallel_linear",
    "copy_to_tp_region",
    "group_name",
    "moe_combine",
    "moe_dispatch",
    "moe_gated_experts",
    "moe_token_combine",
    "moe_token_dispatch",
    "reduce_from_tp_region",
    "reduce_scatter",
    "rms_norm",
    "row_parallel_linear",
    "shard",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
]

GroupLike = Optional[Union[dist.ProcessGroup, DeviceMesh, str]]

# NOTE [collectives are not dead code]
# The ops are functional: each returns a new tensor, and nothing else in a
# traced graph says that it communicates. A compiler may therefore drop a call
# whose result it can do without, and what it can do without differs between
# ranks: on a rank whose shard is empty (torch.chunk of 4 rows over 3 ranks
# gives the last one none), inductor replaces the reduce-scatter's empty
# output by a constant and drops the call, and the other ranks wait for that
# rank forever. So every op that communicates is marked as having a side
# effect, which keeps FX's and inductor's dead-code elimination off it on every
# rank (torch marks its functional collectives' wait_tensor the same way).
_COMMUNICATING_OPS = (
    "all_reduce", "all_reduce_", "all_gather", "reduce_scatter", "copy_to_tp_region", "reduce_from_tp_region",
    "column_parallel_linear", "row_parallel_linear", "vocab_parallel_embedding", "column_parallel_embedding",
    "_column_parallel_linear_forward", "_column_parallel_linear_backward", "_row_parallel_linear_backward",
    "vocab_parallel_cross_entropy", "_vocab_parallel_cross_entropy_forward",
    "all_to_all_single", "moe_dispatch", "_moe_dispatch_rows", "moe_combine", "_moe_slot_dispatch",
    "_moe_slot_dispatch_backward", "_moe_slot_combine", "_moe_slot_combine_backward",
)
for _name in _COMMUNICATING_OPS:
    torch.fx.node.has_side_effect(getattr(torch.ops.torch_tp, _name).default)


# NOTE [refused under LocalTensorMode]
# torch's LocalTensorMode simulates all ranks in one process: each op runs once
# per simulated rank on that rank's tensor, and torch's own collectives are
# mapped onto the other ranks' tensors. torch_tp's ops would run their kernels
# per rank against the fake process group, whose collectives move no data:
# wrong values, silently. Until the ops have a simulation of their own, every
# op refuses the mode (and its LocalTensor arguments) with a clear error.
def _refuse_local_tensors(_mode_or_class, func, _types, _args, _kwargs):
    raise NotImplementedError(
        f"{func}: torch's LocalTensorMode simulates the ranks in one process over a fake process group, "
        "whose collectives move no data, so torch_tp's ops would return wrong values there; run under "
        "torchrun on a real backend (gloo, nccl or torch_tp), or use torch's own tensor parallelism "
        "for LocalTensorMode")


for _name in _COMMUNICATING_OPS:
    for _mode_or_class in (LocalTensorMode, LocalTensor):
        torch.library.register_torch_dispatch(f"torch_tp::{_name}", _mode_or_class, _refuse_local_tensors)


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


def _check_tensor(op: str, arg: str, value) -> None:
    # A call whose only tensor argument is missing finds no kernel, and the
    # dispatcher's error names neither the op's argument nor what was passed.
    if not isinstance(value, torch.Tensor):
        got = "None" if value is None else type(value).__name__
        raise TypeError(f"torch_tp.ops.{op}: {arg} must be a Tensor, got {got}")


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
    _check_tensor("all_reduce", "x", x)
    return torch.ops.torch_tp.all_reduce(x, reduce_op, group_name(group))


def all_reduce_(x: torch.Tensor, reduce_op: str = "sum", group: GroupLike = None) -> torch.Tensor:
    r"""Reduce ``x`` over the ranks of ``group`` in place: :func:`all_reduce` with no new tensor.

    As ``torch.ops._c10d_functional.all_reduce_``, it is not differentiable:
    an ``x`` that requires grad is refused (use :func:`all_reduce`, or call it
    under ``torch.no_grad()``). ``torch.compile`` traces it.

    Returns:
        Tensor: ``x``, holding the reduction.
    """
    _check_tensor("all_reduce_", "x", x)
    torch.ops.torch_tp.all_reduce_(x, reduce_op, group_name(group))
    return x


def all_gather(
    x: torch.Tensor, dim: int, group: GroupLike = None, full_size: Optional[int] = None
) -> torch.Tensor:
    r"""Concatenate the ranks' ``x`` along ``dim`` in rank order.

    ``x [.., n, ..]`` on each of ``p`` ranks gives ``[.., p * n, ..]``. With
    ``full_size``, the ranks hold the ``torch.chunk`` pieces of ``full_size``
    rows (DTensor's ``Shard(dim)``, uneven when ``full_size`` is not a multiple
    of ``p``: later ranks hold fewer rows, or none), and the result has
    ``full_size`` rows.

    Args:
        x (Tensor): this rank's piece.
        dim (int): the dimension to concatenate along; negative counts from the end.
        group: the process group (see :func:`group_name`).
        full_size (int, optional): the gathered size along ``dim``; needed
            when the pieces are uneven.

    Returns:
        Tensor: a new contiguous tensor. Its gradient is the sum reduce-scatter
        of the output gradient along ``dim``.

    Example::

        >>> # on each of 2 ranks
        >>> torch_tp.ops.all_gather(torch.full((2,), float(dist.get_rank())), 0)
        tensor([0., 0., 1., 1.])
        >>> # 3 rows over 2 ranks: rank 0 holds 2, rank 1 holds 1
        >>> torch_tp.ops.all_gather(shard(torch.arange(3.0), 0), 0, full_size=3)
        tensor([0., 1., 2.])
    """
    _check_tensor("all_gather", "x", x)
    return torch.ops.torch_tp.all_gather(x, dim, group_name(group), full_size)


def reduce_scatter(
    x: torch.Tensor, dim: int, reduce_op: str = "sum", group: GroupLike = None
) -> torch.Tensor:
    r"""Reduce ``x`` over the ranks and keep this rank's ``torch.chunk`` piece along ``dim``.

    ``x [.., n, ..]`` gives rank ``r`` the reduction of the rows that
    ``torch.chunk(n, p)[r]`` covers: ``n / p`` rows when ``p`` divides ``n``;
    otherwise ``ceil(n / p)`` rows for the first ranks and fewer, or none,
    for the last ones (DTensor's ``Shard(dim)``).

    Args:
        x (Tensor): this rank's tensor; the same shape on every rank.
        dim (int): the dimension to scatter along; negative counts from the end.
        reduce_op (str): as for :func:`all_reduce`.
        group: the process group (see :func:`group_name`).

    Returns:
        Tensor: a new contiguous tensor. Its gradient is the all-gather of the
        output gradient along ``dim`` (with the local factor of
        :func:`all_reduce` for avg, min, max, product).

    Example::

        >>> # on each of 2 ranks
        >>> torch_tp.ops.reduce_scatter(torch.arange(4.0), 0)
        tensor([0., 2.])  # rank 0;  rank 1: tensor([4., 6.])
    """
    _check_tensor("reduce_scatter", "x", x)
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
    _check_tensor("copy_to_tp_region", "x", x)
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
    _check_tensor("reduce_from_tp_region", "x", x)
    return torch.ops.torch_tp.reduce_from_tp_region(x, group_name(group))


def column_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, group: GroupLike = None, *,
    gather_dim: Optional[int] = None, full_size: Optional[int] = None, activation: str = "none",
    partial_grad_input: bool = False,
) -> torch.Tensor:
    r"""Megatron's column-parallel linear: ``activation(x @ weight.T + bias)`` on this rank's output features.

    Args:
        x (Tensor): ``[.., K]``, replicated; with ``gather_dim``, this rank's
            ``torch.chunk`` piece along that dim, all-gathered first (sequence
            parallelism).
        weight (Tensor): this rank's rows ``[N_rank, K]`` (``shard(W, 0, group)``).
        bias (Tensor, optional): this rank's ``[N_rank]``.
        group: the tensor-parallel group (see :func:`group_name`).
        gather_dim (int, optional): the sequence dim of a sharded ``x``.
        full_size (int, optional): the gathered length, needed when the pieces are uneven.
        activation (str): ``"none"`` or ``"gelu_tanh"`` (fused into the GEMM's epilogue on CUDA).
        partial_grad_input (bool): leave ``x``'s gradient as this rank's partial
            sum instead of all-reducing it (for a caller that reduces it later).

    Returns:
        Tensor: ``[.., N_rank]`` (with ``gather_dim``: the full length along it).
        Backward all-reduces (or reduce-scatters) ``x``'s gradient, overlapped
        with the weight gradient's GEMM.

    Example::

        >>> h = torch_tp.ops.column_parallel_linear(x, shard(up.weight, 0, tp), shard(up.bias, 0, tp), tp)
    """
    return torch.ops.torch_tp.column_parallel_linear(
        x, weight, bias, group_name(group), gather_dim, full_size, activation, partial_grad_input)


def row_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, group: GroupLike = None, *,
    scatter_dim: Optional[int] = None,
) -> torch.Tensor:
    r"""Megatron's row-parallel linear: ``sum over ranks(x_r @ weight_r.T) + bias``.

    Args:
        x (Tensor): ``[.., K_rank]``, this rank's input features (a column-parallel layer's output).
        weight (Tensor): this rank's columns ``[N, K_rank]`` (``shard(W, 1, group)``).
        bias (Tensor, optional): the whole ``[N]``, added once after the reduction.
        group: the tensor-parallel group (see :func:`group_name`).
        scatter_dim (int, optional): reduce-scatter along this dim instead of
            all-reducing (sequence parallelism): each rank keeps its ``torch.chunk`` piece.

    Returns:
        Tensor: ``[.., N]``, the same on every rank, or this rank's piece along ``scatter_dim``.

    Example::

        >>> y = torch_tp.ops.row_parallel_linear(h, shard(down.weight, 1, tp), down.bias, tp)
    """
    return torch.ops.torch_tp.row_parallel_linear(x, weight, bias, group_name(group), scatter_dim)


def vocab_parallel_embedding(
    ids: torch.Tensor, weight: torch.Tensor, vocab_size: int, group: GroupLike = None, *,
    padding_idx: Optional[int] = None, scatter_dim: Optional[int] = None,
) -> torch.Tensor:
    r"""Embedding lookup with the vocabulary rows sharded: each rank looks up the ids it
    holds (zeros for the others), then the ranks sum.

    Args:
        ids (Tensor): integer ids ``[..]`` in ``[0, vocab_size)``, replicated.
        weight (Tensor): this rank's ``torch.chunk`` rows of the ``[vocab_size, D]`` table.
        vocab_size (int): the full vocabulary.
        group: the tensor-parallel group (see :func:`group_name`).
        padding_idx (int, optional): as for ``F.embedding``: that row gets no gradient.
        scatter_dim (int, optional): reduce-scatter along this dim instead of
            all-reducing (sequence parallelism).

    Returns:
        Tensor: ``[.., D]``, or this rank's piece along ``scatter_dim``.
    """
    return torch.ops.torch_tp.vocab_parallel_embedding(
        ids, weight, group_name(group), vocab_size, padding_idx, scatter_dim)


def column_parallel_embedding(
    ids: torch.Tensor, weight: torch.Tensor, group: GroupLike = None, *, padding_idx: Optional[int] = None,
    gather_dim: Optional[int] = None, full_size: Optional[int] = None,
) -> torch.Tensor:
    r"""Embedding lookup with the embedding dim sharded: ``[.., D_rank]`` from this rank's columns.

    Args:
        ids (Tensor): integer ids ``[..]``, replicated; with ``gather_dim``,
            this rank's piece along it, all-gathered first.
        weight (Tensor): this rank's columns ``[V, D_rank]`` (``shard(W, 1, group)``).
        group: the tensor-parallel group (see :func:`group_name`).
        padding_idx (int, optional): as for ``F.embedding``.
        gather_dim (int, optional): the sequence dim of sharded ``ids``.
        full_size (int, optional): the gathered length, needed when the pieces are uneven.

    Returns:
        Tensor: ``[.., D_rank]``; no communication for the table itself.
    """
    return torch.ops.torch_tp.column_parallel_embedding(
        ids, weight, group_name(group), padding_idx, gather_dim, full_size)


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: GroupLike, num_classes: int,
                                 weight: Optional[torch.Tensor] = None, ignore_index: int = -100,
                                 reduction: str = "mean") -> torch.Tensor:
    r"""``F.cross_entropy`` of logits sharded on the class dim, without gathering them.

    Rank ``r`` holds ``logits [.., n_r]``, its ``torch.chunk`` piece of the
    ``num_classes`` classes along the last dim (DTensor's ``Shard(-1)``);
    ``target [..]`` holds global class indices, the same on every rank. One
    all-gather forward (each row's max, sum of exp and target logit), no
    communication backward; on the CPU float32 and bfloat16 run in fused
    passes over the shard. :func:`~torch_tp.loss_parallel` runs
    ``F.cross_entropy`` on a class-sharded DTensor through it.

    Args:
        logits (Tensor): ``[.., n_r]``, floating point.
        target (Tensor): ``[..]``, int64 class indices in ``[0, num_classes)`` or ``ignore_index``.
        group: the tensor-parallel group.
        num_classes (int): ``V``, the classes of all ranks together.
        weight (Tensor, optional): ``[num_classes]``, a rescaling weight per class, as in ``F.cross_entropy``.
        ignore_index (int): a target that contributes nothing (default -100).
        reduction (str): ``"mean"`` (over the rows' weights), ``"sum"`` or ``"none"``.

    Returns:
        Tensor: the loss on every rank, in ``logits``' dtype: 0-d, or ``[..]`` for ``"none"``.
    """
    return torch.ops.torch_tp.vocab_parallel_cross_entropy(
        logits, target, group_name(group), num_classes, weight, ignore_index, reduction)


def rms_norm(input: torch.Tensor, normalized_shape: Sequence[int], weight: Optional[torch.Tensor] = None,
             eps: Optional[float] = None) -> torch.Tensor:
    r"""``torch.nn.functional.rms_norm``'s numbers, fused on the CPU (no communication).

    ``input / sqrt(mean(input^2) + eps) * weight`` over the trailing
    ``normalized_shape``; ``eps=None`` is the epsilon of the math dtype, as in
    torch. float32, float64 and bfloat16 on the CPU, with a weight of the
    input's dtype, run in one pass forward and two backward instead of
    torch's composition of ~8 ops forward and ~15 backward; anything else
    (float16, mixed dtypes, other devices, forward-mode AD) is torch's
    ``rms_norm`` itself. :class:`~torch_tp.SequenceParallel` runs an
    ``nn.RMSNorm`` through it.

    Args:
        input (Tensor): ``[.., *normalized_shape]``.
        normalized_shape (list of int): the trailing sizes normalized over.
        weight (Tensor, optional): ``normalized_shape``, multiplied in.
        eps (float, optional): added to the mean square.

    Returns:
        Tensor: the shape of ``input``.
    """
    return torch.ops.torch_tp.rms_norm(input, list(normalized_shape), weight, eps)



# The expert-parallel movements (csrc/ops/moe.cpp, NOTE [expert-parallel
# layout]) return as many rows as the exchanged counts say: a size no input
# shape gives. Such a fake kernel needs an unbacked size, which only
# torch.library.get_ctx().new_dynamic_size() makes (C++ Meta kernels have no
# way to), so these three fake kernels live here; the checks on values stay
# in the device kernels.
#
# NOTE [row counts the fake kernels know]
# A fresh unbacked size per call is not enough. moe_token_combine is a C++
# composite that dynamo records as one node: its inner moe_combine's fresh
# size is checked equal to order.size(0) and then appears in none of the
# node's outputs, which dynamo refuses (PendingUnbackedSymbolNotFound). And
# moe_combine(moe_dispatch(x)) would have a size unrelated to x's, so adding
# it to x (a residual) costs runtime asserts. But the kernels check two facts
# the fake kernels can reuse: sum(tokens_per_expert) == tokens.size(0)
# (moe_dispatch, _moe_dispatch_rows) and sum(recv_counts) == the rows
# dispatched (local_out.size(0) of moe_combine). So each fake kernel remembers,
# per count tensor (by identity, while its version is unchanged: the same
# values), how many rows it sums to, and a later movement of the same counts
# returns exactly that size: moe_combine the sender's rows (x's), and
# _moe_dispatch_rows the dispatched rows. Counts not seen in the trace (made
# outside the compiled graph, changed in place, inference tensors) get a fresh
# unbacked size. moe_token_combine is not hurt by that: it calls
# _moe_slot_combine, whose sizes all follow from its inputs (order.size(0) /
# top_k tokens), so its counts may come from outside the graph (a graph break
# between moe_token_dispatch and moe_token_combine).
_rows_of_counts = WeakIdKeyDictionary()


def _version(counts: torch.Tensor) -> Optional[int]:
    try:
        return counts._version
    except RuntimeError:  # an inference tensor keeps no version
        return None


def _remember_rows(counts: torch.Tensor, rows) -> None:
    version = _version(counts)
    if version is not None:
        _rows_of_counts[counts] = (version, rows)


def _rows(counts: torch.Tensor):
    known = _rows_of_counts.get(counts)
    if known is not None and known[0] == _version(counts):
        return known[1]
    rows = torch.library.get_ctx().new_dynamic_size()
    _remember_rows(counts, rows)
    return rows


def _moe_group_size(op: str, group: str, num_experts: int) -> int:
    size = resolve_process_group(group).size()
    if num_experts <= 0 or num_experts % size != 0:
        raise RuntimeError(f"torch_tp::{op}: the number of experts E={num_experts} must be a positive multiple "
                           f"of the group size {size}")
    return size


@torch.library.register_fake("torch_tp::moe_dispatch")
def _moe_dispatch_fake(tokens, tokens_per_expert, group, by_expert=True):
    size = _moe_group_size("moe_dispatch", group, tokens_per_expert.size(0))
    _remember_rows(tokens_per_expert, tokens.size(0))
    local = tokens_per_expert.size(0) // size
    recv_counts = tokens_per_expert.new_empty((size, local))
    rows = _rows(recv_counts)
    return (tokens.new_empty((rows, *tokens.shape[1:])), tokens_per_expert.new_empty((local,)), recv_counts)


@torch.library.register_fake("torch_tp::_moe_slot_dispatch")
def _moe_slot_dispatch_fake(hidden, order, top_k, tokens_per_expert, group):
    return _moe_dispatch_fake(hidden.new_empty((order.size(0), hidden.size(1))), tokens_per_expert, group, False)


@torch.library.register_fake("torch_tp::_moe_dispatch_rows")
def _moe_dispatch_rows_fake(tokens, tokens_per_expert, recv_counts, group, by_expert=True):
    _moe_group_size("_moe_dispatch_rows", group, tokens_per_expert.size(0))
    _remember_rows(tokens_per_expert, tokens.size(0))
    return tokens.new_empty((_rows(recv_counts), *tokens.shape[1:]))


@torch.library.register_fake("torch_tp::moe_combine")
def _moe_combine_fake(local_out, recv_counts, tokens_per_expert, group, by_expert=True):
    _moe_group_size("moe_combine", group, tokens_per_expert.size(0))
    _remember_rows(recv_counts, local_out.size(0))
    return local_out.new_empty((_rows(tokens_per_expert), *local_out.shape[1:]))


def all_to_all_single(x: torch.Tensor, output_split_sizes: Sequence[int], input_split_sizes: Sequence[int],
                      group: GroupLike = None) -> torch.Tensor:
    r"""Exchange rows of dim 0 unevenly, as ``torch.distributed.all_to_all_single`` with split sizes.

    Args:
        x (Tensor): ``[sum(input_split_sizes), ...]``; rows ``input_split_sizes[r]`` go to rank ``r``.
        output_split_sizes, input_split_sizes: one entry per rank (zeros allowed).
        group: the process group (see :func:`group_name`).

    Returns:
        Tensor: ``[sum(output_split_sizes), ...]``, rank ``s``'s rows in block ``s``.
        Its gradient is the reverse exchange (splits swapped).
    """
    _check_tensor("all_to_all_single", "x", x)
    return torch.ops.torch_tp.all_to_all_single(x, list(output_split_sizes), list(input_split_sizes),
                                                group_name(group))


def moe_dispatch(tokens: torch.Tensor, tokens_per_expert: torch.Tensor, group: GroupLike = None,
                 by_expert: bool = True) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Send expert-sorted tokens to the ranks owning their experts (torchtitan's ExpertParallel input step).

    Rank ``r`` of ``p`` owns experts ``[r*E/p, (r+1)*E/p)``. Counts are exchanged
    first (one all-to-all), then the rows; received rows are grouped by local
    expert, then source rank. Reads the counts on the host (a sync on CUDA).

    Args:
        tokens (Tensor): ``[N, H]`` this rank's rows sorted by global expert id.
        tokens_per_expert (Tensor): ``[E]`` int64, summing to ``N``; ``E % p == 0``.
        by_expert (bool): regroup the received rows by local expert (what torchtitan's grouped
            experts need); ``False`` leaves them by source rank, each source's run by local
            expert, and saves a copy of the rows each way (for experts that sort their rows).

    Returns:
        tuple: ``local_tokens [R, H]``, ``local_tokens_per_expert [E/p]``
        and ``recv_counts [p, E/p]`` (rows from each source for each local expert).
        Differentiable in ``tokens`` (the backward is :func:`moe_combine`'s movement).
    """
    _check_tensor("moe_dispatch", "tokens", tokens)
    return torch.ops.torch_tp.moe_dispatch(tokens, tokens_per_expert, group_name(group), by_expert)


def moe_combine(local_out: torch.Tensor, recv_counts: torch.Tensor, tokens_per_expert: torch.Tensor,
                group: GroupLike = None, by_expert: bool = True) -> torch.Tensor:
    r"""The inverse of :func:`moe_dispatch` (with its ``by_expert``): ``local_out [R, H']`` in its
    output order back to the senders, ``[N, H']`` in each sender's sorted order (``tokens_per_expert``:
    the sender's ``[E]`` counts, ``recv_counts``: dispatch's). Differentiable in ``local_out``."""
    _check_tensor("moe_combine", "local_out", local_out)
    return torch.ops.torch_tp.moe_combine(local_out, recv_counts, tokens_per_expert, group_name(group), by_expert)


def moe_token_dispatch(hidden: torch.Tensor, top_k_index: torch.Tensor, num_experts: int,
                       group: GroupLike = None) -> Tuple[torch.Tensor, ...]:
    r"""HF's AllToAllEP dispatch: sort the ``T*K`` (token, slot) pairs by expert, then :func:`moe_dispatch`
    with ``by_expert=False`` (NOTE [token rows by source rank] in csrc/ops/moe.cpp).

    Args:
        hidden (Tensor): ``[T, H]``.
        top_k_index (Tensor): ``[T, K]`` global expert ids in ``[0, num_experts)``, any integer dtype.

    Returns:
        tuple: ``local_tokens [R, H]``, the rows this rank's experts run on, by source rank
        and within each source's run by local expert (not regrouped by expert: HF's experts
        sort their rows themselves); ``local_expert_ids [R]`` (int64, each row's local expert
        in ``[0, E/p)``); ``order [T*K]`` (int64: the flat ``t*K+k`` of each sorted row);
        ``tokens_per_expert [E]`` and ``recv_counts [p, E/p]``: the last three are what
        :func:`moe_token_combine` takes.
        Differentiable in ``hidden`` (a token's gradient sums over its slots).
    """
    _check_tensor("moe_token_dispatch", "hidden", hidden)
    return torch.ops.torch_tp.moe_token_dispatch(hidden, top_k_index, num_experts, group_name(group))


def moe_token_combine(local_out: torch.Tensor, top_k_weights: torch.Tensor, order: torch.Tensor,
                      tokens_per_expert: torch.Tensor, recv_counts: torch.Tensor,
                      group: GroupLike = None) -> torch.Tensor:
    r"""HF's AllToAllEP combine: ``local_out [R, H']``, in :func:`moe_token_dispatch`'s row order,
    back to the senders, then each token's ``K`` rows summed weighted by ``top_k_weights [T, K]``
    -> ``[T, H']``. Differentiable in ``local_out`` and ``top_k_weights``."""
    _check_tensor("moe_token_combine", "local_out", local_out)
    return torch.ops.torch_tp.moe_token_combine(local_out, top_k_weights, order, tokens_per_expert, recv_counts,
                                                group_name(group))


def moe_gated_experts(rows: torch.Tensor, counts: torch.Tensor, gate_up_proj: torch.Tensor,
                      down_proj: torch.Tensor) -> torch.Tensor:
    r"""transformers' SiLU-gated experts on rows grouped by expert: ``rows [N, H]`` in the row-major
    (run, expert) blocks of ``counts [B, L]`` (:func:`moe_token_dispatch`'s rows with its
    ``recv_counts``; ``[L]``: one run), ``gate_up_proj [L, 2I, H]`` (``[gate | up]`` per expert) and
    ``down_proj [L, H, I]`` -> ``[N, H]``, each row ``down_e (silu(gate_e x) * up_e x)`` of its expert
    ``e``. One GEMM per expert and projection. Differentiable in ``rows`` and both weights."""
    _check_tensor("moe_gated_experts", "rows", rows)
    return torch.ops.torch_tp.moe_gated_experts(rows, counts, gate_up_proj, down_proj)

def chunk_range(n: int, world_size: int, rank: int) -> Tuple[int, int]:
    r"""The rows ``[start, start + length)`` of ``n`` that rank ``rank`` holds when
    they are split as ``torch.chunk(n, world_size)`` splits them.

    Returns:
        tuple: ``(start, length)``; ``length`` is 0 for ranks past the last piece.

    Example::

        >>> [chunk_range(10, 4, r) for r in range(4)]
        [(0, 3), (3, 3), (6, 3), (9, 1)]
    """
    chunk = -(-n // world_size)
    start = min(rank * chunk, n)
    return start, min(chunk, n - start)


def shard(full: torch.Tensor, dim: int, group: GroupLike = None) -> torch.Tensor:
    r"""This rank's ``torch.chunk`` piece of ``full`` along ``dim`` (DTensor's ``Shard(dim)``).

    Args:
        full (Tensor): the unsharded tensor, the same on every rank.
        dim (int): the dimension to split.
        group: the process group whose ranks split it (see :func:`group_name`).

    Returns:
        Tensor: a contiguous copy of this rank's rows; empty along ``dim`` for a
        rank past the last piece.

    Example::

        >>> # rank 1 of 2
        >>> shard(torch.arange(5.0), 0)
        tensor([3., 4.])
    """
    name = group_name(group)
    pg = resolve_process_group(name)
    start, length = chunk_range(full.size(dim), pg.size(), pg.rank())
    # A copy, never a view: a parameter made from it must not share storage with `full`.
    return full.narrow(dim, start, length).clone(memory_format=torch.contiguous_format)
