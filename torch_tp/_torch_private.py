"""Every private torch symbol torch_tp uses, in one place.

torch_tp supports torch 2.11 to 2.15 (setup.py). torch may move or change
anything private between releases without notice, so the rest of the package
reaches torch's private API only through the names below: when a release moves
one, this file is the only one to change, and ``import torch_tp`` names what is
missing instead of failing somewhere deep in a forward.

What goes through here: every name torch marks private, by a leading underscore
on the name or on a module on its path (``torch._utils._get_device_index``,
``torch.utils._foreach_utils``, ``DTensor._local_tensor``), including public-looking
classes reachable only through a private module (``DTensorSpec``).

What stays at the call sites, as torch's public contract in all but name:
  - ``torch._foreach_*`` ops: torch's documentation lists them ("foreach
    operations"); their schemas are ATen's and do not move.
  - ``Tensor._version``: the in-place counter autograd checks saved tensors
    against, bound in C++ on every tensor.
  - ``nn.Module._parameters`` and a state dict's ``_metadata``: the storage
    ``register_parameter`` writes and the version record ``load_state_dict``
    reads; every module library (torch's own DDP and FSDP included) relies on them.
  - ``ParallelStyle._apply``: the method torch's ``parallelize_module`` calls,
    which every third-party style overrides.

Guards: every symbol below was checked on torch 2.11.0, 2.12.0, 2.13.0, 2.14.1
and 2.15.0 (existence and signature; the Python sources of 2.11.0, 2.14.1 and
2.15.0 side by side): none moved, so none needs a version guard today. When one moves, resolve
it here by ``torch.__version__`` and say which releases take which path. A
symbol missing from the running torch raises ImportError at ``import torch_tp``,
naming it. (One difference of behaviour, in DTensor's public ops, is avoided on
every torch rather than guarded: NOTE [the input's gradient keeps its layout]
in parallel/loss.py.)

Per-call cost: most accessors are torch's own objects bound once (functions,
classes, bound methods), so routing through them adds no call layer. DTensor's
attributes are read through one-line functions: one Python call on the unwrap of
each parameter in a forward, small beside the unwrap itself even without grad
(with grad, the unwrap also makes a C++ autograd node). A C accessor
(``operator.attrgetter``) costs as much and breaks ``torch.compile(fullgraph=True)``,
which cannot trace one built outside the graph.

This module imports only torch (and the standard library).
"""

import functools
import importlib
from typing import Any, Optional

import torch


def _lookup(module: str, name: str) -> Any:
    """``module``'s attribute ``name`` (dotted for nested attributes), or an
    ImportError that says which private symbol this torch lacks."""
    try:
        found: Any = importlib.import_module(module)
        for part in name.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as e:
        raise ImportError(
            f"torch_tp needs torch's private {module}.{name}, which torch {torch.__version__} does not have; "
            "torch_tp supports torch 2.11 to 2.15 (torch_tp/_torch_private.py resolves every private "
            "symbol it uses)") from e
    return found


# ---------------------------------------------------------------- process groups

resolve_process_group = _lookup("torch.distributed.distributed_c10d", "_resolve_process_group")
"""``_resolve_process_group(group_name) -> ProcessGroup``: the group c10d's registry
holds under a name, the lookup the C++ ops make; ``ops.shard`` needs the group's
rank and size from the name alone."""

get_default_group = _lookup("torch.distributed.distributed_c10d", "_get_default_group")
"""``_get_default_group() -> ProcessGroup``: the default group, or torch's error when
none is initialized (``group.WORLD`` is None then); DistributedDataParallel defaults
to it and compares hook states against it, as torch's DDP does."""

# ---------------------------------------------------------------- DTensor internals

DTensorSpec = _lookup("torch.distributed.tensor._dtensor_spec", "DTensorSpec")
"""``DTensorSpec(mesh, placements, tensor_meta=...)``: a DTensor's layout. Building a
gradient DTensor from a spec skips ``DTensor.from_local``'s spec recomputation, once
per parameter per step (NOTE [unwrapping a parameter] in parallel/_params.py)."""

TensorMeta = _lookup("torch.distributed.tensor._dtensor_spec", "TensorMeta")
"""``TensorMeta(shape, stride, dtype)``: the global shape, stride and dtype a
:data:`DTensorSpec` describes; with it torch_tp builds the specs of the DTensors it hands
back once per layout and shape (NOTE [DTensors handed between torch_tp modules] in parallel/_layout.py)."""

_DTensor = _lookup("torch.distributed.tensor", "DTensor")


def dtensor_from_spec(local: torch.Tensor, spec: Any, *, requires_grad: bool, subclass: Optional[type] = None) -> Any:
    """``DTensor(local_tensor, spec, *, requires_grad)``: DTensor's own constructor, whose
    signature is not public (``from_local`` is); it wraps a local tensor with a given
    :data:`DTensorSpec` and no autograd node, for the gradients of parameters, of
    loss_parallel's input (NOTE [the input's gradient keeps its layout] in parallel/loss.py)
    and the DTensors torch_tp hands between its modules (``subclass``, a DTensor subclass).

    Outside torch.export it runs DTensor's ``__new__`` alone: ``DTensor.__init__`` only
    calls torch.export's constructor hook, behind ``torch._disable_dynamo``: Python that
    does nothing outside export, run per DTensor, and torch_tp builds one per parameter
    and step."""
    cls = subclass or _DTensor
    if torch.compiler.is_exporting():
        return cls(local, spec, requires_grad=requires_grad)
    return cls.__new__(cls, local, spec, requires_grad=requires_grad)


def dtensor_constructor(*, requires_grad: bool) -> Any:
    """``(local, spec) -> DTensor``: :func:`dtensor_from_spec` without its torch.export branch and with
    no Python frame (a partial of DTensor's ``__new__``, which is C on torch 2.14), for callers that
    never run under export: the C++ unwrap's backward node builds each parameter's gradient with it
    (NOTE [the parameter unwrap in C++] in csrc/python/parameters.cpp)."""
    return functools.partial(_DTensor.__new__, _DTensor, requires_grad=requires_grad)


# DTensor declares both attributes in __slots__, so the class has them.
_lookup("torch.distributed.tensor", "DTensor._local_tensor")
_lookup("torch.distributed.tensor", "DTensor._spec")


def dtensor_local(dt: Any) -> torch.Tensor:
    """A DTensor's local tensor itself, with no autograd node (``to_local()`` adds
    one, per call): for the forward's unwrap of each parameter, and for checks
    that read the local shape."""
    return dt._local_tensor


def dtensor_spec(dt: Any) -> Any:
    """A DTensor's :data:`DTensorSpec`, the one its gradient should carry."""
    return dt._spec


LocalTensor = _lookup("torch.distributed._local_tensor", "LocalTensor")
"""torch's tensor of one value per simulated rank (under :data:`LocalTensorMode`);
the ops refuse it (NOTE [refused under LocalTensorMode] in ops.py)."""

LocalTensorMode = _lookup("torch.distributed._local_tensor", "LocalTensorMode")
"""torch's mode that simulates all ranks in one process over a fake process group,
whose collectives move no data; the ops refuse it rather than return wrong values."""

_mesh_resources = _lookup("torch.distributed.device_mesh", "_mesh_resources")


def current_mesh() -> Optional["torch.distributed.device_mesh.DeviceMesh"]:
    """The mesh of the innermost enclosing ``with mesh:`` block, or None: the mesh
    ``parallelize_module`` defaults to, looked up where torch's does. (torch's
    ``_mesh_resources.get_current_mesh()`` raises RuntimeError when there is none.)"""
    try:
        return _mesh_resources.get_current_mesh()
    except RuntimeError:
        return None


# ---------------------------------------------------------------- autograd

queue_autograd_callback = _lookup("torch.autograd", "Variable._execution_engine.queue_callback")
"""``queue_callback(fn)``: runs ``fn`` when the current backward pass ends. No public
API does; torch's DDP and FSDP use it too. Completes the Partial gradients of
sequence-parallel parameters (parallel/_replicated_grad.py)."""

assert_async = _lookup("torch", "_assert_async")
"""``_assert_async(cond, msg)``: fails if the one-element tensor ``cond`` is false,
with no host synchronisation on CUDA (a device-side assert); for loss_parallel's
target range check."""

# ---------------------------------------------------------------- nn.Module and optimizer helpers

global_backward_hooks = _lookup("torch.nn.modules.module", "_global_backward_hooks")
global_backward_pre_hooks = _lookup("torch.nn.modules.module", "_global_backward_pre_hooks")
"""The dicts ``register_module_full_backward_hook`` and ``register_module_full_backward_pre_hook``
fill (CommDebugMode's module tracker uses the latter). While either is non-empty, nn.Module
passes every module's inputs and outputs through a custom autograd.Function, which a handed
DTensor must not meet (NOTE [DTensors handed between torch_tp modules] in parallel/_layout.py)."""

IncompatibleKeys = _lookup("torch.nn.modules.module", "_IncompatibleKeys")
"""The ``(missing_keys, unexpected_keys)`` named tuple ``load_state_dict`` returns;
``load_full_state_dict`` returns one too."""

legacy_get_string = _lookup("torch.nn._reduction", "legacy_get_string")
"""``legacy_get_string(size_average, reduce)``: the ``reduction`` string the deprecated
arguments mean (with torch's deprecation warning), so loss_parallel's losses take
them as ``F.cross_entropy`` does."""

group_tensors_by_device_and_dtype = _lookup("torch.utils._foreach_utils", "_group_tensors_by_device_and_dtype")
"""``([[tensors]]) -> {(device, dtype): ([[tensors]], indices)}``: the grouping
``clip_grad_norm_`` makes before its foreach kernels; torch_tp's matches it so
the norms are computed as torch's are."""

has_foreach_support = _lookup("torch.utils._foreach_utils", "_has_foreach_support")
"""``(tensors, device) -> bool``: whether ``foreach=None`` picks the foreach kernels
for these tensors, as in torch's ``clip_grad_norm_``."""

device_has_foreach_support = _lookup("torch.utils._foreach_utils", "_device_has_foreach_support")
"""``(device) -> bool``: whether ``foreach=True`` can run on ``device``."""

# ---------------------------------------------------------------- DistributedDataParallel's torch DDP parity

get_device_index = _lookup("torch._utils", "_get_device_index")
"""``_get_device_index(device, optional=False, allow_cpu=False) -> int``: the index
torch's DDP takes from each of ``device_ids`` (an int, a device or a string)."""

to_kwargs = _lookup("torch.distributed.utils", "_to_kwargs")
"""``_to_kwargs(inputs, kwargs, device, use_side_stream) -> ((inputs,), (kwargs,))``:
torch DDP's move of the forward's inputs to ``device_ids[0]``. (From 2.14 it
returns unchanged containers as the same objects; torch_tp does not rely on either.)"""

cast_forward_inputs = _lookup("torch.distributed.utils", "_cast_forward_inputs")
"""``_cast_forward_inputs(dtype, *args, **kwargs) -> (args, kwargs)``: torch DDP's
cast of floating-point inputs to ``mixed_precision.param_dtype``."""

tree_flatten = _lookup("torch.utils._pytree", "tree_flatten")
"""``tree_flatten(tree) -> (leaves, spec)``: the forward output's tensors, whose
backward the reducer waits for; torch has no public pytree module in 2.11-2.15."""

tree_map_only = _lookup("torch.utils._pytree", "tree_map_only")
"""``tree_map_only(type, fn, tree)``: ``tree`` with ``fn`` applied to its leaves of ``type``;
a handed DTensor's torch functions swap it for its twin in any argument structure
(NOTE [DTensors handed between torch_tp modules] in parallel/_layout.py)."""

disable_torch_function_subclass = _lookup("torch._C", "DisableTorchFunctionSubclass")
"""``with DisableTorchFunctionSubclass():`` tensor subclasses' ``__torch_function__`` off,
as ``Tensor.__torch_function__`` runs a function; torch functions modes stay on.
loss_parallel's DTensor ``__torch_function__`` and a handed DTensor's metadata reads
run the function this way, as DTensor (whose torch function is off) would."""


def set_post_accumulate_grad_hooks(tensor: "torch.Tensor", hooks: dict) -> None:
    """Give the leaf ``tensor`` the post-accumulate-grad hooks ``hooks`` (id -> hook(tensor)):
    ``Tensor._post_accumulate_grad_hooks``, the dict AccumulateGrad calls after updating
    ``.grad``, which ``register_post_accumulate_grad_hook`` fills one hook at a time. Set
    whole, one shared dict serves every handed DTensor without that method's handle and
    torch.compile guard, which every handed DTensor would pay
    (NOTE [DTensors handed between torch_tp modules] in parallel/_layout.py)."""
    tensor._post_accumulate_grad_hooks = hooks
