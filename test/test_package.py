"""The public names of torch_tp and torch_tp.parallel.

The packages build their ``__all__`` from their submodules' lists, so a name
added to or dropped from a submodule's ``__all__`` changes the package's too.
The lists below are written out so that such a change is a deliberate one.
"""

import pytest

import torch_tp
import torch_tp.parallel

PARALLEL = [
    "ColwiseParallel",
    "KVHeadColwiseParallel",
    "PackedColwiseParallel",
    "PackedRowwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "clip_grad_norm_",
    "generation_layouts",
    "get_full_state_dict",
    "load_full_state_dict",
    "loss_parallel",
    "packed_tp_plan",
    "parallelize_module",
]
TOP_LEVEL = sorted(PARALLEL + [
    "DistributedDataParallel",
    "all_gather",
    "all_reduce",
    "all_reduce_",
    "chunk_range",
    "cmake_prefix_path",
    "copy_to_tp_region",
    "ops",
    "reduce_from_tp_region",
    "reduce_scatter",
    "shard",
])


@pytest.mark.parametrize("module, names", [(torch_tp, TOP_LEVEL), (torch_tp.parallel, PARALLEL)],
                         ids=["torch_tp", "torch_tp.parallel"])
def test_public_names(module, names):
    assert sorted(module.__all__) == names
    star = {}
    exec(f"from {module.__name__} import *", star)
    del star["__builtins__"]
    assert sorted(star) == names
    assert all(star[name] is getattr(module, name) for name in names)
