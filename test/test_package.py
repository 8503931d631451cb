"""The public names of torch_tp and torch_tp.parallel.

The packages build their ``__all__`` from their submodules' lists, so a name
added to or dropped from a submodule's ``__all__`` changes the package's too.
The lists below are written out so that such a change is a deliberate one.
"""

import shutil
import subprocess

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


def test_kernels_run_on_torchs_openmp_threads():
    """libtorch_tp is built with OpenMP: at::parallel_for in its CPU kernels (the fused norm and cross entropy,
    the decode GEMV, the vocab shard's lookup) hands chunks to the intra-op threads only in code compiled so,
    and runs them inline otherwise. Its libgomp.so.1 is the one libtorch_cpu loads, so the process holds one
    OpenMP runtime and torch.set_num_threads governs both."""
    maps = open("/proc/self/maps").read().splitlines()
    libs = {line.split()[-1] for line in maps if line.endswith("/libtorch_tp.so")}
    assert len(libs) == 1, libs
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) is not installed")
    dynamic = subprocess.run([readelf, "-d", libs.pop()], check=True, capture_output=True, text=True).stdout
    assert "[libgomp.so.1]" in dynamic, dynamic
    runtimes = {line.split()[-1] for line in maps if "/libgomp" in line}
    assert len(runtimes) == 1, runtimes
