"""Tensor-parallel module API, mirroring ``torch.distributed.tensor.parallel``.

Each submodule's ``__all__`` names its public API; the package re-exports
them and builds its own ``__all__`` from theirs.
"""

from . import api, checkpoint, generation, hf_plan, kv_heads, loss, moe, packed, pretrained, style
from .api import *  # noqa: F403
from .checkpoint import *  # noqa: F403
from .generation import *  # noqa: F403
from .hf_plan import *  # noqa: F403
from .kv_heads import *  # noqa: F403
from .loss import *  # noqa: F403
from .moe import *  # noqa: F403
from .packed import *  # noqa: F403
from .pretrained import *  # noqa: F403
from .style import *  # noqa: F403

__all__ = [*api.__all__, *checkpoint.__all__, *generation.__all__, *hf_plan.__all__, *kv_heads.__all__, *loss.__all__,
           *moe.__all__, *packed.__all__, *pretrained.__all__, *style.__all__]
