"""Hugging Face transformers' tensor-parallel plan strings, on torch_tp's styles.

NOTE [Hugging Face plan strings]
A transformers model carries its plan as strings: ``model.tp_plan`` maps
module paths from the top model (``"model.layers.*.self_attn.q_proj"``,
``"lm_head"``) to style names. Its base model's plan comes from the config
(``base_model_tp_plan``), prefixed with the base model's attribute name; the
head's from the model class (``_tp_plan = {"lm_head": "colwise_gather_output"}``);
and the input embedding is added as ``embedding_rowwise`` when the plan does
not name it. ``parallelize_module(model, mesh, model.tp_plan)`` takes that dict
as it is: torch_tp's key rules (each part matched with fnmatch) read HF's
keys as HF does, whose ``*`` only ever stands for a layer number.

Each string gets the torch_tp style with the placements and forward of the
style transformers 5.24 registers under it
(transformers/distributed/tensor_parallel.py):

==============================  =================  ==========================================
string                          module             torch_tp style
==============================  =================  ==========================================
colwise                         nn.Linear          ColwiseParallel()
colwise_gather_output,          nn.Linear          ColwiseParallel(output_layouts=Replicate())
colwise_rep
rowwise                         nn.Linear          RowwiseParallel()
rowwise_split_input,            nn.Linear          RowwiseParallel(input_layouts=Replicate())
rowwise_rep
embedding_rowwise               nn.Embedding       RowwiseParallel(input_layouts=Replicate())
embedding_colwise               nn.Embedding       ColwiseParallel(output_layouts=Replicate())
sequence_parallel               any leaf           SequenceParallel(use_local_output=True)
replicated_with_grad_allreduce  any leaf           ReplicatedWithGradAllReduce (below)
all_reduce                      any                AllReduceOutput (below)
packed_colwise                  nn.Linear          PackedColwiseParallel(2)
packed_rowwise                  nn.Linear          PackedRowwiseParallel(2)
replicate                       any                nothing: the parameters stay as they are
==============================  =================  ==========================================

One string gets more than HF's meaning: ``colwise`` on an attention's
``k_proj``/``v_proj`` when the model's ``config.num_key_value_heads`` is not a
multiple of the TP degree. HF's style would split single KV heads, and the
attention fails; torch_tp applies KVHeadColwiseParallel instead (each KV
head on the ranks whose query heads read it: NOTE [fewer KV heads than ranks]
in ``kv_heads.py``), and sets each attention's ``num_key_value_groups`` (the
``n_rep`` of its eager ``repeat_kv``) to its local query heads per local KV
head (:func:`localize_attention`).

An MLP's activation can have parameters of its own (Apertus' xIELU has two
scalars, ``alpha_p`` and ``alpha_n``); HF's plans leave them out, and under
``colwise`` up/gate projections it runs on this rank's columns, so its
gradients would hold this rank's part only (HF's own TP leaves them so).
torch_tp gives such an ``act_fn`` ``replicated_with_grad_allreduce``
(:func:`activations_on_local_columns`), and its gradients are the unsharded
model's.

HF's plans gather the output of a fused projection (Phi3's ``qkv_proj``
``[q | k | v]`` and ``gate_up_proj`` ``[gate | up]`` are ``colwise_gather_output``),
so every rank computes the whole attention and MLP. :func:`packed_tp_plan`
gives the plan that shards them block by block instead (PackedColwiseParallel,
NOTE [packed parameters] in ``packed.py``), with the layer after each one
row-parallel on the local result; :func:`localize_attention` then hands each
such attention a view of the config with its own head counts, since Phi3's
attention cuts ``[q | k | v]`` with ``config.num_attention_heads``.

All outputs are local tensors, as HF's styles hand them back. HF's
``packed_colwise``/``packed_rowwise`` mean two equal blocks (``[gate | up]``);
HF's own plans use them on MoE experts' fused parameters, which are not
``nn.Linear`` modules. The MoE, MLA and ``local_params`` styles are
model-specific: they are refused with an error naming the module and the
string, as is a string HF does not know. So is a plan key that names a
parameter rather than a module (HF shards such a parameter alone, e.g.
GPT-OSS's attention ``sinks`` or the experts' ``gate_up_proj``), unless its
string is ``replicate``.
"""

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from ._install import ParallelModule, TPState, install
from ._layout import tp_group
from ._params import local_tensor
from .kv_heads import KVHeadColwiseParallel, KVHeadState
from .moe import ExpertParallel, ExpertsTensorParallel
from .packed import PackedColwiseParallel, PackedRowwiseParallel, PackedState
from .style import (
    ColwiseModule,
    ColwiseParallel,
    ParallelStyle,
    RowwiseModule,
    RowwiseParallel,
    SequenceParallel,
    leaf_parameter_names,
    restore_parameters,
    swap_in_local_parameters,
)

__all__ = ["packed_tp_plan"]


@dataclass(eq=False)
class ReplicatedGradState(TPState):
    """A ReplicatedWithGradAllReduce module."""

    parameter_names: Tuple[str, ...]  # the parameters its forward runs on local tensors
    partial_grad: bool  # False on one rank, whose gradient is already the whole sum


class _ReplicatedGradModule(ParallelModule):
    _tp_kind = "ReplicatedWithGradAllReduce"
    _tp_state: ReplicatedGradState

    def forward(self, *args, **kwargs):
        """The module's own forward on its (local) inputs, with its parameters' local tensors."""
        state = self._tp_state
        set_aside = swap_in_local_parameters(self, state.parameter_names, state.partial_grad)
        try:
            return super().forward(*args, **kwargs)
        finally:
            restore_parameters(self, set_aside)


class ReplicatedWithGradAllReduce(ParallelStyle):
    """HF's ``replicated_with_grad_allreduce``: a module whose parameters every rank holds whole
    but whose input is this rank's shard of something other than the parameters' axis: Qwen3's
    per-head ``q_norm``/``k_norm`` normalize each of this rank's heads with one ``head_dim``
    weight. The forward needs no communication; each rank's parameter gradient covers only its
    heads, so the gradients are summed over the group.

    The parameters become ``Replicate()`` DTensors; the forward runs on their local tensors
    with gradients declared ``Partial()``, completed by one all-reduce at the end of the
    backward, as SequenceParallel's are (NOTE [partial gradients of sequence-parallel
    parameters] in ``_replicated_grad.py``). Inputs and outputs pass as they are."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        names = leaf_parameter_names(module, self)
        install(module, device_mesh, self, dict.fromkeys(names, Replicate()), _ReplicatedGradModule,
                ReplicatedGradState, names, device_mesh.size() > 1, partial_grads=True)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class AllReduceOutput(ParallelStyle):
    """HF's ``all_reduce``: the module's output holds this rank's partial sums (its inner layers
    left them unreduced); sum it over the group. Megatron's ``g``: an all-reduce forward and
    the identity backward, since the gradient of a replicated tensor is complete on every rank."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group_name = tp_group(device_mesh).name
        module.register_forward_hook(
            lambda _module, _inputs, output: torch.ops.torch_tp.reduce_from_tp_region(output, group_name))
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# string -> (the module type it applies to, the style). A fresh style per module:
# parallelize_module sets src_data_rank on it.
_STYLES: Dict[str, Tuple[type, Callable[[], ParallelStyle]]] = {
    "colwise": (nn.Linear, lambda: ColwiseParallel()),
    "colwise_gather_output": (nn.Linear, lambda: ColwiseParallel(output_layouts=Replicate())),
    "colwise_rep": (nn.Linear, lambda: ColwiseParallel(output_layouts=Replicate())),
    "rowwise": (nn.Linear, lambda: RowwiseParallel()),
    "rowwise_split_input": (nn.Linear, lambda: RowwiseParallel(input_layouts=Replicate())),
    "rowwise_rep": (nn.Linear, lambda: RowwiseParallel(input_layouts=Replicate())),
    # The ids are replicated; RowwiseParallel's default input layout is a Linear's, Shard(-1).
    "embedding_rowwise": (nn.Embedding, lambda: RowwiseParallel(input_layouts=Replicate())),
    "embedding_colwise": (nn.Embedding, lambda: ColwiseParallel(output_layouts=Replicate())),
    "sequence_parallel": (nn.Module, lambda: SequenceParallel(use_local_output=True)),
    "replicated_with_grad_allreduce": (nn.Module, ReplicatedWithGradAllReduce),
    "all_reduce": (nn.Module, AllReduceOutput),
    # HF's fused [gate | up] projections: two equal blocks (on expert parameters, which are not an
    # nn.Linear, they are model-specific and refused).
    "packed_colwise": (nn.Linear, lambda: PackedColwiseParallel(2)),
    "packed_rowwise": (nn.Linear, lambda: PackedRowwiseParallel(2)),
    # A transformers experts module (NOTE [experts under tensor parallelism] in moe.py); the plan's
    # entries for its gate_up_proj and down_proj name the layout this style gives them.
    "moe_tp_experts": (nn.Module, ExpertsTensorParallel),
    # HF's ep_plan (NOTE [experts under expert parallelism] in moe.py).
    "ep_dispatch_experts": (nn.Module, ExpertParallel),
}

# The entries HF's MoE plans give an experts module's parameters, by the torch_tp style of the
# module's own string: (parameter name, string) pairs that say what that style does to them.
EXPERT_PARAMETER_ENTRIES = {"ExpertsTensorParallel": {("gate_up_proj", "packed_colwise"), ("down_proj", "rowwise")},
                            "ExpertParallel": {("gate_up_proj", "grouped_gemm"), ("down_proj", "grouped_gemm")}}
# ExpertTensorParallel (no HF string) splits the experts both ways: either plan's entries describe it.
EXPERT_PARAMETER_ENTRIES["ExpertTensorParallel"] = set().union(*EXPERT_PARAMETER_ENTRIES.values())
_EXPERTS_STRINGS = {"moe_tp_experts": "ExpertsTensorParallel", "ep_dispatch_experts": "ExpertParallel"}

# HF strings torch_tp knows and does not implement, and why.
_NOT_IMPLEMENTED = {
    "mla_kv_a_proj": "a model-specific style (DeepSeek-V2's MLA)",
    "local_params": "a model-specific style (a module's bare parameters, GPT-OSS's attention sinks)",
}


def _refuse(string: str, where: str) -> None:
    """Raise for a string torch_tp does not apply: model-specific, not implemented, or unknown."""
    reason = _NOT_IMPLEMENTED.get(string)
    if reason is None and string.startswith("moe_"):
        reason = "a model-specific style (mixture of experts)"
    if reason is not None:
        raise NotImplementedError(f"torch_tp.parallelize_module: {where} has the Hugging Face plan string "
                                  f"'{string}', which torch_tp does not implement: {reason}.")
    raise ValueError(f"torch_tp.parallelize_module: {where} has the plan string '{string}', which is not a Hugging "
                     f"Face tensor-parallel style torch_tp knows; use one of {', '.join(sorted(_STYLES))}, "
                     "replicate, or a ParallelStyle.")


def check_plan_strings(plan, key: str = "") -> None:
    """Before a plan changes anything: every HF string in it is one torch_tp applies, so an unknown
    or unimplemented one (an ``ep_plan`` string from a newer transformers) is refused with its
    plan key while the model is still whole, not after the modules before it were parallelized."""
    if isinstance(plan, dict):
        for inner, value in plan.items():
            check_plan_strings(value, f"{key}.{inner}" if key and inner else key or inner)
    elif isinstance(plan, str) and plan != "replicate" and plan not in _STYLES and \
            not any(plan == string for entries in EXPERT_PARAMETER_ENTRIES.values() for _, string in entries):
        _refuse(plan, f"the plan key '{key}'" if key else "the plan")


# The config of the model parallelize_module was given (a transformers model's
# ``config``, None for other modules), for the strings whose style depends on it.
_model_config: contextvars.ContextVar[Any] = contextvars.ContextVar("torch_tp_hf_config", default=None)


@contextlib.contextmanager
def reading_config(root: nn.Module) -> Iterator[None]:
    """While parallelize_module applies a plan to ``root``: its ``config``, if it has one."""
    token = _model_config.set(getattr(root, "config", None))
    try:
        yield
    finally:
        _model_config.reset(token)


def _kv_heads_to_replicate(module: nn.Linear, path: str, ranks: int) -> Optional[int]:
    """The model's KV head count when ``module`` is an attention's k_proj/v_proj whose heads
    ColwiseParallel cannot split whole over ``ranks`` (NOTE [Hugging Face plan strings])."""
    config = _model_config.get()
    heads = getattr(config, "num_key_value_heads", None)
    if not isinstance(heads, int) or heads % ranks == 0 or path.rpartition(".")[2] not in ("k_proj", "v_proj"):
        return None
    return heads if module.out_features % heads == 0 else None


def _check_query_heads(path: str, ranks: int) -> None:
    """An attention's q_proj must split into whole query heads (each rank's heads read whole KV heads)."""
    heads = getattr(_model_config.get(), "num_attention_heads", None)
    if path.rpartition(".")[2] == "q_proj" and isinstance(heads, int) and heads % ranks:
        raise ValueError(f"torch_tp.parallelize_module: module '{path}' projects num_attention_heads={heads} "
                         f"query heads, which do not split whole over the {ranks} ranks of the TP group")


def hf_style(string: str, module: nn.Module, path: str, ranks: int) -> Optional[ParallelStyle]:
    """The torch_tp style for the HF plan string ``string`` on ``module`` (at ``path`` from the
    root, for errors) over ``ranks`` ranks; None for ``replicate``, which leaves the module as it is."""
    where = f"module '{path}' ({type(module).__name__})" if path else f"the root module ({type(module).__name__})"
    if string == "replicate":
        return None
    if string not in _STYLES:
        _refuse(string, where)
    kind, make = _STYLES[string]
    if not isinstance(module, kind):
        raise ValueError(f"torch_tp.parallelize_module: {where} has the Hugging Face plan string '{string}', "
                         f"which applies to {kind.__name__} modules.")
    if string == "colwise":
        _check_query_heads(path, ranks)
        kv_heads = _kv_heads_to_replicate(module, path, ranks)
        if kv_heads is not None:
            return KVHeadColwiseParallel(kv_heads)
    return make()


def localize_attention(root: nn.Module) -> None:
    """Give every HF attention below ``root`` the head counts of this rank where its projections'
    layout changed them: with replicated KV heads, ``num_key_value_groups`` (HF's ``n_rep``) becomes
    the local query heads per local KV head (one), which its eager attention repeats each KV head;
    over a block-wise ``qkv_proj``, :func:`_localize_packed_attention`."""
    for attention in root.modules():
        qkv_proj = getattr(attention, "qkv_proj", None)
        if isinstance(getattr(qkv_proj, "_tp_state", None), PackedState) and hasattr(attention, "config"):
            _localize_packed_attention(attention, qkv_proj)
            continue
        k_proj, q_proj = getattr(attention, "k_proj", None), getattr(attention, "q_proj", None)
        if not isinstance(getattr(k_proj, "_tp_state", None), KVHeadState) or \
                not isinstance(getattr(attention, "num_key_value_groups", None), int):
            continue
        rows = k_proj._tp_state.rows  # one KV head's rows: head_dim of them
        local_q_rows = local_tensor(q_proj.weight).shape[0]
        attention.num_key_value_groups = local_q_rows // (rows.stop - rows.start)


# NOTE [an MLP activation's parameters]
# An HF MLP computes down_proj(act_fn(gate_proj(x)) * up_proj(x)), or
# down_proj(act_fn(up_proj(x))), or over a fused gate_up_proj. With the input
# projections column-parallel (local output, Shard(-1)) and down_proj
# row-parallel on that local input, act_fn runs elementwise on this rank's
# columns: its output is right, but a parameter of its own (a learned
# activation: Apertus' xIELU alpha_p/alpha_n) gets the gradient of this rank's
# columns only, where the unsharded model sums over all of them. That is
# ReplicatedWithGradAllReduce's case (HF's string for Qwen3's per-head norms),
# which HF's plans do not name for the activation.
_MLP_INPUT_PROJECTIONS = ("gate_proj", "up_proj", "gate_up_proj")


def activations_on_local_columns(root: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    """(path, module) of each MLP ``act_fn`` below ``root`` that has parameters, no style, and
    runs on this rank's columns: its MLP's input projections are column-parallel with local
    outputs and its ``down_proj`` row-parallel on them (NOTE [an MLP activation's parameters])."""
    for path, mlp in root.named_modules():
        act_fn = mlp._modules.get("act_fn")
        if act_fn is None or hasattr(act_fn, "_tp_state") or next(act_fn.parameters(), None) is None:
            continue
        down_proj = mlp._modules.get("down_proj")
        inputs = [mlp._modules[name] for name in _MLP_INPUT_PROJECTIONS if mlp._modules.get(name) is not None]
        if not (isinstance(down_proj, RowwiseModule) and down_proj._tp_state.input_layout == Shard(-1) and inputs):
            continue
        if all(isinstance(proj, ColwiseModule) and proj._tp_state.output_layout == Shard(-1)
               and proj._tp_state.use_local_output for proj in inputs):
            yield (f"{path}.act_fn" if path else "act_fn"), act_fn


# A fused projection (by module name) -> the layer that consumes its output in the same parent.
_FUSED = {"qkv_proj": "o_proj", "gate_up_proj": "down_proj"}


def _head_counts(config) -> Tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of a transformers config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, head_dim


def packed_tp_plan(model: nn.Module) -> Dict[str, Any]:
    r"""A transformers model's ``tp_plan``, with its fused projections sharded block by block.

    HF plans ``colwise_gather_output`` for Phi3's ``qkv_proj`` (rows ``[q | k |
    v]``) and ``gate_up_proj`` (``[gate | up]``): each rank computes a
    column shard, and then the whole output is gathered, so every rank runs the
    whole attention and MLP. Here they take :class:`PackedColwiseParallel`
    instead: rank ``r`` holds its ``torch.chunk`` piece of every block and
    computes only its own heads and MLP columns, and the ``o_proj``/``down_proj``
    after them becomes ``rowwise`` (its input is that local result).
    ``parallelize_module`` then gives each such attention its own head counts.
    State dicts and DCP see the fused weights in their own order, as the
    unsharded model has them, at any TP degree.

    Args:
        model (nn.Module): a transformers model with ``tp_plan`` and ``config``.

    Returns:
        Dict[str, Union[str, ParallelStyle]]: the plan, for :func:`parallelize_module`.

    Example::

        >>> from torch_tp.parallel import packed_tp_plan
        >>> model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("microsoft/Phi-3-mini-4k-instruct"))
        >>> parallelize_module(model, tp_mesh, packed_tp_plan(model))
    """
    heads, kv_heads, head_dim = _head_counts(model.config)
    sizes = {"qkv_proj": (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), "gate_up_proj": 2}
    plan = dict(model.tp_plan)
    for key, string in model.tp_plan.items():
        parent, _, name = key.rpartition(".")
        if name not in _FUSED or string not in ("colwise_gather_output", "colwise_rep", "colwise"):
            continue
        plan[key] = PackedColwiseParallel(sizes[name], num_kv_heads=kv_heads if name == "qkv_proj" else None)
        after = f"{parent}.{_FUSED[name]}" if parent else _FUSED[name]
        if plan.get(after) in ("rowwise_split_input", "rowwise_rep"):
            plan[after] = "rowwise"
    return plan


class LocalHeadsConfig:
    """A transformers config as one rank's attention sees it under a block-wise ``qkv_proj``: its own
    ``num_attention_heads`` and ``num_key_value_heads``; every other attribute is read from (and
    written to) the model's config, so later changes to it (``set_attn_implementation``) still apply."""

    def __init__(self, config, **local: int):
        self.__dict__.update(_config=config, _local=local)

    def __getattr__(self, name: str):
        if "_config" not in self.__dict__:  # half-built (copy, unpickling): no attributes yet
            raise AttributeError(name)
        local = self.__dict__["_local"]
        return local[name] if name in local else getattr(self.__dict__["_config"], name)

    def __setattr__(self, name: str, value) -> None:
        if name in self._local:
            self._local[name] = value
        else:
            setattr(self._config, name, value)


def _localize_packed_attention(attention: nn.Module, qkv_proj: nn.Module) -> None:
    """Phi3-style attention over a block-wise ``qkv_proj``: it cuts ``[q | k | v]`` with
    ``config.num_attention_heads`` and ``self.num_key_value_heads``; give it this rank's."""
    config = attention.config
    if isinstance(config, LocalHeadsConfig):  # already localized (parallelize_module ran again)
        return
    heads, kv_heads, _ = _head_counts(config)
    ranks = qkv_proj._tp_state.mesh.size()
    # One KV head per rank where fewer heads than ranks share them (NOTE [a packed qkv with fewer KV
    # heads than ranks] in packed.py); each of its query heads reads it.
    local_heads, local_kv_heads = heads // ranks, max(kv_heads // ranks, 1)
    attention.config = LocalHeadsConfig(config, num_attention_heads=local_heads, num_key_value_heads=local_kv_heads)
    if isinstance(getattr(attention, "num_key_value_heads", None), int):
        attention.num_key_value_heads = local_kv_heads
    if isinstance(getattr(attention, "num_key_value_groups", None), int):
        attention.num_key_value_groups = local_heads // local_kv_heads


def check_hf_parameter_entry(string: str, path: str, owner: nn.Module) -> None:
    """A plan key that names the parameter ``path`` of ``owner``, not a module: ``replicate``
    (nothing to do), or the entry an MoE plan gives an experts parameter, which the experts
    module's own string applies (:func:`check_expert_parameter_entries` checks that it does);
    HF shards other lone parameters only for model-specific styles."""
    if string == "replicate":
        return
    name = path.rpartition(".")[2]
    if any((name, string) in entries for entries in EXPERT_PARAMETER_ENTRIES.values()):
        owner._tp_planned_parameter_entries = {*getattr(owner, "_tp_planned_parameter_entries", ()), (name, string)}
        return
    where = f"the plan key for parameter '{path}'"
    if string in _STYLES:
        raise NotImplementedError(f"torch_tp.parallelize_module: {where} has the Hugging Face plan string "
                                  f"'{string}'; torch_tp applies plan strings to modules, not to single "
                                  "parameters.")
    _refuse(string, where)


def check_expert_parameter_entries(root: nn.Module) -> None:
    """After a plan: every parameter entry :func:`check_hf_parameter_entry` let through was applied
    by its module's style (``moe_tp_experts`` for the experts' ``gate_up_proj``/``down_proj``); a plan
    that names the parameters without the module would otherwise leave them whole."""
    for path, module in root.named_modules():
        entries = module.__dict__.pop("_tp_planned_parameter_entries", None)
        if entries is None:
            continue
        style = getattr(getattr(module, "_tp_state", None), "style", None) or ""
        missing = sorted(entries - EXPERT_PARAMETER_ENTRIES.get(style.partition("(")[0], set()))
        if missing:
            names = ", ".join(f"'{path}.{name}': '{string}'" for name, string in missing)
            wanted = " or ".join(f"'{string}'" for string, style in _EXPERTS_STRINGS.items()
                                 if set(missing) <= EXPERT_PARAMETER_ENTRIES[style])
            raise ValueError(f"torch_tp.parallelize_module: the plan gives {names}, but module '{path}' "
                             f"({type(module).__name__}) does not get the style that applies them "
                             f"('{path}': {wanted})")
