"""Mixture-of-experts layers: the experts of a layer split over the ranks of a tensor-parallel group,
whole over an expert-parallel group, or both on an (ep, tp) mesh.

An experts module holds every expert's weights stacked on a leading expert
dim, as transformers' MoE models do (``@use_experts_implementation``:
Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3 and the others that share the
layout)::

    gate_up_proj [E, 2I, H]   rows [gate | up] of each expert
    down_proj    [E, H, I]

and its forward ``(hidden_states [T, H], top_k_index [T, K], top_k_weights
[T, K]) -> [T, H]`` sums, for each token, its K experts' outputs weighted by
the router's scores. The router (the MoE block's ``gate``) is a separate
module, left replicated.

NOTE [experts under tensor parallelism]
Expert e computes ``y_e(x) = down_e (act(gate_e x) * up_e x)``. With its
intermediate dim I split over p ranks, rank r holding rows I_r of gate_e and
of up_e and columns I_r of down_e,

    y_e(x) = sum_r down_e[:, I_r] (act(gate_e[I_r] x) * up_e[I_r] x)

since the activation is elementwise. gate_up_proj is split as
PackedColwiseParallel splits ``[gate | up]`` (rank r: ``[gate chunk r | up
chunk r]`` along dim 1, so ``chunk(2)`` of a local row is its own gate and
up; NOTE [packed parameters] in ``packed.py``: a rank-major ``Shard(1)``
DTensor whose state dicts are in the natural order) and down_proj is
``Shard(2)``. Each rank runs the module's own forward on its local weights,
whatever its experts implementation (eager, ``grouped_mm``,
``batched_mm``). The weighting by the router's scores and the sum over a
token's experts are linear, so the module's output is a partial sum over the
ranks, completed by one all-reduce per layer, not one per expert
(``reduce_from_tp_region``). Its inputs are replicated, and each rank's
gradients of them (the hidden states, and the scores, which weight each
rank's partial) are partial sums: both pass through ``copy_to_tp_region``
(identity forward, all-reduce backward). The router then gets whole
gradients on every rank, as any replicated module before a
ColwiseParallel layer does.

NOTE [experts under expert parallelism]
With the E experts split whole over p ranks (rank r holds experts
[r E/p, (r+1) E/p): both parameters ``Shard(0)``), each rank's tokens must
reach the ranks of their experts. ``torch_tp::moe_token_dispatch`` sorts the
T K (token, slot) pairs of this rank by expert, exchanges the counts, sends
each rank its rows (one all-to-all) and hands back the rows this rank's
experts run on, by source rank, with each row's local expert id (NOTE [token
rows by source rank] in csrc/ops/moe.cpp: HF's experts sort their rows
themselves); the module's own forward runs on them as top-1 routing with
unit weights (on the CPU, transformers' SiLU-gated experts run as one op
instead: NOTE [transformers' experts as one op]). ``moe_token_combine`` sends the
results back (the reverse all-to-all), puts each row at its (token, slot)
and sums a token's K rows weighted by the router's scores, so the scores'
gradient (the router's) is computed where the scores are. The ranks hold
different tokens (data parallel over the EP ranks); a rank whose experts get
no rows runs the module's own forward on one zero row, whose output it drops,
so its parameters still get (zero) gradients (the op gives them zero
gradients on no rows itself).

NOTE [torchtitan's grouped experts under expert parallelism]
torchtitan's GroupedExperts holds w1, w2, w3 (``w1_EFD``, ``w2_EDF``, ``w3_EFD``
in torchtitan 0.3), each [E, ...], and its forward takes rows already sorted
by expert with their counts, ``(x [N, H], num_tokens_per_expert [E]) -> [N,
H]``; the router and the sort are outside it (torchtitan's token
dispatcher). ExpertParallel shards every one of its 3-D parameters on dim 0
and runs its forward between ``torch_tp::moe_dispatch`` (the rows to the
ranks of their experts, regrouped by local expert, with the local counts) and
``moe_combine`` (back, in the sender's sorted order): torchtitan's own
ExpertParallel movement, on local tensors.

NOTE [experts under expert and tensor parallelism]
On an (ep, tp) mesh, rank (g, t) holds experts [g E/ep, (g+1) E/ep), each
with intermediate chunk t ([Shard(0), Shard(1)] gate_up_proj, rank-major
over tp; [Shard(0), Shard(2)] down_proj), as torchtitan's
ExpertTensorParallel. The TP ranks of an EP rank hold the same tokens (the
dense layers around are tensor parallel over tp). Each runs the expert
parallel exchange over its ep group (the ranks of its own tp position, which
hold the other experts' chunk t): the rows it gets are its TP peers' rows,
its experts' outputs partial sums over tp, and combine, linear, keeps them
partial. One all-reduce over tp completes the layer, and the inputs pass
through copy_to_tp_region, as under tensor parallelism alone: the order is
copy (tp), dispatch (ep), experts, combine (ep), reduce (tp).
"""

from dataclasses import dataclass
from typing import Dict, Tuple

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ._install import ParallelModule, TPState, install
from ._layout import tp_group
from ._params import module_path
from .packed import PackedLayout, PackedModule, keep_packed_order_in_state_dicts
from .style import ParallelStyle, restore_parameters, swap_in_local_parameters

__all__ = ["ExpertParallel", "ExpertTensorParallel", "ExpertsTensorParallel"]

_EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


def _where(module: nn.Module) -> str:
    where = f"'{module_path()}'" if module_path() else "the root module"
    return f"{where} ({type(module).__name__})"


def grouped_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a torchtitan GroupedExperts (NOTE [torchtitan's grouped experts under
    expert parallelism]): w1, w2, w3 stacked on a leading experts dim, no transformers layout."""
    names = sorted(name.partition("_")[0] for name in module._parameters)
    return names == ["w1", "w2", "w3"] and "gate_up_proj" not in module._parameters


def experts_sizes(module: nn.Module, style: str) -> Tuple[int, int, int]:
    """(E, I, H) of a transformers experts module, after checking it has the layout the MoE styles
    split (NOTE [experts under tensor parallelism]); an error naming the module and what differs."""
    where = f"torch_tp.{style}: {_where(module)}"
    gate_up, down = (module._parameters.get(name) for name in _EXPERT_PARAMETERS)
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        raise NotImplementedError(f"{where} is not an experts module with 3-D gate_up_proj [E, 2I, H] and "
                                  "down_proj [E, H, I] parameters")
    for flag, wanted in (("is_transposed", False), ("is_concatenated", True), ("has_bias", False),
                         ("has_gate", True)):
        if getattr(module, flag, wanted) != wanted:
            raise NotImplementedError(f"{where} has {flag}={not wanted}; the MoE styles split concatenated "
                                      "[gate | up] experts without biases, stored [E, out, in]")
    experts, rows, hidden = gate_up.shape
    if rows % 2 or tuple(down.shape) != (experts, hidden, rows // 2):
        raise ValueError(f"{where}: gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not "
                         "[E, 2I, H] and [E, H, I]")
    _refuse_distributed(module, style, _EXPERT_PARAMETERS)
    return experts, rows // 2, hidden


def _refuse_distributed(module: nn.Module, style: str, names) -> None:
    """The experts' parameters ``names`` must still be plain tensors: the styles distribute them."""
    for name in names:
        param = module._parameters[name]
        if isinstance(param, DTensor):
            raise ValueError(f"torch_tp.{style}: {_where(module)}: parameter '{name}' is already a DTensor "
                             f"({param.placements} on {param.device_mesh}); {style} distributes the plain one")


@dataclass(eq=False)
class ExpertsTPState(TPState):
    """An ExpertsTensorParallel experts module."""

    parameter_names: Tuple[str, ...]  # the parameters its forward runs on local tensors
    layouts: Dict[str, PackedLayout]  # gate_up_proj's [gate | up] blocks along dim 1 (NOTE [packed parameters])


def _local_input(value, name: str, style: str):
    """A replicated input as its local tensor (transformers hands plain tensors; a DTensor must be
    ``Replicate()``: every rank's experts read every token)."""
    if isinstance(value, DTensor):
        if any(not isinstance(p, Replicate) for p in value.placements):
            raise ValueError(f"torch_tp.{style}: {name} must be replicated, got {value.placements}")
        return value.to_local()
    return value


def _tp_region_inputs(module: nn.Module, hidden_states, top_k_weights, group: str):
    """The replicated inputs of a module split over TP, as local tensors whose gradients are all-reduced
    (``copy_to_tp_region``): each rank's are partial sums (NOTE [experts under tensor parallelism])."""
    hidden_states = _local_input(hidden_states, "hidden_states", module._tp_kind)
    top_k_weights = _local_input(top_k_weights, "top_k_weights", module._tp_kind)
    return (torch.ops.torch_tp.copy_to_tp_region(hidden_states, group),
            torch.ops.torch_tp.copy_to_tp_region(top_k_weights, group))


def _rank_major_gate_up(module: nn.Module, ranks: int) -> PackedLayout:
    """Put ``gate_up_proj``'s dim 1 in the rank-major order over ``ranks``, whose ``Shard(1)`` chunk r is
    [gate chunk r | up chunk r] (NOTE [packed parameters]); returns its layout."""
    intermediate = module.gate_up_proj.shape[1] // 2
    layout = PackedLayout((intermediate, intermediate), 1, ranks)
    gate_up = module.gate_up_proj
    with torch.no_grad():
        rank_major = gate_up.index_select(1, layout.rank_major_index(gate_up.device))
    module.gate_up_proj = nn.Parameter(rank_major, requires_grad=gate_up.requires_grad)
    return layout


def _check_divides(module: nn.Module, style: str, what: str, size: int, ranks: int, group: str) -> None:
    """``what`` ("intermediate size", "experts") of ``size`` must split evenly over ``ranks``."""
    if size % ranks:
        raise ValueError(f"torch_tp.{style}: {_where(module)} has {what} {size}, which does not split evenly over "
                         f"the {ranks} ranks of the {group} group")


def _check_num_experts(module: nn.Module, style: str, experts: int) -> None:
    if getattr(module, "num_experts", experts) != experts:
        raise ValueError(f"torch_tp.{style}: {_where(module)} has num_experts={module.num_experts}, but its "
                         f"parameters hold {experts} experts")


class _ExpertsTPModule(PackedModule, ParallelModule):
    _tp_kind = "ExpertsTensorParallel"
    _tp_state: ExpertsTPState

    def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        """The module's own forward on this rank's slice of every expert (NOTE [experts under tensor
        parallelism]): replicated [T, H] and routing in, the whole [T, H] out."""
        state = self._tp_state
        group = state.group.name
        hidden_states, top_k_weights = _tp_region_inputs(self, hidden_states, top_k_weights, group)
        set_aside = swap_in_local_parameters(self, state.parameter_names, False)
        try:
            partial = super().forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        finally:
            restore_parameters(self, set_aside)
        return torch.ops.torch_tp.reduce_from_tp_region(partial, group)


class ExpertsTensorParallel(ParallelStyle):
    r"""Split every expert of an experts module over the TP group: each rank holds ``1/p`` of each
    expert's intermediate dim.

    The module is a transformers experts module (``gate_up_proj [E, 2I, H]``,
    rows ``[gate | up]``; ``down_proj [E, H, I]``): Mixtral's, Qwen3-MoE's
    and the others that share their layout. ``gate_up_proj`` is split block by
    block, as :class:`PackedColwiseParallel` splits ``[gate | up]``, and
    ``down_proj`` on its columns (``Shard(2)``); each rank runs the module's
    own forward on its slices, and its output is all-reduced once (NOTE
    [experts under tensor parallelism] in ``torch_tp/parallel/moe.py``). The
    inputs (hidden states ``[T, H]``, ``top_k_index``, ``top_k_weights``)
    are replicated, as the replicated router hands them; their gradients are
    all-reduced in the backward. State dicts show the full ``[E, ...]``
    tensors in their natural order. HF's plan string ``moe_tp_experts`` is
    this style.

    Example::

        >>> from torch_tp import parallelize_module, ExpertsTensorParallel
        >>> parallelize_module(model, tp_mesh, {"model.layers.*.mlp.experts": ExpertsTensorParallel()})
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = type(self).__name__
        state = getattr(module, "_tp_state", None)
        if isinstance(state, ExpertTensorParallelState) and state.group == tp_group(device_mesh):
            return module  # already split over this TP group too (a tp_plan after ExpertTensorParallel)
        _, intermediate, _ = experts_sizes(module, name)
        _check_divides(module, name, "intermediate size", intermediate, device_mesh.size(), "TP")
        layout = _rank_major_gate_up(module, device_mesh.size())
        install(module, device_mesh, self, {"gate_up_proj": Shard(1), "down_proj": Shard(2)}, _ExpertsTPModule,
                ExpertsTPState, _EXPERT_PARAMETERS, {"gate_up_proj": layout})
        keep_packed_order_in_state_dicts(module)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@dataclass(eq=False)
class ExpertParallelState(TPState):
    """An ExpertParallel experts module."""

    parameter_names: Tuple[str, ...]
    num_experts: int  # E, over the whole group; the module's forward sees its E / p
    ep_group: str  # the group the tokens are exchanged over (the mesh's, or an (ep, tp) mesh's ep dim)


@dataclass(eq=False)
class ExpertTensorParallelState(ExpertParallelState):
    """An ExpertTensorParallel experts module; ``group`` is its mesh's tp dim."""

    layouts: Dict[str, PackedLayout]  # gate_up_proj's [gate | up] blocks over tp (NOTE [packed parameters])


# NOTE [transformers' experts as one op]
# On the CPU the rows a rank's experts get run through torch_tp::moe_gated_experts
# (csrc/ops/moe_experts.cpp, NOTE [one GEMM per expert]) in place of the module's
# own forward, when that forward is transformers' SiLU-gated experts: the
# module's class has transformers' default gate (``act_fn(gate) * up`` of
# ``chunk(2)``), SiLU as act_fn, no post-expert norm, and one of transformers'
# own implementations of those experts (eager, which an unset
# ``_experts_implementation`` means, ``grouped_mm`` or ``batched_mm``; any other
# registered name is someone's own kernel, and runs). Those implementations
# compute the same products and activation; on top-1 routing with unit
# weights, which is what the rows are, their sorting, gathering, weighting and
# scattering move nothing, and the op skips them. Elsewhere (CUDA, where
# grouped_mm is one kernel) the module's own forward runs.
_TRANSFORMERS_EXPERTS_IMPLEMENTATIONS = (None, "eager", "grouped_mm", "batched_mm")


def _gated_silu_experts(module: nn.Module) -> bool:
    """Whether ``module``'s forward is transformers' SiLU-gated experts (NOTE [transformers' experts as one
    op]); the layout flags are checked by :func:`experts_sizes`."""
    gate = getattr(type(module), "_apply_gate", None)
    act = type(getattr(module, "act_fn", None))
    config = getattr(module, "config", None)
    return (getattr(gate, "__module__", None) == "transformers.integrations.moe"
            and getattr(gate, "__name__", None) == "_default_apply_gate"
            and (act is nn.SiLU or (act.__module__, act.__name__) == ("transformers.activations", "SiLUActivation"))
            and not getattr(module, "has_post_expert_norm", False)
            and getattr(config, "_experts_implementation", None) in _TRANSFORMERS_EXPERTS_IMPLEMENTATIONS)


class _ExpertParallelModule(ParallelModule):
    _tp_kind = "ExpertParallel"
    _tp_state: ExpertParallelState

    def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        """This rank's tokens [T, H] with their global expert ids -> their weighted expert outputs [T, H]
        (NOTE [experts under expert parallelism])."""
        hidden_states = _local_input(hidden_states, "hidden_states", self._tp_kind)
        top_k_weights = _local_input(top_k_weights, "top_k_weights", self._tp_kind)
        return self._exchange_and_run(hidden_states, top_k_index, top_k_weights, args, kwargs)

    def _exchange_and_run(self, hidden_states, top_k_index, top_k_weights, args, kwargs):
        """The tokens to the ranks of their experts over ``ep_group``, the experts on the rows this
        rank's experts get, the results back and summed per token."""
        state = self._tp_state
        group = state.ep_group
        rows, expert_ids, order, tokens_per_expert, recv_counts = torch.ops.torch_tp.moe_token_dispatch(
            hidden_states, top_k_index, state.num_experts, group)
        set_aside = swap_in_local_parameters(self, state.parameter_names, False)
        self.num_experts = recv_counts.size(1)
        try:
            if not args and not kwargs and rows.device.type == "cpu" and _gated_silu_experts(self):
                # NOTE [transformers' experts as one op]
                out = torch.ops.torch_tp.moe_gated_experts(rows, recv_counts, self.gate_up_proj, self.down_proj)
            else:
                out = self._own_forward(rows, expert_ids, args, kwargs)
        finally:
            self.num_experts = state.num_experts
            restore_parameters(self, set_aside)
        return torch.ops.torch_tp.moe_token_combine(out, top_k_weights, order, tokens_per_expert, recv_counts, group)

    def _own_forward(self, rows, expert_ids, args, kwargs):
        """The module's own forward on the received rows, as top-1 routing with unit weights."""
        received = rows.size(0)
        if received == 0:  # NOTE [experts under expert parallelism]: one zero row keeps the parameters in backward
            rows = rows.new_zeros(1, rows.size(1)) + rows.sum(0, keepdim=True)
            expert_ids = torch.zeros(1, 1, dtype=torch.long, device=rows.device)
        else:
            expert_ids = expert_ids.unsqueeze(-1)
        unit_weights = torch.ones(expert_ids.shape, dtype=rows.dtype, device=rows.device)
        return super(_ExpertParallelModule, self).forward(rows, expert_ids, unit_weights, *args, **kwargs)[:received]


class ExpertParallel(ParallelStyle):
    r"""Split the experts of an experts module whole over the mesh (torchtitan's ``ExpertParallel``):
    rank ``r`` holds experts ``[r E/p, (r+1) E/p)``, and each rank's tokens are sent to the ranks
    of their experts and back.

    The module is a transformers experts module (``gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]``, forward ``(hidden_states [T, H], top_k_index [T,
    K], top_k_weights [T, K])``); HF's ``ep_plan`` string
    ``ep_dispatch_experts`` is this style, and its ``grouped_gemm`` entries for
    the two parameters the layout it gives them. Both parameters become
    ``Shard(0)`` DTensors of the full ``[E, ...]`` shape. The tokens move
    through ``torch_tp::moe_token_dispatch`` and ``moe_token_combine`` (NOTE
    [experts under expert parallelism] in ``torch_tp/parallel/moe.py``), on
    any c10d group and on the torch_tp backend's shared memory. Each rank
    holds its own tokens: the ranks of the mesh are data parallel for
    everything but the experts.

    torchtitan's ``GroupedExperts`` (``w1``, ``w2``, ``w3`` of ``[E, ...]``,
    forward ``(x [N, H] sorted by expert, num_tokens_per_expert [E])``) is
    split the same way, its rows moved by ``moe_dispatch`` and ``moe_combine``
    (NOTE [torchtitan's grouped experts under expert parallelism]).

    Example::

        >>> from torch_tp import parallelize_module, ExpertParallel
        >>> parallelize_module(model, ep_mesh, model.ep_plan)   # or {"model.layers.*.mlp.experts": ExpertParallel()}
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = type(self).__name__
        if grouped_experts(module):  # torchtitan's GroupedExperts
            experts, names, mixin = _grouped_experts_count(module, name), tuple(module._parameters), \
                _GroupedExpertParallelModule
        else:
            (experts, _, _), names, mixin = experts_sizes(module, name), _EXPERT_PARAMETERS, _ExpertParallelModule
        _check_divides(module, name, "experts", experts, device_mesh.size(), "expert-parallel")
        _check_num_experts(module, name, experts)
        install(module, device_mesh, self, {param: Shard(0) for param in names}, mixin, ExpertParallelState, names,
                experts, tp_group(device_mesh).name)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class _GroupedExpertParallelModule(ParallelModule):
    _tp_kind = "ExpertParallel"
    _tp_state: ExpertParallelState

    def forward(self, x, num_tokens_per_expert, *args, **kwargs):
        """This rank's rows [N, H] sorted by global expert, with their counts [E] -> the experts'
        outputs [N, H] in the same order (NOTE [torchtitan's grouped experts under expert parallelism])."""
        state = self._tp_state
        rows, rows_per_expert, recv_counts = torch.ops.torch_tp.moe_dispatch(x, num_tokens_per_expert,
                                                                             state.ep_group)
        set_aside = swap_in_local_parameters(self, state.parameter_names, False)
        try:
            out = super().forward(rows, rows_per_expert, *args, **kwargs)
        finally:
            restore_parameters(self, set_aside)
        return torch.ops.torch_tp.moe_combine(out, recv_counts, num_tokens_per_expert, state.ep_group)


def _grouped_experts_count(module: nn.Module, style: str) -> int:
    """E of a torchtitan GroupedExperts: every parameter 3-D with the same leading dim, plain."""
    shapes = {name: tuple(param.shape) for name, param in module._parameters.items()}
    counts = {shape[0] if len(shape) == 3 else None for shape in shapes.values()}
    if len(counts) != 1 or None in counts:
        raise ValueError(f"torch_tp.{style}: {_where(module)} holds {shapes}; grouped experts are 3-D "
                         "[E, ..] parameters with one E")
    _refuse_distributed(module, style, shapes)
    return counts.pop()


class _ExpertTensorParallelModule(PackedModule, _ExpertParallelModule):
    _tp_kind = "ExpertTensorParallel"
    _tp_state: ExpertTensorParallelState

    def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        """The tokens of this rank's TP group [T, H] -> their weighted expert outputs [T, H] (NOTE [experts
        under expert and tensor parallelism]): copy (tp), dispatch (ep), experts, combine (ep), reduce (tp)."""
        tp = self._tp_state.group.name
        hidden_states, top_k_weights = _tp_region_inputs(self, hidden_states, top_k_weights, tp)
        partial = self._exchange_and_run(hidden_states, top_k_index, top_k_weights, args, kwargs)
        return torch.ops.torch_tp.reduce_from_tp_region(partial, tp)


class ExpertTensorParallel(ParallelStyle):
    r"""Split the experts of an experts module whole over the ``ep`` dim of a 2-D ``(ep, tp)`` mesh
    and each expert's intermediate dim over its ``tp`` dim (torchtitan's ``ExpertTensorParallel``).

    Rank ``(g, t)`` holds experts ``[g E/ep, (g+1) E/ep)``, each with the
    ``t``-th chunk of its intermediate dim: ``gate_up_proj`` is ``[Shard(0),
    Shard(1)]`` (its ``[gate | up]`` blocks split as under
    :class:`ExpertsTensorParallel`) and ``down_proj`` ``[Shard(0),
    Shard(2)]``, DTensors of the full ``[E, ...]`` shape whose state dicts are
    in the natural order. The ranks of a tp group hold the same tokens, those
    of an ep group their own: the tokens move over ep as under
    :class:`ExpertParallel`, and the output is all-reduced over tp once (NOTE
    [experts under expert and tensor parallelism] in
    ``torch_tp/parallel/moe.py``). Apply it before the model's TP plan on
    ``mesh["tp"]``; that plan's ``moe_tp_experts`` then leaves the module as
    it is.

    Example::

        >>> from torch_tp import parallelize_module, ExpertTensorParallel
        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
        >>> parallelize_module(model, mesh, {"model.layers.*.mlp.experts": ExpertTensorParallel()})
        >>> parallelize_module(model, mesh["tp"], model.tp_plan)
    """

    mesh_ndim = 2  # parallelize_module takes an (ep, tp) mesh for it

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = type(self).__name__
        if device_mesh.ndim != 2:
            raise ValueError(f"torch_tp.{name}: {_where(module)} needs a 2-D (ep, tp) mesh, got {device_mesh}")
        experts, intermediate, _ = experts_sizes(module, name)
        _check_divides(module, name, "experts", experts, device_mesh.size(0), "expert-parallel (mesh dim 0)")
        _check_divides(module, name, "intermediate size", intermediate, device_mesh.size(1), "TP (mesh dim 1)")
        _check_num_experts(module, name, experts)
        layout = _rank_major_gate_up(module, device_mesh.size(1))
        install(module, device_mesh, self, {"gate_up_proj": (Shard(0), Shard(1)), "down_proj": (Shard(0), Shard(2))},
                _ExpertTensorParallelModule, ExpertTensorParallelState, _EXPERT_PARAMETERS, experts,
                tp_group(device_mesh, 0).name, {"gate_up_proj": layout})
        keep_packed_order_in_state_dicts(module)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
