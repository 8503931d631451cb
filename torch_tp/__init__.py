"""torch_tp: tensor parallelism for PyTorch as C++/CUDA autograd ops.

``import torch_tp`` loads the native library, which registers the ops as
``torch.ops.torch_tp.*``; :mod:`torch_tp.ops` holds typed wrappers that accept a
ProcessGroup, a 1-D DeviceMesh or a group name. :class:`DistributedDataParallel`
is torch's DDP with torch_tp's C++ gradient reducer. Importing torch_tp also
registers the ``"torch_tp"`` process-group backend for CPU tensors
(:mod:`torch_tp.backend`). :data:`cmake_prefix_path` is where C++ programs find
torch_tp's CMake package, as :data:`torch.utils.cmake_prefix_path` is for torch.
"""

import os

import torch
import torch.distributed  # noqa: F401  (c10d's Python types, which _C's backend class derives from)



def _load_native_library() -> None:
    """Loads libtorch_tp.so through ``torch_tp._C``, or raises an ImportError that names the torch
    it was built against and the torch running: the library links torch's C++ API and loads only
    under the minor release it was compiled for (NOTE [the torch a wheel is built against] in
    setup.py), where it would otherwise fail on an undefined symbol."""
    rebuild = "rebuild torch_tp against the installed torch: `pip install --no-build-isolation --force-reinstall .`"
    try:
        from . import _build
    except ImportError as e:
        raise ImportError(f"torch_tp is not built (no torch_tp/_build.py): {rebuild}") from e
    built, running = _build.torch_version, torch.__version__
    if built.split("+")[0].split(".")[:2] != running.split("+")[0].split(".")[:2]:
        raise ImportError(f"torch_tp was built against torch {built} but torch {running} is installed; {rebuild}")
    try:
        from . import _C  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"torch_tp's native library, built against torch {built}, does not load under torch {running} "
            f"({e}); {rebuild}") from e


_load_native_library()

from . import backend  # noqa: E402,F401  (registers the "torch_tp" process-group backend)
from . import ops  # noqa: E402
from .ops import (  # noqa: E402
    all_gather,
    all_reduce,
    all_reduce_,
    chunk_range,
    copy_to_tp_region,
    reduce_from_tp_region,
    reduce_scatter,
    shard,
)

from . import ddp, parallel  # noqa: E402
from .ddp import *  # noqa: E402,F403
from .parallel import *  # noqa: E402,F403

__version__ = "0.1.0"

#: Add to CMAKE_PREFIX_PATH for ``find_package(torch_tp)`` (the package's
#: share/cmake; see NOTE [the installed CMake package] in setup.py).
cmake_prefix_path = os.path.join(os.path.dirname(__file__), "share", "cmake")

# The modules' public names, and of torch_tp.ops only the collectives and the
# torch.chunk helpers: the layer ops are reached as torch_tp.ops.*.
__all__ = [
    *ddp.__all__,
    *parallel.__all__,
    "all_gather",
    "all_reduce",
    "all_reduce_",
    "chunk_range",
    "copy_to_tp_region",
    "reduce_from_tp_region",
    "reduce_scatter",
    "shard",
    "cmake_prefix_path",
    "ops",
]
