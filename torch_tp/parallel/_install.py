"""The one step every torch_tp style takes to parallelize a module.

NOTE [installing a style]
A style says three things about a module, as torch's
``distribute_module(module, mesh, partition_fn, input_fn, output_fn)`` does, and
:func:`install` does the rest:

- the partition: ``{parameter name: placement}`` (a tuple of them, one per
  dim, on an N-D mesh), the DTensors its parameters become (``distribute_parameters``), and whether each rank's gradient of
  them is a partial sum, completed at the end of each backward (NOTE [partial
  gradients of sequence-parallel parameters] in ``_replicated_grad.py``);
- the forward: a mixin class whose ``forward`` takes the input in its declared
  layout, runs the module's computation on local tensors and hands the output
  back in the requested layout (torch's input_fn and output_fn, with the
  computation between them; NOTE [torch_tp forwards without replacing
  module.forward]);
- the state: ``module._tp_state``, one :class:`TPState` (a subclass per kind of
  module) that holds all that forward reads.

A style may prepare the module first (a packed style permutes its parameters
to the rank-major order), and add hooks after (state-dict hooks); nothing
else touches the module.

NOTE [torch_tp forwards without replacing module.forward]
A column- or row-parallel ``nn.Linear``/``nn.Embedding`` must run a torch_tp
op, not its own forward (``F.linear`` on the local shards would skip the
collectives). A style therefore changes the instance's class to a subclass of
its own class whose ``forward`` calls the op, which is how FSDP2's
``fully_shard`` adds its behaviour (``FSDPLinear``): ``isinstance``, the
state-dict keys, hooks, further wrappers (``fully_shard``, DDP) and
``torch.compile`` all see an ordinary subclass, and its name says what it does
(``ColwiseParallelLinear``, made from ``nn.Linear`` and the mixin that holds
the forward; it pickles as that pair, so ``torch.save(model)`` works). A class
swap, not hooks, also keeps ``torch.compile`` to one graph for all blocks: an
``always_call`` forward hook (which a hook-based SequenceParallel needs to put
the parameters back when the forward raises) is looked up by its id, which
dynamo guards on, so each block would compile anew and a deep model would hit
the recompile limit.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ._layout import ForwardRecords, TPGroup, tp_group
from ._params import distribute_parameters, module_path
from ._replicated_grad import complete_partial_grads_after_backward


@dataclass(eq=False)
class TPState:
    """``module._tp_state``: what torch_tp keeps on a module a style was applied to, for
    its forward and hooks. One object, so that a module's torch_tp state is in one place."""

    style: Optional[str]  # repr of the parameter style applied (None: only PrepareModule*)
    mesh: DeviceMesh
    group: TPGroup  # read once, when the style is applied (TPGroup's docstring says why)
    records: ForwardRecords  # the parallelized root's; parallelize_module shares them


def module_state(module: nn.Module, device_mesh: DeviceMesh) -> TPState:
    """``module``'s state, made (with no parameter style) when it has none yet; its records
    are its own until parallelize_module gives it its root's."""
    state = getattr(module, "_tp_state", None)
    if state is None:
        state = module._tp_state = TPState(None, device_mesh, tp_group(device_mesh), ForwardRecords())
    return state


def refuse_second_style(module: nn.Module, style) -> None:
    """A module takes one parameter style (its state names it)."""
    previous = getattr(module, "_tp_state", None)
    if previous is not None and previous.style is not None:
        where = f"'{module_path()}'" if module_path() else "the root module"
        raise ValueError(
            f"torch_tp.{type(style).__name__}: {where} ({type(module).__name__}) was already parallelized by "
            f"{previous.style}; the plan applies {style!r} to it too. Give each module one of ColwiseParallel, "
            "RowwiseParallel and SequenceParallel (PrepareModuleInput/Output may be added to any).")


_PARALLEL_CLASSES: Dict[Tuple[type, type], type] = {}


def parallel_class(cls: type, mixin: type) -> type:
    """``cls`` with ``mixin``'s forward, one class per (class, mixin)."""
    made = _PARALLEL_CLASSES.get((cls, mixin))
    if made is None:
        made = type(f"{mixin._tp_kind}{cls.__name__}", (mixin, cls), {"_tp_base_class": cls})
        _PARALLEL_CLASSES[(cls, mixin)] = made
    return made


def _new_parallel_module(cls: type, mixin: type) -> nn.Module:
    """An empty instance of ``parallel_class(cls, mixin)``, for unpickling."""
    return object.__new__(parallel_class(cls, mixin))


class ParallelModule:
    """What every mixin a style swaps in shares: its state, its repr and its pickling. The mixin
    comes first in the made class, so its ``super()`` is the module's own class."""

    _tp_kind: str  # the style's name, for the class name and the repr
    _tp_base_class: type  # the module's own class
    _tp_state: TPState

    def extra_repr(self) -> str:
        """``..., tp=ColwiseParallel[weight (32, 16) of (64, 16) Shard(0), bias ...] over 2 ranks``."""
        parts = []
        for name, param in self.named_parameters(recurse=False):
            if isinstance(param, DTensor):
                placements = param.placements[0] if len(param.placements) == 1 else param.placements
                parts.append(f"{name} {tuple(param.to_local().shape)} of {tuple(param.shape)} {placements!r}")
            else:
                parts.append(f"{name} local")
        ranks = self._tp_state.mesh.size()
        described = f"tp={self._tp_kind}[{', '.join(parts) or 'no parameters'}] over {ranks} ranks"
        base = super().extra_repr()
        return f"{base}, {described}" if base else described

    def __reduce_ex__(self, protocol):
        # Pickle (torch.save(model)) names the class by import path, which a made
        # class lacks: rebuild it from (class, mixin) instead; the state is nn.Module's.
        _, _, *rest = object.__reduce_ex__(self, protocol)
        return (_new_parallel_module, (self._tp_base_class, type(self).__bases__[0]), *rest)


def install(module: nn.Module, device_mesh: DeviceMesh, style, placements: Dict[str, Any], mixin: type,
            state_type: type, *state_args, partial_grads: bool = False) -> List[nn.Parameter]:
    """Parallelize ``module`` in place with ``style`` (NOTE [installing a style]): its parameters named in
    ``placements`` become DTensors (those it has; with ``partial_grads`` their gradients are completed
    after each backward), its state becomes ``state_type(repr(style), mesh, group, records,
    *state_args)`` (``group``: the mesh's last dim's) and its class ``parallel_class(type(module), mixin)``. Returns the distributed
    parameters. Refuses a module that another parameter style parallelized, before changing anything."""
    refuse_second_style(module, style)
    params = distribute_parameters(module, placements, device_mesh, style.src_data_rank, type(style).__name__)
    if partial_grads and device_mesh.size() > 1:
        complete_partial_grads_after_backward([p for p in params if p.requires_grad])
    records = module_state(module, device_mesh).records  # a PrepareModule* style's hooks read them too
    module._tp_state = state_type(repr(style), device_mesh, tp_group(device_mesh), records, *state_args)
    module.__class__ = parallel_class(type(module), mixin)
    return params
