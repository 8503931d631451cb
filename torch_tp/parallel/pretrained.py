"""Hugging Face checkpoints read and written shard by shard: :func:`load_pretrained`, :func:`save_pretrained`.

A ``save_pretrained`` directory holds ``config.json`` and the weights in safetensors files:
one ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` listed by
``model.safetensors.index.json`` (``weight_map``: tensor name -> file). A safetensors file is
an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape and byte
range in the data), then the tensors' bytes, row-major, one after another.

NOTE [reading only this rank's slices]
A parameter a style sharded is a DTensor whose local tensor is, on each mesh dim that
``Shard(d)``s it, the ``torch.chunk`` piece of dim ``d`` at this rank's coordinate (in mesh-dim
order, as DTensor nests them). That piece is a box of the full tensor: a range of each dim.
``safe_open(...).get_slice(name)[box]`` reads just those bytes from the file, so a rank reads
its shard and the replicated tensors, never a full sharded tensor. A packed parameter (NOTE
[packed parameters] in packed.py) is not one box but one per block (this rank's chunk of each
block, concatenated along the packed dim), read block by block into its local tensor, on a 1-D
mesh and on an (ep, tp) mesh alike. What fits neither (``_StridedShard`` under FSDP2) is read
whole and cut locally, as :func:`~torch_tp.load_full_state_dict` cuts it. A rank's resident memory
grows by what it keeps, not by what it touched: what is copied is read under its own ``safe_open``
or ``os.preadv``, and what is mapped touches only its own pages.

NOTE [reading a box straight into its tensor]
A box is a set of byte ranges of the file: one for a ``Shard(0)`` piece, a whole tensor or a
block of a packed ``Shard(0)`` parameter, one per row for a ``Shard(1)`` piece. When the local
tensor it goes to is a contiguous CPU tensor of the checkpoint's dtype, each range is read with
``os.preadv`` into its place in that tensor's memory: the kernel copies the bytes from the page
cache as it faults the tensor's pages in. Copying from the memory map instead faults each page
twice, once on each side, which costs about twice as long. Other boxes (another dtype or
device, or more ranges than ``_MAX_RUNS``) are read through ``safe_open`` and copied.

NOTE [local tensors that map the file]
A box of one byte range is not read at all when it can be mapped (``mmap=True``, the default, as
``from_pretrained`` maps): the local tensor becomes a view of the file's private memory map
(``torch.UntypedStorage.from_file(file, shared=False)``, one per file and load). Each page is then
read from the page cache at its first use, which costs a fraction of faulting in a fresh page and
copying into it, and ranks of one node share the page-cache pages they both read until one of
them writes. A write (an optimizer step) copies the page it touches: the mapping is
copy-on-write, the file never changes. A box of several ranges (a ``Shard(1)`` piece, a packed
parameter's blocks) is still read into memory: a view of it would keep mapped every page its rows
touch, which for short rows is the whole tensor.
Only a model this call materializes is mapped: its local tensors are fresh, so nothing else holds
their storage; not one under FSDP2, whose sharded parameters are views of its own padded buffers.
The hazard of a mapping is a file rewritten in place (truncated, then written) while the model
lives: the pages the model has not written yet change, or vanish (SIGBUS). A file replaced (a
new file renamed over it, or the old one deleted first) is safe, as the mapping keeps the old one:
:func:`save_pretrained` writes each file under a temporary name and renames it over, so a model
can be saved into the directory it was loaded from. ``mmap=False`` copies every box and keeps no
file mapped.

transformers renames some checkpoint keys at load time and converts others (per-expert
tensors merged into one 3-D experts tensor): its conversion mapping for the model
(``get_model_conversion_mapping``). :func:`load_pretrained` renames keys as
``from_pretrained`` does; a converted tensor is built from its sources read whole (a
conversion reads all its inputs) and then cut like any other. :func:`save_pretrained` undoes
them as ``save_pretrained`` does (``revert_weight_conversion``), one tensor at a time.
"""

import json
import os
import re
import struct
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from .._torch_private import dtensor_local
from ..ops import chunk_range
from .packed import PackedLayout, packed_parameters

__all__ = ["load_pretrained", "save_pretrained"]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

# safetensors' dtype names (the format's header field "dtype").
_DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


class LoadResult(NamedTuple):
    """What :func:`load_pretrained` did not load (with ``strict=False``), as ``load_state_dict``
    reports it: model keys the checkpoint lacks, checkpoint keys the model lacks."""

    missing_keys: List[str]
    unexpected_keys: List[str]


# ---------------------------------------------------------------- the model's tensors


def _model_tensors(model: nn.Module) -> "OrderedDict[str, torch.Tensor]":
    """Key -> parameter or persistent buffer, in ``state_dict()``'s keys and order, without
    calling ``state_dict()`` (its packed-parameter hook communicates, and a meta model has no
    values). A tied tensor appears under each of its keys."""
    tensors: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for name, param in module._parameters.items():
            if param is not None:
                tensors[dot + name] = param
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                tensors[dot + name] = buffer
    return tensors


def _hf_model(model: nn.Module):
    """transformers' PreTrainedModel class if ``model`` is one (transformers is then imported
    already), else None: torch_tp does not depend on transformers."""
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        return transformers
    return None


def _ignored(patterns, key: str) -> bool:
    return any(re.search(pattern, key) for pattern in patterns or ())


# ---------------------------------------------------------------- reading files


def _safe_open(file: str):
    from safetensors import safe_open

    try:
        return safe_open(file, framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own SafetensorError, and OSError
        raise RuntimeError(f"torch_tp.parallel.load_pretrained: cannot read {file!r}, a truncated or corrupt "
                           f"safetensors file? ({e})") from e


def _checkpoint_files(path: str) -> Dict[str, str]:
    """Checkpoint key -> the file that holds it, from the index or the single file."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"torch_tp.parallel.load_pretrained: no such directory: {path!r}")
    index = os.path.join(path, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError) as e:
            raise RuntimeError(f"torch_tp.parallel.load_pretrained: {index!r} is not a safetensors index "
                               f"(a JSON object with a 'weight_map'): {e}") from e
        return {key: os.path.join(path, name) for key, name in weight_map.items()}
    single = os.path.join(path, SAFE_WEIGHTS_NAME)
    if os.path.isfile(single):
        with _safe_open(single) as f:
            return {key: single for key in f.keys()}
    raise FileNotFoundError(f"torch_tp.parallel.load_pretrained: {path!r} holds neither {SAFE_WEIGHTS_INDEX_NAME} nor "
                            f"{SAFE_WEIGHTS_NAME} (a directory written by save_pretrained)")


def _headers(files: Dict[str, str]) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """Checkpoint key -> (shape, file), every file opened (and so checked) once; a key the index
    lists that its file lacks is an error."""
    by_file: Dict[str, List[str]] = {}
    for key, file in files.items():
        by_file.setdefault(file, []).append(key)
    found: Dict[str, Tuple[Tuple[int, ...], str]] = {}
    for file, keys in by_file.items():
        if not os.path.isfile(file):
            raise FileNotFoundError(f"torch_tp.parallel.load_pretrained: the index lists {file!r}, which does not exist")
        with _safe_open(file) as f:
            held = set(f.keys())
            lacking = [key for key in keys if key not in held]
            if lacking:
                raise RuntimeError(f"torch_tp.parallel.load_pretrained: the index places {lacking} in {file!r}, "
                                   "which does not hold them")
            for key in keys:
                found[key] = (tuple(f.get_slice(key).get_shape()), file)
    return found


Box = Tuple[Tuple[int, int], ...]  # (start, length) of each dim


def _read_box(file: str, key: str, box: Optional[Box]) -> torch.Tensor:
    """The tensor ``key`` of ``file``, or the box of it (NOTE [reading only this rank's slices])."""
    with _safe_open(file) as f:
        if box is None or not box:
            return f.get_tensor(key)
        return f.get_slice(key)[tuple(slice(start, start + length) for start, length in box)]


def _data_offsets(file: str) -> Dict[str, Tuple[str, Tuple[int, ...], int]]:
    """Each tensor of a safetensors file (whose header safe_open has checked): its dtype name,
    shape and the file offset of its first byte (the layout in the module docstring)."""
    with open(file, "rb") as f:
        length = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(length))
    return {key: (info["dtype"], tuple(info["shape"]), 8 + length + info["data_offsets"][0])
            for key, info in header.items() if key != "__metadata__"}


def _element_runs(shape: Tuple[int, ...], box: Optional[Box]) -> Tuple[List[int], int]:
    """``box`` of a row-major tensor of ``shape`` as runs of consecutive elements, in the box's own
    row-major order: (each run's first element, the run's length). The dims after the last
    partial one are whole, so a run is that dim's range times their size; one run per index of
    the dims before it."""
    box = box or tuple((0, size) for size in shape)
    partial = max((d for d, (range_, size) in enumerate(zip(box, shape)) if range_ != (0, size)), default=0)
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    run = (box[partial][1] if shape else 1) * (strides[partial] if shape else 1)
    starts = [box[partial][0] * strides[partial] if shape else 0]
    for d in range(partial - 1, -1, -1):  # outer dims: each index repeats the inner runs
        first, length = box[d]
        starts = [(first + i) * strides[d] + inner for i in range(length) for inner in starts]
    return starts, run


# More runs than this (a box of short pieces of many rows) go through safe_open: one system call
# per run would cost more than the copy it saves.
_MAX_RUNS = 1 << 16


class _Files:
    """What one load knows of the checkpoint's files: their data offsets (:func:`_data_offsets`),
    read once per file, and, if it maps them (NOTE [local tensors that map the file]), their
    private memory maps."""

    def __init__(self, mapped: bool):
        self.mapped = mapped
        self._offsets: Dict[str, Dict[str, Tuple[str, Tuple[int, ...], int]]] = {}
        self._maps: Dict[str, torch.UntypedStorage] = {}

    def offsets(self, file: str) -> Dict[str, Tuple[str, Tuple[int, ...], int]]:
        if file not in self._offsets:
            self._offsets[file] = _data_offsets(file)
        return self._offsets[file]

    def mapping(self, file: str) -> torch.UntypedStorage:
        if file not in self._maps:
            self._maps[file] = torch.UntypedStorage.from_file(file, False, os.path.getsize(file))
        return self._maps[file]


class _FileTensor:
    """Tensor ``key`` of a checkpoint file, read whole or by boxes, or mapped."""

    def __init__(self, file: str, key: str, files: _Files):
        self.file, self.key, self.files = file, key, files

    def read(self, box: Optional[Box]) -> torch.Tensor:
        return _read_box(self.file, self.key, box)

    def _file_runs(self, box: Optional[Box], like: torch.Tensor) -> Optional[Tuple[List[int], int]]:
        """The box as byte ranges of the file, in ``like``'s row-major order: (each range's file offset,
        the range's length), if ``like`` is a non-empty contiguous CPU tensor of the checkpoint's dtype
        that the ranges fill; else None."""
        if like.device.type != "cpu" or not like.is_contiguous() or like.numel() == 0:
            return None
        dtype, shape, start = self.files.offsets(self.file)[self.key]
        if _DTYPE_NAMES.get(like.dtype) != dtype:
            return None
        starts, run = _element_runs(shape, box)
        if len(starts) * run != like.numel():
            return None
        size = like.element_size()
        return [start + first * size for first in starts], run * size

    def mapped(self, box: Optional[Box], like: torch.Tensor) -> Optional[torch.Tensor]:
        """The box as a view of the file's memory map, of ``like``'s shape, if the load maps files
        and the box is one byte range of ``like``'s dtype, for a contiguous CPU ``like`` (NOTE
        [local tensors that map the file]); else None."""
        runs = self._file_runs(box, like) if self.files.mapped else None
        if runs is None or len(runs[0]) != 1 or runs[0][0] % like.element_size():
            return None
        first = runs[0][0] // like.element_size()
        return torch.empty(0, dtype=like.dtype).set_(self.files.mapping(self.file), first, like.shape)

    def read_into(self, box: Optional[Box], out: torch.Tensor) -> None:
        """``out.copy_(self.read(box))``, straight from the file where it can be (NOTE [reading a box
        straight into its tensor])."""
        runs = self._file_runs(box, out)
        if runs is None or len(runs[0]) > _MAX_RUNS:
            out.copy_(self.read(box))
            return
        offsets, run = runs
        memory = memoryview(out.view(-1).view(torch.uint8).numpy())
        fd = os.open(self.file, os.O_RDONLY)
        try:
            for i, offset in enumerate(offsets):  # each run into its place in out (out is the box, row-major)
                piece, done = memory[i * run:(i + 1) * run], 0
                while done < len(piece):  # preadv may return fewer bytes than asked (large reads)
                    got = os.preadv(fd, [piece[done:]], offset + done)
                    if got == 0:
                        raise RuntimeError(f"torch_tp.parallel.load_pretrained: {self.file!r} ends inside tensor "
                                           f"{self.key!r} (a truncated safetensors file?)")
                    done += got
        finally:
            os.close(fd)


class _InMemory:
    """A tensor already in memory (a converted one), read by boxes."""

    def __init__(self, full: torch.Tensor):
        self.full = full

    def read(self, box: Optional[Box]) -> torch.Tensor:
        if box is None:
            return self.full
        piece = self.full
        for dim, (start, length) in enumerate(box):
            piece = piece.narrow(dim, start, length)
        return piece

    def mapped(self, box: Optional[Box], like: torch.Tensor) -> None:
        return None

    def read_into(self, box: Optional[Box], out: torch.Tensor) -> None:
        out.copy_(self.read(box))


# ---------------------------------------------------------------- where each rank's values come from


def _dtensor_box(param: DTensor) -> Optional[Box]:
    """The box of the full tensor this rank's local tensor holds, if every placement is
    ``Shard`` or ``Replicate`` (None otherwise)."""
    coordinate = param.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    box = [(0, size) for size in param.shape]
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_replicate():
            continue
        if type(placement) is not Shard:
            return None
        start, length = box[placement.dim]
        offset, length = chunk_range(length, param.device_mesh.size(mesh_dim), coordinate[mesh_dim])
        box[placement.dim] = (start + offset, length)
    if tuple(length for _, length in box) != tuple(dtensor_local(param).shape):
        return None
    return tuple(box)


def _packed_boxes(param: DTensor, layout: PackedLayout) -> Optional[List[Tuple[Box, int]]]:
    """For a packed parameter: (box of the full natural tensor, offset along the packed dim in the
    local tensor) of each block's chunk on this rank. The packed dim is split by the one mesh dim
    of the layout's degree (the TP dim); the others may ``Shard`` other dims (the experts dim on an
    (ep, tp) mesh) or replicate. None for any other layout."""
    coordinate = param.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    box, rank = [(0, n) for n in param.shape], None
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_replicate():
            continue
        if type(placement) is not Shard:
            return None
        if placement.dim == layout.dim:
            if rank is not None or param.device_mesh.size(mesh_dim) != layout.degree:
                return None
            rank = coordinate[mesh_dim]
            continue
        start, length = box[placement.dim]
        offset, length = chunk_range(length, param.device_mesh.size(mesh_dim), coordinate[mesh_dim])
        box[placement.dim] = (start + offset, length)
    if rank is None:
        return None
    pieces, natural, local = [], 0, 0
    for size in layout.blocks:
        chunk = size // layout.degree
        box[layout.dim] = (natural + rank * chunk, chunk)
        pieces.append((tuple(box), local))
        natural += size
        local += chunk
    return pieces


def _read_or_map(source, box: Optional[Box], local: torch.Tensor) -> None:
    """``local`` (a plain tensor) holds the box of ``source``: a view of the file put in place of
    its storage where the box can be mapped, else the box read into it."""
    view = source.mapped(box, local)
    if view is None:
        source.read_into(box, local.detach())  # a plain parameter requires grad
    else:
        local.data = view


def _fill(param: torch.Tensor, source, packed: Dict[int, Tuple[torch.Tensor, PackedLayout]]) -> None:
    """Give the local tensor of ``param`` this rank's values (from ``source``, a :class:`_FileTensor`
    or :class:`_InMemory`), written in place or mapped (casting to the parameter's dtype, as
    loading does)."""
    if not isinstance(param, DTensor):
        _read_or_map(source, None, param)
        return
    local = dtensor_local(param)
    if id(param) in packed:
        layout = packed[id(param)][1]
        pieces = _packed_boxes(param, layout)
        if pieces is None:
            local.copy_(dtensor_local(layout.to_rank_major(source.read(None), param)))
            return
        for box, offset in pieces:
            source.read_into(box, local.narrow(layout.dim, offset, box[layout.dim][1]))
        return
    box = _dtensor_box(param)
    if box is None:
        full = source.read(None).to(param.device)
        local.copy_(dtensor_local(distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)))
    elif all(length > 0 for _, length in box):
        _read_or_map(source, box, local)


@dataclass
class _Plan:
    """Which checkpoint tensors fill which model keys: ``direct`` one to one, ``converted`` through
    one of transformers' converters (its target keys, its (checkpoint key, pattern) sources)."""

    direct: Dict[str, str] = field(default_factory=dict)  # model key -> checkpoint key
    converted: List[Tuple[object, str, List[Tuple[str, str]]]] = field(default_factory=list)
    unexpected: List[str] = field(default_factory=list)


def _plan(model: nn.Module, tensors: Dict[str, torch.Tensor], checkpoint: Dict[str, Tuple[Tuple[int, ...], str]]):
    """Map checkpoint keys to model keys as ``from_pretrained`` maps them."""
    plan = _Plan()
    transformers = _hf_model(model)
    if transformers is None:
        for key in checkpoint:
            if key in tensors:
                plan.direct[key] = key
            else:
                plan.unexpected.append(key)
        return plan, []

    from copy import deepcopy

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    prefix = getattr(model, "base_model_prefix", None)
    groups: Dict[str, Tuple[object, List[Tuple[str, str]]]] = {}
    for key in sorted(checkpoint, key=dot_natural_key):  # experts in index order, as HF merges them
        target, pattern = rename_source_key(key, renamings, converters, prefix, tensors)
        if target not in tensors and key in tensors:  # the key needed no renaming, only the prefix
            target, pattern = rename_source_key(key, [], [], prefix, tensors)
        if target not in tensors:
            plan.unexpected.append(key)
        elif pattern is None:
            plan.direct[target] = key
        else:
            converter, sources = groups.setdefault(target, (deepcopy(by_pattern[pattern]), []))
            sources.append((key, pattern))
    plan.converted = [(converter, target, sources) for target, (converter, sources) in groups.items()]
    return plan, mapping


def _convert(model, converter, target: str, sources, make: Callable[[str], torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Run one of transformers' converters on the tensors ``make(key)`` of its sources."""
    from copy import deepcopy

    converter = deepcopy(converter)
    for key, pattern in sources:
        converter.add_tensor(target, key, pattern, make(key))
    converted = converter.convert(target, model=model, config=getattr(model, "config", None))
    return {name: value[0] if isinstance(value, list) else value for name, value in converted.items()}


def _materialize(model: nn.Module, device: Optional[Union[str, torch.device]]) -> bool:
    """Give a meta-device model storage on ``device`` (by default, the device of its meshes); whether
    it was on the meta device."""
    if not any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        return False
    if device is None:
        device = "cpu"
        for param in model.parameters():
            if isinstance(param, DTensor) and param.device_mesh.device_type != "cpu":
                kind = param.device_mesh.device_type
                device = torch.device(kind, getattr(torch, kind).current_device())
                break
    # to_empty gives a plain parameter a new object per key, which unties tied weights (a
    # DTensor's contents are swapped in place): tie them again as they were.
    first: Dict[int, Tuple[nn.Module, str]] = {}
    tied = []
    for _, module in model.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is not None:
                if id(param) in first:
                    tied.append((module, name, first[id(param)]))
                else:
                    first[id(param)] = (module, name)
    model.to_empty(device=device)
    for module, name, (source, source_name) in tied:
        module._parameters[name] = source._parameters[source_name]
    return True


def load_pretrained(model: nn.Module, path: str, *, strict: bool = True,
                    device: Optional[Union[str, torch.device]] = None, mmap: bool = True) -> LoadResult:
    r"""Load a Hugging Face ``save_pretrained`` directory into a parallelized model, each rank
    reading only its slices.

    ``model`` is typically built on the meta device and parallelized (any plan torch_tp takes:
    HF plan strings, style objects, :func:`~torch_tp.parallel.packed_tp_plan`, fewer KV heads than
    ranks, tied embeddings), then loaded::

        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        torch_tp.parallelize_module(model, tp_mesh, model.tp_plan)
        torch_tp.parallel.load_pretrained(model, path)

    A model with meta tensors is first given storage (``to_empty``) on ``device``. Each parameter
    and persistent buffer then gets its values from the checkpoint, each rank reading from
    disk only the slices it holds (NOTE [reading only this rank's slices] in this file);
    checkpoint keys are renamed and converted as transformers' ``from_pretrained`` does, and
    values are cast to the model's dtypes. Afterwards the parameters equal, bit for bit, those of
    ``from_pretrained`` followed by ``parallelize_module``. For a transformers model, what the
    checkpoint does not hold (non-persistent buffers such as rotary frequencies) is initialized
    by ``model.initialize_weights()`` as ``from_pretrained`` initializes it, and
    ``generation_config.json``, if present, becomes ``model.generation_config``.

    Every rank must call it, with the same model and path; it does not communicate.

    Args:
        model (nn.Module): a model parallelized by :func:`~torch_tp.parallelize_module` (or not
            parallelized at all), on the meta device or materialized.
        path (str): a directory written by ``save_pretrained`` (transformers' or
            :func:`save_pretrained`).

    Keyword Args:
        strict (bool): a model key the checkpoint lacks, or a checkpoint key the model lacks, is an
            error (transformers' ``_keys_to_ignore_on_load_*`` patterns excepted). With ``False``
            they are returned, and missing parameters of a transformers model are initialized as
            ``from_pretrained`` initializes them. A shape mismatch is always an error.
            Default: ``True``.
        device: where a meta-device model is materialized; by default the device type of its
            DTensors' mesh (the current device of it), else CPU.
        mmap (bool): as ``from_pretrained`` does, a meta-device model materialized on the CPU
            keeps each local tensor that is one byte range of a file (a whole tensor, a
            ``Shard(0)`` piece) as a copy-on-write view of the file's memory map, read at first
            use; writes never reach the file. Rewriting such a file in place (truncating it)
            while the model lives corrupts the model; replacing it, as :func:`save_pretrained`
            does, is safe (NOTE [local tensors that map the file]). ``False`` copies every
            tensor into memory and keeps no file mapped. Default: ``True``.

    Returns:
        ``NamedTuple`` with ``missing_keys`` and ``unexpected_keys``.

    Raises:
        FileNotFoundError: the directory, or a file its index lists, does not exist.
        RuntimeError: a truncated or corrupt file (naming it); a checkpoint that does not match
            the model, every missing, unexpected and mis-shaped tensor listed with the file and
            both shapes. Both are found before anything is loaded or materialized.
    """
    tensors = _model_tensors(model)
    checkpoint = _headers(_checkpoint_files(path))
    plan, mapping = _plan(model, tensors, checkpoint)
    transformers = _hf_model(model)

    # Shapes, including those converters produce (run on meta tensors of the sources' shapes).
    errors: List[str] = []
    for target, key in plan.direct.items():
        shape, file = checkpoint[key]
        if shape != tuple(tensors[target].shape):
            errors.append(f"{key!r} in {file!r} has shape {shape}, the model's {target!r} has "
                          f"{tuple(tensors[target].shape)}")
    filled = set(plan.direct)
    for converter, target, sources in plan.converted:
        meta = _convert(model, converter, target, sources,
                        lambda key: torch.empty(checkpoint[key][0], device="meta"))
        for name, value in meta.items():
            if name not in tensors:
                plan.unexpected.append(name)
            elif tuple(value.shape) != tuple(tensors[name].shape):
                errors.append(f"{name!r}, converted from {[key for key, _ in sources]} in "
                              f"{sorted({checkpoint[key][1] for key, _ in sources})}, has shape "
                              f"{tuple(value.shape)}, the model's has {tuple(tensors[name].shape)}")
            else:
                filled.add(name)
    # A tied tensor is loaded once, under any of its keys.
    loaded_ids = {id(tensors[key]) for key in filled}
    missing = [key for key in tensors if key not in filled and id(tensors[key]) not in loaded_ids]
    unexpected = list(plan.unexpected)
    if transformers is not None:
        missing = [k for k in missing if not _ignored(model._keys_to_ignore_on_load_missing, k)]
        # As from_pretrained: old checkpoints hold rotary tables and position ids that are buffers no more.
        ignore = set(model._keys_to_ignore_on_load_unexpected or ()) | {r"rotary_emb\.inv_freq", r"(^|\.)position_ids$"}
        unexpected = [k for k in unexpected if not _ignored(ignore, k)]
    if strict:
        if missing:
            errors.append(f"missing from the checkpoint: {missing}")
        if unexpected:
            errors.append(f"not in the model: {unexpected}")
    if errors:
        raise RuntimeError(f"torch_tp.parallel.load_pretrained: {path!r} does not match {type(model).__name__} "
                           "(nothing was loaded):\n\t" + "\n\t".join(errors))

    from torch.distributed.fsdp import FSDPModule

    fresh = _materialize(model, device) and not any(isinstance(m, FSDPModule) for m in model.modules())
    files = _Files(mapped=mmap and fresh)
    tensors = _model_tensors(model)  # to_empty may have swapped tensors
    packed = packed_parameters()
    done = set()
    with torch.no_grad():
        for target, key in plan.direct.items():
            if id(tensors[target]) not in done:
                _fill(tensors[target], _FileTensor(checkpoint[key][1], key, files), packed)
                done.add(id(tensors[target]))
        for converter, target, sources in plan.converted:
            converted = _convert(model, converter, target, sources,
                                 lambda key: _read_box(checkpoint[key][1], key, None))
            for name, value in converted.items():
                if name in tensors and id(tensors[name]) not in done:
                    _fill(tensors[name], _InMemory(value), packed)
                    done.add(id(tensors[name]))
            del converted

    if transformers is not None:
        # As from_pretrained: what was loaded is marked initialized, and initialize_weights
        # initializes the rest (non-persistent buffers; missing parameters with strict=False).
        for key in filled:
            tensors[key]._is_hf_initialized = True
        model._weight_conversions = [t for t in mapping]
        model.initialize_weights()
        generation_config = os.path.join(path, "generation_config.json")
        if model.can_generate() and os.path.isfile(generation_config):
            model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    return LoadResult(missing, unexpected)


# ---------------------------------------------------------------- writing


def _full_pieces(value: torch.Tensor, packed: Dict[int, Tuple[torch.Tensor, PackedLayout]]) -> Iterator[torch.Tensor]:
    """The unsharded tensor of a parameter or buffer, as contiguous pieces whose bytes, one after
    another, are its row-major bytes. A collective for a DTensor: every rank runs it."""
    if not isinstance(value, DTensor):
        yield value.detach()
        return
    full = value.detach().full_tensor()  # a replicated DTensor's is its local tensor
    if id(value) not in packed:
        yield full
        return
    layout = packed[id(value)][1]
    if layout.dim == 0:
        # Rank-major rows [block chunks of rank 0 | of rank 1 | ...]: natural order is each
        # block's chunks in rank order, rows that stay contiguous.
        local = full.shape[0] // layout.degree
        offset = 0
        for size in layout.blocks:
            chunk = size // layout.degree
            for rank in range(layout.degree):
                yield full.narrow(0, rank * local + offset, chunk)
            offset += chunk
    else:
        # Packed columns: reorder a block of rows at a time.
        index = layout.rank_major_index(full.device).argsort()
        rows = max(1, (1 << 24) // max(1, full[0].numel() * full.element_size()))
        for start in range(0, full.shape[0], rows):
            yield full[start:start + rows].index_select(layout.dim, index)


def _write_bytes(f, tensor: torch.Tensor) -> None:
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.numel():
        f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _header(entries: Sequence[Tuple[str, torch.dtype, Tuple[int, ...]]]) -> bytes:
    header, offset = {}, 0
    for name, dtype, shape in entries:
        if dtype not in _DTYPE_NAMES:
            raise TypeError(f"torch_tp.parallel.save_pretrained: {name!r} has dtype {dtype}, which safetensors cannot hold")
        size = _nbytes(torch.empty(shape, dtype=dtype, device="meta"))
        header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def save_pretrained(model: nn.Module, path: str, *, max_shard_size: Union[int, str] = "50GB") -> None:
    r"""Write a parallelized transformers model as a ``save_pretrained`` directory, gathering one
    tensor at a time.

    The directory is what transformers' ``save_pretrained`` writes: ``config.json``
    (``generation_config.json`` for a model that generates), and the unsharded weights in
    safetensors files (``model.safetensors``, or numbered shards of at most ``max_shard_size``
    with ``model.safetensors.index.json``), under the checkpoint's names (transformers' weight
    conversions undone, as its ``save_pretrained`` undoes them); tied weights once.
    ``from_pretrained`` loads it unsharded, and :func:`load_pretrained` at any degree.

    Each tensor is gathered (``full_tensor()``, packed parameters put back in their natural order)
    and written by global rank 0 before the next is gathered, so no rank holds more than one
    full tensor at a time. It is a collective: every rank calls it with the same model (a
    pipeline stage writes nothing of the other stages). It returns once the files are written.
    Each file is written under a temporary name and renamed into place, so a model that maps the
    files it was loaded from (:func:`load_pretrained`'s ``mmap``) can be saved over them.

    Args:
        model: a transformers model parallelized by :func:`~torch_tp.parallelize_module` (SP,
            packed blocks, replicated KV heads included), or an unparallelized one.
        path (str): the directory, created if needed.

    Keyword Args:
        max_shard_size (int or str): the largest a file may grow (a tensor larger than it gets a
            file of its own), as transformers' ``save_pretrained`` takes it. Default: ``"50GB"``.
    """
    transformers = _hf_model(model)
    if transformers is None:
        raise TypeError(f"torch_tp.parallel.save_pretrained: the model is a {type(model).__name__}, not a transformers "
                        "PreTrainedModel (a save_pretrained directory needs its config)")
    from huggingface_hub.serialization import split_state_dict_into_shards_factory
    from transformers.core_model_loading import revert_weight_conversion

    writer = not dist.is_initialized() or dist.get_rank() == 0
    tensors = _model_tensors(model)
    ignore = set(model._keys_to_ignore_on_save or ())
    seen, keys = set(), []
    for key, value in tensors.items():  # a tied tensor once, under its first key
        if key not in ignore and id(value) not in seen:
            seen.add(id(value))
            keys.append(key)

    def revert(key: str, value: torch.Tensor) -> Dict[str, torch.Tensor]:
        return revert_weight_conversion(model, {key: value})

    # Each model key's checkpoint names, shapes and dtypes: its conversion undone on a meta tensor.
    meta = {key: torch.empty(tensors[key].shape, dtype=tensors[key].dtype, device="meta") for key in keys}
    saved = {key: revert(key, meta[key]) for key in keys}
    # transformers reverts the whole state dict at once (which sets the names' order) and splits
    # the files on the result, keeping tensors that share a storage (views a conversion made of
    # one tensor) in one file: the same split here, on meta tensors, whose views share storage too.
    whole = revert_weight_conversion(model, meta)
    if set(whole) != {name for key in keys for name in saved[key]}:
        raise NotImplementedError("torch_tp.parallel.save_pretrained: transformers' conversion of "
                                  f"{type(model).__name__} builds checkpoint tensors from several model tensors")
    split = split_state_dict_into_shards_factory(
        whole, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size,
        get_storage_id=lambda t: t.untyped_storage()._cdata, get_storage_size=lambda t: t.untyped_storage().nbytes())

    if writer:
        os.makedirs(path, exist_ok=True)
        for stale in os.listdir(path):  # shards of an earlier save that this one does not overwrite
            if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", stale) and stale not in split.filename_to_tensors:
                os.remove(os.path.join(path, stale))
        model.config.dtype = str(model.dtype).split(".")[1]
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(path)
        if model.can_generate():
            model.generation_config.save_pretrained(path)
    packed = packed_parameters()
    with torch.no_grad():
        for file, names in split.filename_to_tensors.items():
            names = set(names)
            file_keys = [key for key in keys if any(name in names for name in saved[key])]
            # Written in this order: each key's names that go to this file.
            entries = [(name, meta.dtype, tuple(meta.shape)) for key in file_keys
                       for name, meta in saved[key].items() if name in names]
            # Written under another name and renamed over: a model that maps the old file (NOTE [local
            # tensors that map the file]) keeps it, where truncating it would pull its pages away.
            temporary = os.path.join(path, f".{file}.{os.getpid()}.tmp")
            out = open(temporary, "wb") if writer else None
            try:
                if out is not None:
                    out.write(_header(entries))
                for key in file_keys:
                    pieces = _full_pieces(tensors[key], packed)  # every rank gathers
                    if list(saved[key]) == [key]:  # not converted: stream the pieces
                        for piece in pieces:
                            if out is not None:
                                _write_bytes(out, piece)
                        continue
                    converted = revert(key, torch.cat(list(pieces)))  # pieces run along dim 0
                    for name in saved[key]:
                        if out is not None and name in names:
                            _write_bytes(out, converted[name])
                    del converted
            except BaseException:
                if out is not None:
                    out.close()
                    os.remove(temporary)
                raise
            if out is not None:
                out.close()
                os.replace(temporary, os.path.join(path, file))
    if writer and split.is_sharded:
        index = {"metadata": {"total_parameters": model.num_parameters(), **split.metadata},
                 "weight_map": split.tensor_to_filename}
        with open(os.path.join(path, SAFE_WEIGHTS_INDEX_NAME), "w") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if dist.is_initialized():
        dist.barrier()
