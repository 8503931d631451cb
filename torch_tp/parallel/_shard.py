"""How a parameter of a parallelized module records that it holds a shard.

``parallelize_module`` replaces a sharded parameter by an ``nn.Parameter``
holding only this rank's ``torch.chunk`` piece (DTensor's ``Shard(dim)``) and
tags it with a :class:`ShardInfo`. Everything that needs the unsharded view
(state-dict gathering and loading, gradient-norm clipping, ``extra_repr``)
reads the tag; untagged parameters are replicated over the group.
"""

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["ShardInfo", "get_shard_info", "set_shard_info"]

_ATTRIBUTE = "_torch_tp_shard"


@dataclass(frozen=True)
class ShardInfo:
    """``param`` is piece ``rank`` of ``torch.chunk(full, world_size, dim)``.

    Attributes:
        dim: the sharded dimension (non-negative).
        full_shape: the shape of the unsharded tensor.
        group_name: the process group whose ranks hold the pieces.
    """

    dim: int
    full_shape: torch.Size
    group_name: str


def get_shard_info(param: torch.Tensor) -> Optional[ShardInfo]:
    """The :class:`ShardInfo` of ``param``, or ``None`` for a replicated one."""
    return getattr(param, _ATTRIBUTE, None)


def set_shard_info(param: torch.Tensor, info: ShardInfo) -> None:
    setattr(param, _ATTRIBUTE, info)
