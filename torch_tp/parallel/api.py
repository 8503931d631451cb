"""``parallelize_module``: torch's entry point, on torch_tp's styles."""

import warnings
from fnmatch import fnmatch
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import style as _torch_style

from .._torch_private import current_mesh
from . import style as _style
from ._layout import records_root
from ._params import naming_module
from .hf_plan import (
    ReplicatedWithGradAllReduce,
    activations_on_local_columns,
    check_expert_parameter_entries,
    check_hf_parameter_entry,
    check_plan_strings,
    hf_style,
    localize_attention,
    reading_config,
)

__all__ = ["parallelize_module"]


def _from_torch(style: _torch_style.ParallelStyle) -> _torch_style.ParallelStyle:
    """The style ``parallelize_module`` applies for a plan entry.

    One of torch's own style classes (exactly that class) becomes the torch_tp
    style with its settings, so a plan written with torch's classes runs on
    torch_tp's ops. Any other style, such as a subclass of one of torch's
    (torchao's ``Float8ColwiseParallel``) or a style of its own (torchtitan's),
    is applied as it is, through its own ``_apply``: it is a DTensor style, and
    torch_tp's parameters and layouts are DTensors where it meets them, so it
    composes with the torch_tp modules around it. Turning a subclass into the
    plain style would silently drop what the subclass adds (float8 GEMMs).
    """
    kind = type(style)
    if kind is _torch_style.ColwiseParallel:
        return _style.ColwiseParallel(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                                      use_local_output=style.use_local_output)
    if kind is _torch_style.RowwiseParallel:
        return _style.RowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                                      use_local_output=style.use_local_output)
    if kind is _torch_style.SequenceParallel:
        return _style.SequenceParallel(sequence_dim=style.sequence_sharding[0].dim,
                                       use_local_output=style.use_local_output)
    if kind is _torch_style.PrepareModuleInputOutput:
        ours = _style.PrepareModuleInputOutput.__new__(_style.PrepareModuleInputOutput)
        ours.prepare_module_input = _from_torch(style.prepare_module_input)
        ours.prepare_module_output = _from_torch(style.prepare_module_output)
        return ours
    if kind is _torch_style.PrepareModuleInput:
        return _style.PrepareModuleInput(
            input_layouts=style.input_layouts, desired_input_layouts=style.desired_input_layouts,
            input_kwarg_layouts=style.input_kwarg_layouts if style.with_kwargs else None,
            desired_input_kwarg_layouts=style.desired_input_kwarg_layouts, use_local_output=style.use_local_output)
    if kind is _torch_style.PrepareModuleOutput:
        return _style.PrepareModuleOutput(output_layouts=style.output_layouts,
                                          desired_output_layouts=style.desired_output_layouts,
                                          use_local_output=style.use_local_output)
    return style


def parallelize_module(
    module: nn.Module,
    device_mesh: Optional[DeviceMesh] = None,
    parallelize_plan: Union[_torch_style.ParallelStyle, str, Dict[str, Union[_torch_style.ParallelStyle, str]],
                            None] = None,
    *,
    src_data_rank: Optional[int] = 0,
) -> nn.Module:
    r"""Apply tensor parallelism to ``module`` according to ``parallelize_plan``.

    A drop-in replacement for ``torch.distributed.tensor.parallel.parallelize_module``:
    same arguments, same plans (torch's own style objects are accepted too),
    same numbers, and the same parameters: each one a style touches becomes
    the ``nn.Parameter(DTensor)`` torch's ``parallelize_module`` makes, so
    DCP, FSDP2, ``torch.distributed.checkpoint.state_dict`` and optimizers see
    the layout. The forwards run torch_tp's ops on the local tensors.

    Plan keys are module paths split on ``.``; each part is matched with
    ``fnmatch`` against ``named_children()`` (``"layers.*.attention.w[qkv]"``);
    ``""`` applies a style to ``module`` itself. A key that matches nothing is
    skipped with a warning. A module takes one parameter style (Colwise,
    Rowwise, SequenceParallel); a second one, or a parameter that is already a
    DTensor on another mesh or in another placement, is an error naming it.

    A style may also be a Hugging Face plan string, with HF's meaning
    (``"colwise"``, ``"rowwise"``, ``"embedding_rowwise"``,
    ``"replicated_with_grad_allreduce"``, ...; NOTE [Hugging Face plan
    strings] in ``hf_plan.py``), so a transformers model's own plan applies
    as it is: ``parallelize_module(model, tp_mesh, model.tp_plan)``. A string
    torch_tp does not implement is an error naming the module and the string.
    Where HF's meaning would not give the unsharded model's numbers, torch_tp
    departs from it: KV heads fewer than the ranks are replicated, and an MLP
    activation with parameters of its own gets its gradients summed. Tied
    weights (an embedding shared with ``lm_head``) stay tied under a plan of
    HF strings, as after transformers' ``from_pretrained(tp_plan=...)``; under
    torch's styles they are sharded separately, as by torch, and need re-tying.

    Args:
        module (nn.Module): the module to parallelize, in place.
        device_mesh (DeviceMesh, optional): a 1-D mesh (slice an N-D one, e.g.
            ``mesh["tp"]``), or the 2-D ``mesh["ep", "tp"]`` for a plan of
            :class:`ExpertTensorParallel` styles; by default the mesh of an
            enclosing ``with mesh:``.
        parallelize_plan (ParallelStyle, str, or a dict of them, optional):
            the plan; without one, nothing happens (with a warning).

    Keyword Args:
        src_data_rank (int, optional): the rank (in the mesh) whose initial
            parameters every rank takes (broadcast, then sharded); ``None``
            keeps each rank's own values and communicates nothing. Default 0.

    Returns:
        nn.Module: ``module``, parallelized.

    Example::

        >>> from torch_tp import parallelize_module, ColwiseParallel, RowwiseParallel
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> tp_mesh = init_device_mesh("cpu", (2,))
        >>> m = parallelize_module(MLP(), tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    """
    device_mesh = device_mesh or current_mesh()
    if device_mesh is None:
        raise RuntimeError("torch_tp.parallelize_module: no device_mesh given and no `with mesh:` block is active")
    if device_mesh.ndim != 1 and not _takes_mesh_of(parallelize_plan, device_mesh.ndim):
        raise ValueError(f"Tensor Parallel only accepts a 1D DeviceMesh, but found {device_mesh.ndim}D! "
                         "If you have a 2-D or N-D device_mesh, consider passing in device_mesh[\"tp\"]"
                         " (only a plan of ExpertTensorParallel styles takes a 2-D (ep, tp) mesh)")

    if parallelize_plan is None:
        warnings.warn("No parallelize_plan is provided and auto-parallel is not supported at the moment, "
                      "so this parallelize_module call will do nothing.", stacklevel=2)
        return module

    hf_plan = _names_hf_strings(parallelize_plan)
    if hf_plan:
        check_plan_strings(parallelize_plan)
    tied = _tied_parameters(module) if hf_plan else []
    with reading_config(module):
        _parallelize(module, device_mesh, parallelize_plan, src_data_rank, "")
    if hf_plan:
        # NOTE [an MLP activation's parameters] in hf_plan.py
        for path, act_fn in list(activations_on_local_columns(module)):
            _parallelize(act_fn, device_mesh, ReplicatedWithGradAllReduce(), src_data_rank, path)
        check_expert_parameter_entries(module)
        _retie(tied)
    _share_records(module)
    localize_attention(module)
    if not getattr(module, "_tp_checks_loads", False):
        module.register_load_state_dict_pre_hook(_check_load)
        module._tp_checks_loads = True
    return module


def _takes_mesh_of(plan, ndim: int) -> bool:
    """Whether every style of ``plan`` shards over an ``ndim``-D mesh (``mesh_ndim``; 1 for most)."""
    if isinstance(plan, dict):
        return bool(plan) and all(_takes_mesh_of(style, ndim) for style in plan.values())
    return getattr(plan, "mesh_ndim", 1) == ndim


def _names_hf_strings(plan) -> bool:
    """Whether ``plan`` gives any module a Hugging Face plan string."""
    return isinstance(plan, str) or (isinstance(plan, dict) and any(_names_hf_strings(v) for v in plan.values()))


# NOTE [tied weights under a Hugging Face plan]
# A style replaces each module's parameter with a DTensor of its own, so two
# modules that shared one parameter (an input embedding tied to lm_head) hold
# two after parallelize_module, each trained on its own gradient. torch's
# parallelize_module leaves them so, and torch_tp does too for torch's plans
# (re-tie by hand, as torchtitan does). transformers' from_pretrained(tp_plan=)
# ties them again after sharding, so under a plan of HF strings torch_tp does
# the same: where the modules' new parameters have one mesh, placements and
# shape (embedding_rowwise and colwise_gather_output both shard the [vocab,
# dim] weight on dim 0), every module gets the first one.


def _tied_parameters(root: nn.Module) -> List[List[Tuple[str, nn.Module, str]]]:
    """The (module path, module, name) slots of each parameter that more than one slot below
    ``root`` holds."""
    slots: Dict[int, Tuple[torch.Tensor, List[Tuple[str, nn.Module, str]]]] = {}
    for path, module in root.named_modules():
        for name, param in module._parameters.items():
            if param is not None:
                slots.setdefault(id(param), (param, []))[1].append((path, module, name))
    return [places for _, places in slots.values() if len(places) > 1]


def _retie(tied: List[List[Tuple[str, nn.Module, str]]]) -> None:
    """NOTE [tied weights under a Hugging Face plan]: point every slot of a tie at its first slot's
    parameter where the plan gave them the same layout; warn where it did not."""
    for (first_path, first, first_name), *others in tied:
        kept = first._parameters[first_name]
        for path, module, name in others:
            param = module._parameters[name]
            if param is kept:
                continue
            if (isinstance(kept, DTensor) and isinstance(param, DTensor) and param.device_mesh == kept.device_mesh
                    and param.placements == kept.placements and param.shape == kept.shape):
                setattr(module, name, kept)
                continue
            layouts = [f"'{f'{p}.{n}' if p else n}' "
                       f"({tuple(t.placements) if isinstance(t, DTensor) else 'not distributed'})"
                       for p, n, t in ((first_path, first_name, kept), (path, name, param))]
            warnings.warn(f"torch_tp.parallelize_module: {layouts[0]} and {layouts[1]} were one parameter (tied "
                          "weights); the plan gave them different layouts, so they are two now", stacklevel=3)


def _share_records(module: nn.Module) -> None:
    """Every torch_tp module below ``module``'s parallelized root reads and writes that root's
    records (NOTE [global sizes of plain shards] in _layout.py), whichever call parallelized it."""
    root, records = records_root(module)
    for inner in root.modules():
        state = getattr(inner, "_tp_state", None)
        if state is not None:
            state.records = records
            records.expect_group(state.group)


def _check_load(module: nn.Module, state_dict, prefix: str, *_args) -> None:
    """Before ``module.load_state_dict`` copies anything: every DTensor parameter's value must
    have its global shape, and a DTensor value must be on its mesh. One error lists every
    mismatch (torch's own check runs per module, after earlier modules were already written)."""
    errors = []
    for name, param in module.named_parameters():
        value = state_dict.get(prefix + name)
        if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor):
            continue
        theirs = f"{value.placements} on {value.device_mesh}" if isinstance(value, DTensor) else "a full tensor"
        ours = f"{param.placements} on {param.device_mesh}"
        if value.shape != param.shape:
            errors.append(f"'{prefix}{name}': the state dict has global shape {tuple(value.shape)} ({theirs}), "
                          f"the model {tuple(param.shape)} ({ours})")
        elif isinstance(value, DTensor) and value.device_mesh != param.device_mesh:
            errors.append(f"'{prefix}{name}': the state dict's value is {theirs}, the model's parameter {ours}")
    if errors:
        raise RuntimeError(f"torch_tp: error(s) loading a state dict into {type(module).__name__}; nothing was "
                           "loaded:\n\t" + "\n\t".join(errors))


def _parallelize(module: nn.Module, device_mesh: DeviceMesh, plan, src_data_rank: Optional[int], path: str):
    """``parallelize_module`` below the root; ``path`` is ``module``'s name from the root, for errors."""
    if isinstance(plan, str):
        plan = hf_style(plan, module, path, device_mesh.size())
        if plan is None:  # "replicate": the module stays as it is
            return module
    if isinstance(plan, _torch_style.ParallelStyle):
        style = _from_torch(plan)
        style.src_data_rank = src_data_rank
        with naming_module(path):
            return style._apply(module, device_mesh)

    if not isinstance(plan, dict):
        raise TypeError("Expect Union[ParallelStyle, Dict[str, ParallelStyle]] for"
                        f" parallelize_plan, {type(plan)} found!")
    for module_path, style in plan.items():
        if module_path == "":
            _parallelize(module, device_mesh, style, src_data_rank, path)
            continue
        token, _, rest = module_path.partition(".")
        matched = [(name, child) for name, child in module.named_children() if fnmatch(name, token)]
        if not matched and not rest and isinstance(style, str):
            # An HF key may name a parameter, not a module (NOTE [Hugging Face plan strings]).
            params = [name for name, _ in module.named_parameters(recurse=False) if fnmatch(name, token)]
            for name in params:
                check_hf_parameter_entry(style, f"{path}.{name}" if path else name, module)
            if params:
                continue
        if not matched:
            warnings.warn(f"Parallelize plan key '{module_path}' could not be resolved: no submodule matching "
                          f"token '{token}' in module {module}, skipping this plan entry.", stacklevel=3)
            continue
        for name, child in matched:
            _parallelize(child, device_mesh, {rest: style} if rest else style, src_data_rank,
                         f"{path}.{name}" if path else name)
    return module
