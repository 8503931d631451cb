"""Key/value projections with fewer heads than ranks (MQA, GQA at a high TP degree).

NOTE [fewer KV heads than ranks]
ColwiseParallel splits a linear's output rows evenly over the ranks. For ``wq``
that gives each rank ``n_heads / p`` whole query heads; for ``wk``/``wv`` with
``n_kv`` key/value heads and ``n_kv < p`` it would split single heads, and the
attention's ``view(b, s, -1, head_dim)`` fails. Rank ``r``'s query heads are
``[r * n_heads / p, (r + 1) * n_heads / p)``; query head ``j`` reads KV head
``j // (n_heads / n_kv)``, so when ``p % n_kv == 0`` all of rank ``r``'s query
heads read the one KV head ``h = r // (p / n_kv)``, which ``p / n_kv``
consecutive ranks share. Each rank computes that head only:

    x [b, s, d] @ W[h * hd : (h + 1) * hd, :]^T -> [b, s, hd]        (one KV head)

and the attention repeats it over its ``n_heads / p`` local query heads
(``n_rep = local q heads / local kv heads``, read from the shapes).

Gradients. Rank ``r``'s attention gives the gradient of head ``h`` for its own
query heads only; the head's true gradient is the sum over the ranks that
share it. The column-parallel backward already sums ``grad_x`` over the group
(each rank's ``dK_r @ W_h`` is one term of ``dK @ W``). The weight gradient of
rank ``r`` is nonzero only in head ``h``'s rows, so its sum over the whole
group is exactly the sum over the ranks sharing each head (the others add
zeros): it is declared ``Partial()`` and completed with the one end-of-backward
all-reduce SequenceParallel's norms use (NOTE [partial gradients of
sequence-parallel parameters] in ``_replicated_grad.py``).

Layout. The weight and bias are ``Replicate()`` DTensors: every rank keeps all
``n_kv`` heads and computes with its own head's rows (a view). That is the
honest DTensor for "each head on the ranks that share it" on the 1-D TP mesh,
so state dicts and DCP see the full k/v weights and reshard to any TP degree,
and ``clip_grad_norm_``, optimizers and FSDP2 work unchanged. The placement
that holds exactly one head per rank, ``(Shard(0), Replicate())`` on the TP
mesh unflattened to ``(n_kv, p / n_kv)``, puts these parameters on another mesh
than the rest, and torch's ``clip_grad_norm_`` refuses to stack norms from two
meshes ("All operands in aten.stack.default must have the same mesh"). Keeping
all heads costs ``n_kv - 1`` heads' rows per rank (none for MQA), small beside
a rank's ``n_heads / p`` query heads.

When ``n_kv`` is a multiple of ``p`` the style is ColwiseParallel.
"""

from dataclasses import dataclass
from typing import Optional

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from ._install import install
from ._params import local_tensor, module_path
from .style import ColwiseLinear, ColwiseParallel, ParallelStyle, ShardedState

__all__ = ["KVHeadColwiseParallel"]


@dataclass(eq=False)
class KVHeadState(ShardedState):
    """A KVHeadColwiseParallel ``nn.Linear`` whose heads are replicated over ranks."""

    rows: slice  # this rank's head's rows of the (replicated) weight and bias


class _KVHeadColwiseLinear(ColwiseLinear):
    _tp_kind = "KVHeadColwiseParallel"
    _tp_state: KVHeadState

    def forward(self, x):
        """x (replicated, or Shard(d) to gather) -> [..., head_dim]: this rank's KV head."""
        rows = self._tp_state.rows
        weight = local_tensor(self.weight, partial_grad=True)[rows]
        bias = None if self.bias is None else local_tensor(self.bias, partial_grad=True)[rows]
        return self._tp_linear(x, weight, bias)


class KVHeadColwiseParallel(ParallelStyle):
    r"""Partition the key or value projection (``nn.Linear``) of an attention with
    ``num_kv_heads`` key/value heads by whole heads, also when there are fewer
    heads than ranks.

    With ``num_kv_heads`` a multiple of the TP degree ``p`` this is
    :class:`ColwiseParallel` (each rank ``num_kv_heads / p`` heads). With ``p``
    a multiple of ``num_kv_heads`` (MQA, or GQA at a high TP degree) each head
    is replicated over the ``p / num_kv_heads`` consecutive ranks whose query
    heads read it: rank ``r`` computes head ``r // (p / num_kv_heads)``, and its
    gradients are summed over the ranks that share it. The weight and bias are
    then ``Replicate()`` DTensors holding every head, so state dicts and DCP
    see the full projection and reshard to any TP degree (NOTE [fewer KV heads
    than ranks] in ``kv_heads.py``). The output is always this rank's local
    heads, as ``ColwiseParallel()``'s: an attention must read its head counts
    from the shapes (``view(b, s, -1, head_dim)``, ``n_rep = q heads // kv
    heads``); for Hugging Face attentions ``parallelize_module`` adjusts
    ``num_key_value_groups`` itself.

    Args:
        num_kv_heads (int): the projection's heads; its ``out_features`` must
            be a multiple of it.

    Keyword Args:
        input_layouts (Placement, optional): layout of the module input;
            ``Replicate()`` by default (``Shard(d)`` is gathered first).

    Returns:
        A :class:`ParallelStyle` for :func:`parallelize_module`.

    Example::

        >>> from torch_tp import parallelize_module, ColwiseParallel, KVHeadColwiseParallel
        >>> plan = {"attention.wq": ColwiseParallel(), "attention.wk": KVHeadColwiseParallel(1),
        ...         "attention.wv": KVHeadColwiseParallel(1), "attention.wo": RowwiseParallel()}
        >>> m = parallelize_module(Model(), tp_mesh, plan)
    """

    def __init__(self, num_kv_heads: int, *, input_layouts: Optional[Placement] = None):
        super().__init__()
        if not isinstance(num_kv_heads, int) or num_kv_heads < 1:
            raise ValueError(f"torch_tp.KVHeadColwiseParallel: num_kv_heads must be a positive int, got "
                             f"{num_kv_heads!r}")
        self.num_kv_heads = num_kv_heads
        self.input_layouts = (input_layouts or Replicate(),)
        self.desired_input_layouts = (Replicate(),)  # as ColwiseParallel's

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        ranks, heads = device_mesh.size(), self.num_kv_heads
        where = f"module '{module_path()}'" if module_path() else "the root module"
        if type(module).forward is not nn.Linear.forward:
            raise NotImplementedError(f"torch_tp.KVHeadColwiseParallel: {where} is a {type(module).__name__}; "
                                      "the style applies to nn.Linear (and subclasses keeping its forward)")
        if module.out_features % heads:
            raise ValueError(f"torch_tp.KVHeadColwiseParallel: {where} has out_features={module.out_features}, "
                             f"which is not num_kv_heads={heads} whole heads")
        if heads % ranks == 0:
            colwise = ColwiseParallel(input_layouts=self.input_layouts[0])
            colwise.src_data_rank = self.src_data_rank
            colwise._apply(module, device_mesh)
            module._tp_state.style = repr(self)
            return module
        if ranks % heads:
            raise ValueError(f"torch_tp.KVHeadColwiseParallel: {where} has {heads} KV heads and the TP group "
                             f"{ranks} ranks; the heads must divide the ranks or the ranks the heads, so that "
                             "each rank's query heads read whole KV heads")
        head_dim = module.out_features // heads
        head = device_mesh.get_local_rank() // (ranks // heads)
        install(module, device_mesh, self, {"weight": Replicate(), "bias": Replicate()}, _KVHeadColwiseLinear,
                KVHeadState, self.input_layouts[0], Shard(-1), True, slice(head * head_dim, (head + 1) * head_dim),
                partial_grads=True)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.num_kv_heads}, input_layouts={self.input_layouts})"
