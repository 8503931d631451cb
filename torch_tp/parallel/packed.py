"""Block-wise sharding of packed (fused) ``nn.Linear`` weights: ``qkv_proj``, ``gate_up_proj``.

A fused projection stacks several blocks along one dim of its weight: rows
``[q | k | v]`` (GQA: ``q = n_heads * head_dim``, ``k = v = n_kv_heads * head_dim``)
or ``[gate | up]``. Plain ``ColwiseParallel`` would give rank 0 all of ``q``
and rank 1 ``k`` and ``v``. The styles here split every block over the ranks
as ``torch.chunk`` does and give rank ``r`` the concatenation of its chunks,
in block order::

    weight [q | k | v]  (out = q + k + v rows)  ->  rank r: [q_r | k_r | v_r]  (out / p rows)

so each rank computes its own heads (or its own columns of ``gate`` and
``up``) with no collective in the forward, exactly as ColwiseParallel does on
those local rows. :class:`PackedRowwiseParallel` is the same for a weight
whose input features are packed (dim 1).

NOTE [packed parameters]
A DTensor placement cannot say "chunk r of every block": DCP only stores
contiguous chunks, and a 2-D sub-mesh that would describe it gives
parameters of mixed meshes, on which torch's ``clip_grad_norm_`` fails. So a
packed parameter is an ordinary ``nn.Parameter(DTensor)`` with ``Shard(0)``
(``Shard(1)`` for the rowwise style) on the TP mesh and the module's own
global shape ``(out_features, in_features)``, whose local tensor on rank
``r`` is ``[block_0 chunk r | block_1 chunk r | ...]``. Its global rows
(``full_tensor()``) are therefore in a *rank-major* order, a permutation of
the natural one::

    natural     [q_0 q_1 | k_0 k_1 | v_0 v_1]      (p = 2)
    rank-major  [q_0 k_0 v_0 | q_1 k_1 v_1]        = Shard(0) chunks [rank 0 | rank 1]

Elementwise math, norms, optimizers, ``clip_grad_norm_`` and FSDP2 (which
shards the global tensor whatever its order) are indifferent to a permutation
of rows, so they just work. Only what reads the *layout* must see the natural
order, and that is state dicts:

- ``module.state_dict()`` (a post hook) hands back each packed parameter as
  the DTensor ``distribute_tensor(natural, mesh, placements)`` would give:
  the same mesh and placements, natural order. That costs one all-gather of
  the parameter per ``state_dict()`` call (``full_tensor()``, reorder, cut
  this rank's piece locally); its values are new tensors, not the
  parameter, even with ``keep_vars=True``. So DCP, ``get_state_dict`` and
  :func:`~torch_tp.get_full_state_dict` see the unsharded model's layout,
  and a checkpoint reshards to any TP degree, to torch's own TP (whose
  ``ColwiseParallel`` shards the natural rows) and to the unsharded model.
  A ``dcp.load`` fills those new tensors, so it must be followed by
  ``model.load_state_dict`` (or ``set_state_dict``), as DCP's own examples do.
- ``module.load_state_dict`` (a pre hook) takes a natural-order value, a full
  tensor (cut locally, no communication) or a DTensor of any placement on the
  mesh (gathered), and hands the default loader the rank-major DTensor with
  the parameter's spec.
- Optimizer states shaped like the parameter (``exp_avg``, ``exp_avg_sq``)
  are rank-major too, and ``get_optimizer_state_dict`` and DCP would store
  them as natural ``Shard(0)`` rows: loaded at another TP degree they would
  be silently scrambled. So a global optimizer step pre hook (registered once
  per process, when a packed style is first applied) gives every optimizer
  that holds a packed parameter, at its first ``step()``, a ``state_dict``
  post hook (states to the natural order, one all-gather each) and a
  ``load_state_dict`` pre hook (back to rank-major).
  ``get_optimizer_state_dict``/``set_optimizer_state_dict`` step a fresh
  optimizer before reading or writing its state (``_init_optim_state``), so
  the hooks are in place when they run. An optimizer whose
  ``load_state_dict`` runs before its first ``step()`` with no hooks yet
  (``optimizer.load_state_dict(torch.load(...))`` on a fresh optimizer, or
  ``set_optimizer_state_dict`` while the parameters hold gradients, when it
  does not step) holds natural-order states: every optimizer state dict with
  a packed parameter's states comes out of the post hook. The step pre hook
  converts those to rank-major on first sight, before the optimizer reads
  them. What it cannot tell apart is an optimizer *object* restored with
  its rank-major states by pickling or ``copy.deepcopy`` (which drop the
  hooks): its first step would reorder them again. Save and load optimizers
  through their state dicts. The check runs once per optimizer, at its
  first step: a packed parameter added later with ``add_param_group`` to an
  optimizer that held none is not seen.

The packed parameters are found through the packed modules (a weak set),
reading each module's current parameters rather than a registry of
parameter objects, so a parameter that is replaced later (``fully_shard``,
``to_empty``, a deep copy or unpickling of the model) is still known. Under
FSDP2 x TP the parameter is a 2-D DTensor (``_StridedShard`` over dp,
``Shard`` over tp) of the same rank-major global tensor; the conversions
above run on it unchanged (``full_tensor()`` over the whole mesh, then
``distribute_tensor`` with its placements), so its state dicts keep its
placements in the natural order. A packed module's output features are in the per-rank order
``[q_r | k_r | v_r]``: a ``Replicate`` or DTensor view of it would not be
the unsharded output's order, so PackedColwiseParallel hands back only the
local tensor (``output_layouts=Shard(-1)``, ``use_local_output=True``), and
the module that consumes it must split it with local sizes (see the
example), never gather it.
"""

import weakref
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ._install import refuse_second_style
from ._params import local_tensor, module_path
from .style import ColwiseLinear, RowwiseLinear, ShardedModuleStyle, ShardedState

__all__ = ["PackedColwiseParallel", "PackedRowwiseParallel"]


# ---------------------------------------------------------------- the block layout


@dataclass(frozen=True)
class PackedLayout:
    """How one packed parameter's ``dim`` is split: ``blocks`` (natural sizes, in order)
    over ``degree`` ranks, each block in equal ``torch.chunk`` pieces."""

    blocks: Tuple[int, ...]
    dim: int
    degree: int

    def rank_major_index(self, device: torch.device) -> torch.Tensor:
        """For each rank-major position along ``dim``, the natural index it holds:
        ``rank_major = natural.index_select(dim, index)``."""
        pieces = []
        for rank in range(self.degree):
            start = 0
            for size in self.blocks:
                chunk = size // self.degree
                pieces.append(torch.arange(start + rank * chunk, start + (rank + 1) * chunk))
                start += size
        return torch.cat(pieces).to(device)

    def to_natural(self, value: DTensor) -> DTensor:
        """A rank-major DTensor -> the same mesh and placements, natural order (one all-gather)."""
        with torch.no_grad():
            full = value.detach().full_tensor()
            natural = full.index_select(self.dim, self.rank_major_index(full.device).argsort())
            return distribute_tensor(natural, value.device_mesh, value.placements, src_data_rank=None)

    def to_rank_major(self, value: torch.Tensor, like: DTensor) -> DTensor:
        """A natural-order full tensor or DTensor -> a DTensor with ``like``'s spec, rank-major
        (a DTensor value is gathered first; a full tensor is only cut, locally)."""
        with torch.no_grad():
            full = value.detach()
            if isinstance(full, DTensor):
                full = full.full_tensor()
            full = full.to(like.device)
            rank_major = full.index_select(self.dim, self.rank_major_index(full.device))
            return distribute_tensor(rank_major, like.device_mesh, like.placements, src_data_rank=None)


@dataclass(eq=False)
class PackedState(ShardedState):
    """A PackedColwiseParallel or PackedRowwiseParallel ``nn.Linear``: a ShardedState and the
    layout of each packed parameter, by name."""

    layouts: Dict[str, PackedLayout]
    # With KV heads shared by several ranks (NOTE [a packed qkv with fewer KV heads than ranks]):
    # (local query rows, ranks per KV head, this rank's KV head); None otherwise.
    shared_kv: Optional[Tuple[int, int, int]] = None


# The modules a packed style was applied to: their current parameters are the packed ones.
_PACKED_MODULES: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def packed_parameters() -> Dict[int, Tuple[torch.Tensor, PackedLayout]]:
    """id(parameter) -> (parameter, layout), for every live packed module."""
    found = {}
    for module in list(_PACKED_MODULES):
        for name, layout in module._tp_state.layouts.items():
            param = module._parameters.get(name)
            if isinstance(param, DTensor):
                found[id(param)] = (param, layout)
    return found


# ---------------------------------------------------------------- module state dicts (NOTE [packed parameters])


def _natural_state_dict(module: nn.Module, state_dict, prefix: str, _local_metadata) -> None:
    """State-dict post hook: each packed parameter in the natural order."""
    for name, layout in module._tp_state.layouts.items():
        value = state_dict.get(prefix + name)
        if isinstance(value, DTensor):
            state_dict[prefix + name] = layout.to_natural(value)


def _rank_major_load(module: nn.Module, state_dict, prefix: str, *_args) -> None:
    """Load-state-dict pre hook: a natural-order value of a packed parameter's global shape
    becomes the rank-major DTensor the default loader copies into the parameter (another
    shape is left for the loader's own size-mismatch error)."""
    for name, layout in module._tp_state.layouts.items():
        param = module._parameters.get(name)
        value = state_dict.get(prefix + name)
        if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.shape == param.shape:
            state_dict[prefix + name] = layout.to_rank_major(value, param)


# ---------------------------------------------------------------- optimizer state dicts (NOTE [packed parameters])


def _saved_to_parameter(optimizer: torch.optim.Optimizer, state_dict) -> Dict:
    """The key of each parameter in ``state_dict["state"]`` -> the optimizer's parameter, paired
    as ``Optimizer.load_state_dict`` pairs them: group by group, in order (the keys are
    indices, or FQNs in what ``set_optimizer_state_dict`` hands over)."""
    return {key: param
            for saved, group in zip(state_dict["param_groups"], optimizer.param_groups)
            for key, param in zip(saved["params"], group["params"])}


def _convert_optimizer_states(optimizer: torch.optim.Optimizer, state_dict, to_natural: bool):
    """A copy of ``state_dict`` whose states of packed parameters shaped like the parameter
    (``exp_avg``, not ``step``) are reordered; the states the optimizer holds are not touched."""
    packed = packed_parameters()
    states = dict(state_dict["state"])
    for key, param in _saved_to_parameter(optimizer, state_dict).items():
        found = packed.get(id(param))
        if found is None or key not in states:
            continue
        layout = found[1]
        converted = {}
        for name, value in states[key].items():
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                if to_natural:
                    value = layout.to_natural(value) if isinstance(value, DTensor) else value
                else:
                    value = layout.to_rank_major(value, param)
            converted[name] = value
        states[key] = converted
    return {**state_dict, "state": states}


def _natural_optimizer_state(optimizer: torch.optim.Optimizer, state_dict):
    return _convert_optimizer_states(optimizer, state_dict, to_natural=True)


def _rank_major_optimizer_load(optimizer: torch.optim.Optimizer, state_dict):
    return _convert_optimizer_states(optimizer, state_dict, to_natural=False)


def _hook_optimizer(optimizer: torch.optim.Optimizer, _args, _kwargs) -> None:
    """Global step pre hook: at an optimizer's first step, if it holds a packed parameter, give
    it the state-dict hooks, and reorder the states a hook-less ``load_state_dict`` left in the
    natural order. Every later step costs one dict lookup."""
    if optimizer.__dict__.get("_tp_packed_checked"):
        return
    optimizer._tp_packed_checked = True
    packed = packed_parameters()
    params = [p for group in optimizer.param_groups for p in group["params"] if id(p) in packed]
    if not params:
        return
    optimizer.register_state_dict_post_hook(_natural_optimizer_state)
    optimizer.register_load_state_dict_pre_hook(_rank_major_optimizer_load)
    for param in params:
        state = optimizer.state.get(param)
        if not state:
            continue
        layout = packed[id(param)][1]
        for name, value in list(state.items()):
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                state[name] = layout.to_rank_major(value, param)


_OPTIMIZER_HOOK = None


def _hook_optimizers_once() -> None:
    global _OPTIMIZER_HOOK
    if _OPTIMIZER_HOOK is None:
        _OPTIMIZER_HOOK = register_optimizer_step_pre_hook(_hook_optimizer)


def keep_packed_order_in_state_dicts(module: nn.Module) -> None:
    """Give ``module`` (whose ``_tp_state.layouts`` names its rank-major parameters) the state-dict
    hooks of NOTE [packed parameters], for itself and for the optimizers that hold its parameters."""
    module.register_state_dict_post_hook(_natural_state_dict)
    module.register_load_state_dict_pre_hook(_rank_major_load)
    _PACKED_MODULES.add(module)
    _hook_optimizers_once()


# ---------------------------------------------------------------- the classes the styles swap in


class PackedModule:
    """What every module with packed parameters adds to its ShardedModule (the packed linears here,
    the experts of moe.py): the blocks in the repr, and the module back in the registry of packed
    modules when it is unpickled or deep-copied."""

    _tp_state: PackedState

    def extra_repr(self) -> str:
        blocks = next(iter(self._tp_state.layouts.values())).blocks
        return f"{super().extra_repr()}, blocks={blocks}"

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        _PACKED_MODULES.add(self)


class _PackedColwiseLinear(PackedModule, ColwiseLinear):
    _tp_kind = "PackedColwiseParallel"


# NOTE [a packed qkv with fewer KV heads than ranks]
# A fused [q | k | v] with n_kv KV heads of hd rows, at a TP degree p that is a
# multiple of n_kv (MQA, or GQA at a high degree): rank r's query heads all
# read KV head h = r // m, which the m = p / n_kv ranks [h m, (h + 1) m) share
# (NOTE [fewer KV heads than ranks] in kv_heads.py). The parameters are stored
# exactly as for any packed blocks: rank r holds [q_r | k_r | v_r], each chunk
# r of its block, where k_r and v_r (hd / m rows) are the r % m-th piece of
# head h. So state dicts, DCP, optimizers and FSDP2 see the packed layout
# they know, at any degree. The forward first puts head h together:
#
#     [k_r | v_r]  --all_gather(dim 0)-->  [k_0 | v_0 | k_1 | v_1 | ...]   (p pieces)
#     k_h = [k_(hm) | ... | k_(hm+m-1)],  v_h likewise                     (hd rows each)
#     x @ [q_r | k_h | v_h]^T  ->  [.., q / p + 2 hd]
#
# and the all-gather's backward reduce-scatters the rows' gradients, which sums
# each piece's gradient over the ranks whose query heads read it (the others
# contribute zeros): every rank's gradient is complete for its own chunk, as
# for any Shard(0) parameter. The gather moves 2 n_kv hd rows of the weight,
# far fewer than the rank's query rows the GEMM reads. Like vLLM's
# QKVParallelLinear, each rank computes one KV head; unlike it, no rank stores
# a head another rank also stores.


def _head_rows(piece: torch.Tensor, state: PackedState) -> torch.Tensor:
    """This rank's weight (or bias) piece [q_r | k_r | v_r] -> [q_r | k_h | v_h] (NOTE [a packed qkv with
    fewer KV heads than ranks])."""
    q_rows, per_head, head = state.shared_kv
    ranks = state.group.size
    kv = torch.ops.torch_tp.all_gather(piece[q_rows:], 0, state.group.name, None)  # [p * 2 hd / m, ..]
    kv = kv.view(ranks, 2, -1, *piece.shape[1:])[head * per_head:(head + 1) * per_head]  # [m, (k, v), hd / m, ..]
    k, v = (kv[:, i].reshape(-1, *piece.shape[1:]) for i in (0, 1))
    return torch.cat([piece[:q_rows], k, v])


class _PackedSharedKVLinear(PackedModule, ColwiseLinear):
    _tp_kind = "PackedColwiseParallel"

    def forward(self, x):
        """x (replicated, or Shard(d) to gather) -> [.., q / p + 2 head_dim]: this rank's query heads and
        its one KV head."""
        weight = _head_rows(local_tensor(self.weight), self._tp_state)
        bias = None if self.bias is None else _head_rows(local_tensor(self.bias), self._tp_state)
        return self._tp_linear(x, weight, bias)


class _PackedRowwiseLinear(PackedModule, RowwiseLinear):
    _tp_kind = "PackedRowwiseParallel"

    def forward(self, x):
        if isinstance(x, DTensor):
            # Its global features would be in the natural order, its local ones a natural chunk.
            raise TypeError(f"torch_tp: {type(self).__name__} takes the local tensor of the packed input "
                            f"([block_0 chunk r | block_1 chunk r | ...]), not a DTensor ({x.placements})")
        return super().forward(x)


# ---------------------------------------------------------------- the styles


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _where() -> str:
    return f"'{module_path()}'" if module_path() else "the root module"


class _PackedStyle(ShardedModuleStyle):
    """What both packed styles share: check the blocks, put the packed dim of the module's
    plain parameters in the rank-major order, let ``ShardedModuleStyle`` distribute them
    (``Shard`` pieces of the permuted tensor are the per-rank ``[block chunks]``) and swap
    the class, then add the state-dict hooks (NOTE [packed parameters])."""

    _packed: Dict[str, int]  # the packed parameters: name -> packed dim
    _features: str  # the nn.Linear attribute the blocks add up to

    def __init__(self, blocks: Union[int, Sequence[int]], *, input_layouts: Optional[Placement] = None,
                 output_layouts: Optional[Placement] = None, use_local_output: bool = True):
        name = type(self).__name__
        if _is_int(blocks):
            values: Tuple[int, ...] = (blocks,)
        elif isinstance(blocks, Sequence) and all(_is_int(b) for b in blocks):
            values = tuple(blocks)
        else:
            raise TypeError(f"torch_tp.{name}: blocks must be an int (that many equal blocks) or a sequence of "
                            f"ints (the blocks' sizes), got {blocks!r}")
        if not values or any(b <= 0 for b in values):
            raise ValueError(f"torch_tp.{name}: blocks must be positive, got {blocks!r}")
        self.blocks = blocks if _is_int(blocks) else values
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output)

    def _block_sizes(self, module: nn.Linear, degree: int) -> Tuple[int, ...]:
        name, features = type(self).__name__, getattr(module, self._features)
        where = f"{_where()} ({type(module).__name__}, {self._features}={features})"
        if isinstance(self.blocks, int):
            if features % self.blocks:
                raise ValueError(f"torch_tp.{name}: {where} does not split into blocks={self.blocks} equal blocks")
            sizes = (features // self.blocks,) * self.blocks
        else:
            sizes = self.blocks
            if sum(sizes) != features:
                raise ValueError(f"torch_tp.{name}: blocks={sizes} of {where} add up to {sum(sizes)}, "
                                 f"not {features}")
        uneven = [size for size in sizes if size % degree]
        if uneven:
            raise ValueError(f"torch_tp.{name}: blocks {sizes} of {where} must each divide evenly over the "
                             f"{degree} ranks (each rank's rows are then one Shard piece); {uneven} do not")
        return sizes

    def _shared_kv(self, module: nn.Module, device_mesh: DeviceMesh, sizes: Tuple[int, ...]):
        """PackedState.shared_kv: None but for a PackedColwiseParallel with fewer KV heads than ranks."""
        return None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = type(self).__name__
        if not isinstance(module, nn.Linear):
            raise NotImplementedError(f"torch_tp.{name} applies to nn.Linear; {_where()} is a "
                                      f"{type(module).__name__}")
        refuse_second_style(module, self)
        if type(module).forward is not nn.Linear.forward:
            raise NotImplementedError(f"torch_tp.{name}: {_where()} ({type(module).__name__}) has a forward of its "
                                      "own; packed sharding needs nn.Linear's (torch has no packed style to run it)")
        sizes = self._block_sizes(module, device_mesh.size())
        params = {n: module._parameters[n] for n in self._packed if module._parameters.get(n) is not None}
        for param_name, param in params.items():
            if isinstance(param, DTensor):
                raise ValueError(f"torch_tp.{name}: parameter '{param_name}' of {_where()} is already a DTensor "
                                 f"({param.placements} on {param.device_mesh}); {name} distributes the plain one")
        # weight [out, in] (rowwise: its columns): the packed dim permuted to the rank-major
        # order, whose Shard chunk r (out / p rows, every block dividing by p) is
        # [block_0 chunk r | block_1 chunk r | ...]; distribute_tensor then cuts exactly that.
        layouts = {}
        for param_name, param in params.items():
            dim = self._packed[param_name]
            layout = layouts[param_name] = PackedLayout(sizes, dim, device_mesh.size())
            with torch.no_grad():
                rank_major = param.index_select(dim, layout.rank_major_index(param.device))
            module._parameters[param_name] = nn.Parameter(rank_major, requires_grad=param.requires_grad)
        shared_kv = self._shared_kv(module, device_mesh, sizes)
        self._install(module, device_mesh, PackedState, layouts, shared_kv,
                      mixin=None if shared_kv is None else _PackedSharedKVLinear)
        keep_packed_order_in_state_dicts(module)
        return module

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.blocks!r}, input_layouts={self.input_layouts}, "
                f"output_layouts={self.output_layouts}, use_local_output={self.use_local_output})")


class PackedColwiseParallel(_PackedStyle):
    r"""Partition a packed (fused) ``nn.Linear`` column-wise, block by block.

    The weight's rows (output features) are ``blocks`` stacked in order, such
    as ``[q | k | v]`` or ``[gate | up]``. Each block is split over the ranks as
    ``torch.chunk`` splits it, and rank ``r`` holds ``[block_0 chunk r |
    block_1 chunk r | ...]`` of the weight and of the bias, so it computes its
    own heads (or columns) with no collective in the forward; the backward
    all-reduces the input's gradient, as :class:`ColwiseParallel`'s does. The
    parameters become ``Shard(0)`` DTensors of the module's global shape whose
    rows are in a rank-major order, and ``state_dict``/``load_state_dict`` of
    the module and of optimizers see the natural order (NOTE [packed
    parameters] in ``torch_tp/parallel/packed.py``).

    The output is the local tensor ``[.., out_features / p]`` with the
    features in the order ``[block_0 chunk r | block_1 chunk r | ...]``: the
    module that consumes it splits it with local sizes, from its shape.

    Args:
        blocks (int or Sequence[int]): ``n`` for ``n`` equal blocks, or the
            blocks' sizes (they add up to ``out_features``). Each block must
            divide evenly by the TP degree.

    Keyword Args:
        num_kv_heads (int, optional): for ``blocks=[q, k, v]`` of an
            attention, the heads of ``k`` and of ``v``. With fewer heads than
            ranks (the TP degree a multiple of it), each rank computes the one
            KV head its query heads read, and its output is ``[.., q / p +
            2 head_dim]``; the parameters are stored as without it (NOTE [a
            packed qkv with fewer KV heads than ranks] in
            ``torch_tp/parallel/packed.py``).
        input_layouts (Placement, optional): layout of the module input;
            ``Replicate()`` by default (``Shard(d)``: gathered along ``d``
            first, for sequence parallelism).
        output_layouts (Placement, optional): ``Shard(-1)`` only (the
            default): the per-rank feature order has no DTensor layout.
        use_local_output (bool, optional): ``True`` only (the default), for
            the same reason.

    Returns:
        A :class:`ParallelStyle` for :func:`parallelize_module`.

    Example::

        >>> from torch_tp import parallelize_module, PackedColwiseParallel, RowwiseParallel
        >>> # qkv_proj: 8 query heads, 2 KV heads of 64: rows [q 512 | k 128 | v 128]
        >>> plan = {"attn.qkv_proj": PackedColwiseParallel([512, 128, 128]), "attn.o_proj": RowwiseParallel(),
        ...         "mlp.gate_up_proj": PackedColwiseParallel(2), "mlp.down_proj": RowwiseParallel()}
        >>> m = parallelize_module(Model(), tp_mesh, plan)
        >>> # in the attention: q, k, v = qkv.split([local_q, local_kv, local_kv], -1), sizes from qkv.size(-1)
    """

    _layouts = {nn.Linear: ({"weight": Shard(0), "bias": Shard(0)}, _PackedColwiseLinear)}
    _default_input_layout = Replicate()
    _default_output_layout = Shard(-1)
    desired_input_layouts = (Replicate(),)
    _packed = {"weight": 0, "bias": 0}
    _features = "out_features"

    def __init__(self, blocks: Union[int, Sequence[int]], *, num_kv_heads: Optional[int] = None,
                 input_layouts: Optional[Placement] = None, output_layouts: Optional[Placement] = None,
                 use_local_output: bool = True):
        super().__init__(blocks, input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output)
        if num_kv_heads is not None:
            if not _is_int(num_kv_heads) or num_kv_heads < 1:
                raise ValueError(f"torch_tp.PackedColwiseParallel: num_kv_heads must be a positive int, got "
                                 f"{num_kv_heads!r}")
            if isinstance(self.blocks, int) or len(self.blocks) != 3 or self.blocks[1] != self.blocks[2] \
                    or self.blocks[1] % num_kv_heads:
                raise ValueError(f"torch_tp.PackedColwiseParallel: num_kv_heads={num_kv_heads} needs the blocks "
                                 f"[q, k, v] of an attention, k and v equal and whole heads; got {self.blocks!r}")
        self.num_kv_heads = num_kv_heads
        why = ("its output's features are in the per-rank order [block_0 chunk r | block_1 chunk r | ...], "
               "which a gathered or DTensor output would present as the unsharded output's order")
        if self.output_layouts[0] != Shard(-1):
            raise ValueError(f"torch_tp.PackedColwiseParallel: output_layouts={self.output_layouts[0]!r} is not "
                             f"supported, only Shard(-1): {why}")
        if not use_local_output:
            raise ValueError(f"torch_tp.PackedColwiseParallel: use_local_output=False is not supported: {why}")

    def _shared_kv(self, module: nn.Module, device_mesh: DeviceMesh, sizes: Tuple[int, ...]):
        """NOTE [a packed qkv with fewer KV heads than ranks]: (local query rows, ranks per head, this
        rank's head) when ``num_kv_heads`` is below the TP degree; None when each rank has whole heads."""
        heads, ranks = self.num_kv_heads, device_mesh.size()
        if heads is None:
            return None
        if heads % ranks == 0:
            return None
        if ranks % heads:
            raise ValueError(f"torch_tp.PackedColwiseParallel: {_where()} has {heads} KV heads and the TP group "
                             f"{ranks} ranks; the heads must divide the ranks or the ranks the heads, so that "
                             "each rank's query heads read whole KV heads")
        per_head = ranks // heads
        return sizes[0] // ranks, per_head, device_mesh.get_local_rank() // per_head

    def __repr__(self) -> str:
        kv = "" if self.num_kv_heads is None else f", num_kv_heads={self.num_kv_heads}"
        return (f"{type(self).__name__}({self.blocks!r}{kv}, input_layouts={self.input_layouts}, "
                f"output_layouts={self.output_layouts}, use_local_output={self.use_local_output})")


class PackedRowwiseParallel(_PackedStyle):
    r"""Partition an ``nn.Linear`` whose input features are packed, row-wise, block by block.

    The weight's columns (input features) are ``blocks`` stacked in order;
    rank ``r`` holds ``[block_0 chunk r | block_1 chunk r | ...]`` of them, so
    it takes the local output of a :class:`PackedColwiseParallel` module with
    the same blocks (or any local tensor in that order). The bias is
    replicated and added once after the reduction; the output is
    ``Replicate()`` (all-reduce) or ``Shard(d)`` (reduce-scatter), as with
    :class:`RowwiseParallel`. The weight becomes a ``Shard(1)`` DTensor whose
    columns are in a rank-major order (NOTE [packed parameters] in
    ``torch_tp/parallel/packed.py``).

    Args:
        blocks (int or Sequence[int]): ``n`` for ``n`` equal blocks, or the
            blocks' sizes (they add up to ``in_features``). Each block must
            divide evenly by the TP degree.

    Keyword Args:
        input_layouts (Placement, optional): ``Shard(-1)`` only (the
            default): the local input in the packed order; a DTensor input
            is refused.
        output_layouts (Placement, optional): layout of the module output;
            ``Replicate()`` by default.
        use_local_output (bool, optional): return the local tensor (default)
            instead of a DTensor.

    Returns:
        A :class:`ParallelStyle` for :func:`parallelize_module`.

    Example::

        >>> from torch_tp import parallelize_module, PackedColwiseParallel, PackedRowwiseParallel
        >>> plan = {"up": PackedColwiseParallel(2), "down": PackedRowwiseParallel(2)}
        >>> m = parallelize_module(Model(), tp_mesh, plan)
    """

    _layouts = {nn.Linear: ({"weight": Shard(1), "bias": Replicate()}, _PackedRowwiseLinear)}
    _default_input_layout = Shard(-1)
    _default_output_layout = Replicate()
    desired_input_layouts = (Shard(-1),)
    _packed = {"weight": 1}
    _features = "in_features"

    def __init__(self, blocks: Union[int, Sequence[int]], *, input_layouts: Optional[Placement] = None,
                 output_layouts: Optional[Placement] = None, use_local_output: bool = True):
        super().__init__(blocks, input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output)
        if self.input_layouts[0] != Shard(-1):
            raise ValueError(f"torch_tp.PackedRowwiseParallel: input_layouts={self.input_layouts[0]!r} is not "
                             "supported, only Shard(-1): the local input in the packed order "
                             "[block_0 chunk r | block_1 chunk r | ...] has no other layout")
