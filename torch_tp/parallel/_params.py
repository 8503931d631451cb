"""Parameters of parallelized modules: DTensors at the boundary, local tensors in the forward.

NOTE [DTensor parameters, local forward]
Everything in PyTorch that learns a parameter's layout learns it from a DTensor
parameter: DCP (which keeps one copy of a plain tensor saved under the same key
by every rank, silently), FSDP2's 2-D sharding, ``get_state_dict`` with
``full_state_dict=True``, DTensor-aware ``clip_grad_norm_``, optimizers' state.
So a style turns each parameter it touches into exactly the
``nn.Parameter(DTensor)`` that torch's style gives it (``distribute_tensor``
with the same placement, ``torch.chunk`` pieces, ``src_data_rank``), and keeps
the parameter's ``requires_grad``.

What stays free of DTensor is the hot path: a torch_tp forward takes each
parameter's local tensor (:func:`local_tensor`: one autograd node per
parameter and forward, no communication; NOTE [unwrapping a parameter]) and
runs the C++ ops on plain tensors. The gradient comes back through that node as a DTensor
with the parameter's placement (the ops' gradients are complete for the local
piece: NOTE [partial grad_x] in linear.cpp), so ``.grad`` is what a
DTensor-aware reader expects. The parameter is read at every forward, never
cached: FSDP2 swaps in its unsharded parameter (a DTensor on the TP mesh)
before the forward, and torch's DDP rebuilds DTensor views of its local
parameters before every forward; both are read the same way.
"""

import contextlib
import contextvars
import weakref
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, distribute_tensor

from .._C import _local_parameter as local_parameter
from .._torch_private import DTensorSpec, dtensor_constructor, dtensor_local, dtensor_spec

# The qualified name (from the module parallelize_module was given) of the
# module a style is being applied to, for error messages.
_module_path: contextvars.ContextVar[str] = contextvars.ContextVar("torch_tp_module_path", default="")


@contextlib.contextmanager
def naming_module(path: str) -> Iterator[None]:
    token = _module_path.set(path)
    try:
        yield
    finally:
        _module_path.reset(token)


def module_path() -> str:
    return _module_path.get()


def _qualified(name: str) -> str:
    path = module_path()
    return f"{path}.{name}" if path else name


def _placements(placement: Union[Placement, Tuple[Placement, ...]]) -> Tuple[Placement, ...]:
    """A style's placement for a parameter: one (a 1-D mesh) or one per mesh dim."""
    return placement if isinstance(placement, tuple) else (placement,)


def _described(placements: Tuple[Placement, ...]):
    """Placements for a message: one as itself (a 1-D mesh's), several as the tuple."""
    return placements[0] if len(placements) == 1 else placements


def check_parameter(module: nn.Module, name: str, mesh: DeviceMesh,
                    placement: Union[Placement, Tuple[Placement, ...]], style: str) -> bool:
    """Whether ``module``'s parameter ``name`` still has to be distributed: False when it
    already is exactly the DTensor the style would make (torch's ``distribute_tensor``
    contract); a DTensor on another mesh, or in another placement (a plan that shards it
    twice), is an error naming the parameter, both layouts and both meshes."""
    placement = _placements(placement)
    param = module._parameters[name]
    if not isinstance(param, DTensor):
        return True
    if param.device_mesh != mesh:
        raise ValueError(
            f"torch_tp.{style}: parameter '{_qualified(name)}' is already a DTensor on {param.device_mesh} "
            f"with placements {param.placements}, not on the mesh this style shards over, {mesh}. Parallelize "
            "a module on one mesh (for 2-D parallelism: tensor parallelism on mesh['tp'] first, then "
            "fully_shard or DistributedDataParallel over mesh['dp']).")
    if param.placements != placement:
        raise ValueError(
            f"torch_tp.{style}: parameter '{_qualified(name)}' of global shape {tuple(param.shape)} is already "
            f"{_described(param.placements)!r} on {mesh}; the plan shards it a second time, as "
            f"{_described(placement)!r}. "
            "Give each parameter one style.")
    return False


def distribute_parameter(module: nn.Module, name: str, mesh: DeviceMesh,
                         placement: Union[Placement, Tuple[Placement, ...]], src_data_rank: Optional[int]) -> nn.Parameter:
    """Replace ``module``'s (plain) parameter ``name`` by ``nn.Parameter(distribute_tensor(...))``
    with ``placement`` on ``mesh``, as torch's styles do, keeping its ``requires_grad``."""
    param = module._parameters[name]
    if param.is_meta:
        src_data_rank = None  # no values to send: shapes only (meta-device initialization)
    with torch.no_grad():
        value = distribute_tensor(param.detach(), mesh, _placements(placement), src_data_rank=src_data_rank)
    new = nn.Parameter(value, requires_grad=param.requires_grad)
    module._parameters[name] = new
    return new


def distribute_parameters(module: nn.Module, placements: Dict[str, Union[Placement, Tuple[Placement, ...]]],
                          mesh: DeviceMesh, src_data_rank: Optional[int], style: str) -> List[nn.Parameter]:
    """:func:`distribute_parameter` for each of ``module``'s parameters named in ``placements``
    (those it has), after :func:`check_parameter` passed for all of them: nothing is changed
    when one is refused. Returns the module's parameters, in ``placements``' order."""
    names = [name for name in placements if module._parameters.get(name) is not None]
    todo = [name for name in names if check_parameter(module, name, mesh, placements[name], style)]
    for name in todo:
        distribute_parameter(module, name, mesh, placements[name], src_data_rank)
    return [module._parameters[name] for name in names]


# A parameter's local gradient as the DTensor its ``.grad`` holds (NOTE [unwrapping a parameter]),
# ``(grad, spec) -> DTensor``, called by the unwrap's C++ backward node: DTensor's constructor with no
# Python frame (the eager unwrap's backward never runs under torch.export, which traces to_local); under
# create_graph, from_local, so the gradient stays differentiable.
_new_gradient = dtensor_constructor(requires_grad=False)


def _differentiable_gradient(grad: torch.Tensor, spec: DTensorSpec) -> DTensor:
    return DTensor.from_local(grad, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                              stride=spec.stride)


# NOTE [unwrapping a parameter]
# DTensor.to_local() is the public way, and what runs under torch.compile. In
# eager mode its backward rebuilds the gradient DTensor through
# DTensor.from_local (another autograd Function and a spec recomputation), and
# an autograd.Function of our own would still run two Python frames per
# parameter and step: per-parameter costs that show in the eager step of a
# model with many small parameters. The eager unwrap is one C++ node instead
# (NOTE [the parameter unwrap in C++] in csrc/python/parameters.cpp), whose
# backward builds the gradient with the parameter's own spec (or its Partial
# twin) and DTensor's constructor. The gradient is contiguous, as the local
# tensor is, so AccumulateGrad can take it as .grad without a copy.


def local_tensor(param: Optional[torch.Tensor], partial_grad: bool = False) -> Optional[torch.Tensor]:
    """This rank's plain tensor of a (DTensor) parameter, differentiable (NOTE [DTensor
    parameters, local forward]). Its gradient reaches the parameter with the parameter's
    placements, or as ``Partial()`` sums with ``partial_grad`` (a replicated parameter
    used on a sequence shard). Plain tensors and ``None`` are returned as they are."""
    if not isinstance(param, DTensor):
        return param
    if not torch.is_grad_enabled():
        return dtensor_local(param)
    if torch.compiler.is_compiling():
        if not param.requires_grad:
            return dtensor_local(param)
        return param.to_local(grad_placements=(Partial(),) if partial_grad else None)
    # The C++ unwrap reads requires_grad itself (no torch function on the way, which
    # loss_parallel() turns on for DTensors) and returns the local tensor as it is when the
    # parameter does not require grad.
    if partial_grad:
        return local_parameter(param, dtensor_local(param), _partial_twin(param), _new_gradient,
                               _differentiable_gradient)
    return local_parameter(param, dtensor_local(param), dtensor_spec(param), _new_gradient, _differentiable_gradient)


# A spec's Partial() twin, while the spec lives (the specs of the DTensor views
# torch's DDP rebuilds every forward come and go).
_partial_twins: "weakref.WeakKeyDictionary[DTensorSpec, DTensorSpec]" = weakref.WeakKeyDictionary()


def _partial_twin(param: DTensor) -> DTensorSpec:
    """``param``'s spec with a ``Partial()`` placement, made once per spec: building a
    DTensorSpec costs more than the rest of the unwrap, and it would run every forward."""
    spec = dtensor_spec(param)
    twin = _partial_twins.get(spec)
    if twin is None:
        twin = _partial_twins[spec] = DTensorSpec(spec.mesh, (Partial(),), tensor_meta=spec.tensor_meta)
    return twin
