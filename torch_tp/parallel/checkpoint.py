"""Full (unsharded) state dicts and global gradient-norm clipping for parallelized modules.

After :func:`~torch_tp.parallelize_module`, the parameters a style touched are
DTensors (NOTE [DTensor parameters, local forward] in ``_params.py``), so
``torch.distributed.checkpoint`` (DCP, with resharding), its ``state_dict``
helpers (``get_state_dict``, ``set_state_dict``, ``full_state_dict=True``) and
``torch.nn.utils.clip_grad_norm_`` work on a torch_tp model as on torch's. The
functions here are shorter paths for the common cases:

- :func:`get_full_state_dict` gathers the model into the unsharded model's
  state dict (what ``torch.save`` of the unsharded model would hold);
- :func:`load_full_state_dict` loads such a state dict into a parallelized
  model, each rank keeping its piece, in place, after checking every shape;
- :func:`clip_grad_norm_` clips by the norm of the unsharded gradients with
  one all-reduce per group on the local pieces, where torch's reduces each
  DTensor's norm through DTensor dispatch.
"""

import types
import warnings
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from .._torch_private import (
    IncompatibleKeys,
    device_has_foreach_support,
    group_tensors_by_device_and_dtype,
    has_foreach_support,
)
from .packed import packed_parameters

__all__ = ["clip_grad_norm_", "get_full_state_dict", "load_full_state_dict"]


# ---------------------------------------------------------------- state dicts


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_full_state_dict(model: nn.Module, *, rank0_only: bool = False) -> Dict[str, Any]:
    r"""The state dict of the unsharded model, gathered from a parallelized one.

    Every DTensor (a sharded or replicated parameter) becomes its full tensor
    (``full_tensor()``: sharded ones are all-gathered over their mesh, uneven
    ``torch.chunk`` pieces included); plain parameters and buffers are taken
    as they are. The values are bit-for-bit those the
    unsharded model would hold: gathering only moves data. The result has the
    unsharded model's keys, in ``model.state_dict()``'s order, and can be saved
    with ``torch.save``, loaded into the unsharded model with
    ``load_state_dict``, or into a parallelized model of any world size with
    :func:`load_full_state_dict`.

    Every tensor is a new one, detached and on the device of the parameter or
    buffer it comes from (a CUDA model gives CUDA tensors: move them with
    ``.cpu()`` before saving if you need a device-independent file). A
    parameter registered under several keys (tied weights) is gathered once,
    and its keys share one tensor, as in the unsharded model's state dict.
    Non-tensor entries (``get_extra_state``) are passed through.

    This is a collective: every rank of every group that holds shards must call
    it, with structurally identical models.

    Args:
        model (nn.Module): a module parallelized by
            :func:`~torch_tp.parallelize_module` (an unparallelized module
            works too: its state dict is copied).

    Keyword Args:
        rank0_only (bool, optional): every rank takes part in the gathers, but
            only global rank 0 keeps the result; the others get ``{}`` (as
            torch's ``StateDictOptions(full_state_dict=True)`` with
            ``cpu_offload=True`` does). Default: ``False``.

    Returns:
        dict: an ``OrderedDict`` from the unsharded model's keys to full
        tensors (``{}`` on ranks other than 0 with ``rank0_only``). It
        carries the module's ``_metadata`` (version numbers), as
        ``state_dict()`` does.

    Example::

        >>> model = torch_tp.parallelize_module(Transformer(), tp_mesh, plan)
        >>> full = torch_tp.get_full_state_dict(model, rank0_only=True)
        >>> if dist.get_rank() == 0:
        ...     torch.save(full, "checkpoint.pt")
    """
    local = model.state_dict(keep_vars=True)
    keep = not rank0_only or _global_rank() == 0
    full: Dict[str, Any] = OrderedDict()
    done: Dict[int, torch.Tensor] = {}  # id(parameter or buffer) -> its full tensor
    with torch.no_grad():
        for key, value in local.items():
            if not isinstance(value, torch.Tensor):
                if keep:
                    full[key] = value
                continue
            if id(value) in done:
                if keep:
                    full[key] = done[id(value)]
                continue
            if isinstance(value, DTensor):
                # Every rank gathers, kept or not (the others wait on it), and
                # gathers each tensor once: the same calls in the same order.
                gathered = value.detach().full_tensor()
                if all(p.is_replicate() for p in value.placements):
                    gathered = gathered.clone()  # full_tensor() hands back the local tensor itself
            else:
                gathered = value.detach().clone() if keep else value
            done[id(value)] = gathered
            if keep:
                full[key] = gathered
    if not keep:
        return {}
    metadata = getattr(local, "_metadata", None)
    if metadata is not None:
        full._metadata = metadata  # type: ignore[attr-defined]
    return full


def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True) -> IncompatibleKeys:
    r"""Load the state dict of the unsharded model into a parallelized one.

    For a DTensor parameter, this rank's piece of the full tensor (for
    ``Shard(d)`` the ``torch.chunk`` piece :func:`~torch_tp.shard` cuts; for a
    packed parameter its chunk of every block; without communication) is
    copied into its local tensor in place;
    replicated parameters and buffers are copied whole. The parameters stay the
    same objects, so an optimizer built on them stays valid. Values are copied
    bit for bit (``copy_`` casts when the checkpoint has another dtype, as
    ``load_state_dict`` does).

    Every rank must hold the whole ``state_dict``; nothing is communicated.
    It is checked before anything is copied: a shape that differs from the
    unsharded one (a DTensor's global shape) is always
    an error, and with ``strict``, so is a missing or unexpected key. The
    copying itself is done by ``model.load_state_dict`` on the local pieces,
    so the module's load hooks and ``set_extra_state`` run as usual.

    Args:
        model (nn.Module): a module parallelized by
            :func:`~torch_tp.parallelize_module`.
        state_dict (Mapping[str, Any]): the unsharded model's state dict, for
            instance from :func:`get_full_state_dict` (with any world size) or
            from the unsharded model's ``state_dict()``.

    Keyword Args:
        strict (bool, optional): require the keys of ``state_dict`` to match
            the model's exactly. Default: ``True``.

    Returns:
        ``NamedTuple`` with ``missing_keys`` and ``unexpected_keys``, as
        ``nn.Module.load_state_dict`` returns.

    Raises:
        RuntimeError: naming every missing or unexpected key (``strict``) and
            every key whose shape differs, with both shapes.

    Example::

        >>> model = torch_tp.parallelize_module(Transformer(), tp_mesh, plan)
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> torch_tp.load_full_state_dict(model, torch.load("checkpoint.pt"))
    """
    local = model.state_dict(keep_vars=True)
    missing = [key for key in local if key not in state_dict]
    unexpected = [key for key in state_dict if key not in local]
    errors: List[str] = []
    if strict:
        if missing:
            errors.append("missing key(s) in state_dict: " + ", ".join(repr(k) for k in missing))
        if unexpected:
            errors.append("unexpected key(s) in state_dict: " + ", ".join(repr(k) for k in unexpected))

    packed = packed_parameters()
    parameters = dict(model.named_parameters(remove_duplicate=False))
    pieces: Dict[str, Any] = OrderedDict()
    for key, value in state_dict.items():
        target = local.get(key)
        if not isinstance(target, torch.Tensor):
            pieces[key] = value  # unexpected keys and extra state: load_state_dict sorts them out
            continue
        expected = tuple(target.shape)
        if not isinstance(value, torch.Tensor):
            errors.append(f"{key!r} should be a tensor of shape {expected}, got a {type(value).__name__}")
            continue
        if isinstance(value, DTensor):
            errors.append(f"{key!r} is a DTensor ({value.placements} on {value.device_mesh}); this function takes "
                          "full tensors (a DTensor state dict loads with model.load_state_dict or DCP)")
            continue
        if tuple(value.shape) != expected:
            where = (f"{target.placements[0]!r} on {target.device_mesh}" if isinstance(target, DTensor)
                     else "not sharded")
            errors.append(f"size mismatch for {key!r}: the state dict has shape {tuple(value.shape)}, "
                          f"the unsharded model has {expected} ({where})")
            continue
        if isinstance(target, DTensor) and id(parameters.get(key)) in packed:
            # A packed parameter (NOTE [packed parameters] in packed.py): its module's
            # load pre hook cuts this rank's chunk of every block from the full tensor.
            value = value.detach().to(target.device)
        elif isinstance(target, DTensor):
            # This rank's piece, cut locally (src_data_rank=None: no communication);
            # load_state_dict copies it into the parameter's local tensor.
            value = distribute_tensor(value.detach().to(target.device), target.device_mesh, target.placements,
                                      src_data_rank=None)
        pieces[key] = value
    if errors:
        raise RuntimeError(f"torch_tp.load_full_state_dict: error(s) loading the state dict into "
                           f"{type(model).__name__}:\n\t" + "\n\t".join(errors))
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        pieces._metadata = metadata  # type: ignore[attr-defined]
    # assign=False: param.copy_(piece) under no_grad, in place.
    return model.load_state_dict(pieces, strict=strict)


# ---------------------------------------------------------------- gradient clipping


def _norms(grads: List[torch.Tensor], norm_type: float, foreach: Optional[bool]) -> List[torch.Tensor]:
    """The norm of each tensor, computed as ``torch.nn.utils.get_total_norm`` computes it."""
    norms: List[torch.Tensor] = []
    grouped = group_tensors_by_device_and_dtype([grads])
    for (device, _), ([device_grads], _) in grouped.items():
        if (foreach is None and has_foreach_support(device_grads, device)) or (
                foreach and device_has_foreach_support(device)):
            norms.extend(torch._foreach_norm(device_grads, norm_type))
        elif foreach:
            raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
        else:
            norms.extend(torch.linalg.vector_norm(g, norm_type) for g in device_grads)
    return norms


def _partial(grads: List[torch.Tensor], norm_type: float, foreach: Optional[bool], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """``sum |g|^p`` (``max |g|`` for the inf-norm) over ``grads``, as a 0-d tensor."""
    # Empty shards add nothing (and torch cannot take the inf-norm of an empty tensor).
    grads = [g for g in grads if g.numel() > 0]
    if not grads:
        return torch.zeros((), dtype=dtype, device=device)
    norms = torch.stack([n.to(device=device, dtype=dtype) for n in _norms(grads, norm_type, foreach)])
    if norm_type == float("inf"):
        return norms.max()
    return norms.pow(norm_type).sum()


def clip_grad_norm_(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
) -> torch.Tensor:
    r"""Clip the gradients of a parallelized model by the norm of its unsharded gradients.

    ``torch.nn.utils.clip_grad_norm_`` for the DTensor parameters of a
    parallelized model, on their local tensors: the norm is that of all the
    unsharded gradients viewed as one vector, as ``clip_grad_norm_`` on the
    unsharded model computes it, and every gradient is scaled in place by
    ``min(max_norm / (total_norm + 1e-6), 1)`` (torch's ``clip_grads_with_norm_``).
    torch's own ``clip_grad_norm_`` gives the same result on these parameters
    through DTensor dispatch (and is what this calls for parameters on an N-D
    mesh, e.g. under FSDP2).

    For a p-norm, ``sum |g|^p`` over the local pieces of the ``Shard``
    gradients is all-reduced (sum) over their group, one all-reduce per group;
    the replicated gradients, the same on every rank, are counted once, without
    communication (a ``Partial`` gradient is completed first). The inf-norm takes maxima and all-reduces with max.
    Parameters without a gradient are skipped, and a rank holding an empty
    piece contributes nothing. Every rank returns the same total norm. The sum
    runs in a different order than on one process, so the total matches
    torch's to float rounding (about 1e-7 relative in float32), not bit for bit.

    This is a collective over the groups of the sharded parameters: every rank
    must call it with structurally the same ``parameters`` (which parameters
    have gradients may differ).

    Args:
        parameters (Iterable[Tensor] or Tensor): the parameters of a model
            parallelized by :func:`~torch_tp.parallelize_module` (DTensors or
            plain tensors); their gradients are modified in place.
        max_norm (float): max norm of the gradients.
        norm_type (float, optional): type of the used p-norm; ``p > 0`` or
            ``'inf'`` for the infinity norm. Default: 2.0.
        error_if_nonfinite (bool, optional): if ``True``, raise when the total
            norm is ``nan``, ``inf`` or ``-inf`` (on every rank, before any
            gradient is scaled). Default: ``False``.
        foreach (bool, optional): use the foreach implementation; ``None``
            picks it where the device supports it, as torch does.

    Returns:
        Tensor: the total norm of the unsharded gradients (viewed as a single
        vector), a 0-d tensor, the same on every rank.

    Example::

        >>> loss = model(ids).square().mean()
        >>> loss.backward()
        >>> total = torch_tp.clip_grad_norm_(model.parameters(), max_norm=1.0)
        >>> optimizer.step()
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    else:
        is_generator = isinstance(parameters, types.GeneratorType)
        parameters = list(parameters)
        if is_generator and not parameters:
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=2)
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"torch_tp.clip_grad_norm_: norm_type must be a p-norm with p > 0 or 'inf', got {norm_type}")

    if any(isinstance(p, DTensor) and p.device_mesh.ndim != 1 for p in parameters):
        # N-D meshes (FSDP2 x TP): torch's DTensor clipping knows those layouts.
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)

    with torch.no_grad():
        # Local tensors only. The groups come from every parameter, with a
        # gradient or not, so that all ranks run the same all-reduces in the
        # same order.
        replicated: List[torch.Tensor] = []  # complete gradients, the same on every rank: counted once
        groups: Dict[str, Tuple[List[torch.Tensor], List[torch.Tensor]]] = {}  # group name -> (params, grads)
        local_grads: List[torch.Tensor] = []  # every gradient's local tensor, scaled at the end
        for param in parameters:
            grad = param.grad
            if isinstance(grad, DTensor):
                if grad.placements != param.placements:  # pending Partial sums: complete them first
                    param.grad = grad = grad.redistribute(placements=param.placements)
                grad = grad.to_local()
            if grad is not None:
                local_grads.append(grad)
            if not (isinstance(param, DTensor) and isinstance(param.placements[0], Shard)):
                if grad is not None:
                    replicated.append(grad)
                continue
            params, grads = groups.setdefault(param.device_mesh.get_group().group_name, ([], []))
            params.append(param.to_local())
            if grad is not None:
                grads.append(grad)

        all_grads = replicated + [g for _, grads in groups.values() for g in grads]
        if not all_grads and not groups:
            return torch.tensor(0.0)
        # The result has the dtype torch's would have (the grads' promoted
        # dtype); the partial sums accumulate in at least float32, in a dtype
        # and on a device that every rank of a group agrees on (from the params).
        result_dtype = torch.float32
        if all_grads:
            result_dtype = all_grads[0].dtype
            for g in all_grads[1:]:
                result_dtype = torch.promote_types(result_dtype, g.dtype)
        device = all_grads[0].device if all_grads else next(iter(groups.values()))[0][0].device
        inf = norm_type == float("inf")

        partials: List[torch.Tensor] = []
        if replicated:
            partials.append(_partial(replicated, norm_type, foreach, torch.promote_types(result_dtype, torch.float32),
                                     device))
        for name, (params, grads) in groups.items():
            dtype = torch.float32
            for p in params:
                dtype = torch.promote_types(dtype, p.dtype)
            group_device = params[0].device
            local = _partial(grads, norm_type, foreach, dtype, group_device)
            if inf:
                # gloo's max need not propagate NaN; reduce a NaN flag beside the value.
                flagged = torch.stack([local, local.isnan().to(dtype)])
                reduced = torch.ops.torch_tp.all_reduce(flagged, "max", name)
                local = torch.where(reduced[1] > 0, torch.full_like(reduced[0], float("nan")), reduced[0])
            else:
                local = torch.ops.torch_tp.all_reduce(local.reshape(1), "sum", name).reshape(())
            partials.append(local.to(device))

        acc = torch.stack([p.to(torch.promote_types(p.dtype, result_dtype)) for p in partials])
        if inf:
            total = acc.max()  # propagates NaN
        else:
            total = acc.sum().pow(1.0 / norm_type)
        total_norm = total.to(result_dtype)

        if error_if_nonfinite and torch.logical_or(total_norm.isnan(), total_norm.isinf()):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from "
                "`parameters` is non-finite, so it cannot be clipped. To disable "
                "this error and scale the gradients by the non-finite norm anyway, "
                "set `error_if_nonfinite=False`")
        # torch's own scaling (clip_grads_with_norm_) on the local tensors:
        # grad *= clamp(max_norm / (total_norm + 1e-6), max=1).
        if not local_grads:
            return total_norm
        clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        for (device, _), ([device_grads], _) in group_tensors_by_device_and_dtype([local_grads]).items():
            if (foreach is None and has_foreach_support(device_grads, device)) or (
                    foreach and device_has_foreach_support(device)):
                torch._foreach_mul_(device_grads, clip_coef.to(device))
            elif foreach:
                raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
            else:
                for g in device_grads:
                    g.mul_(clip_coef.to(device))
    return total_norm
