"""The installed package: its public names, the torch it requires and loads under, its OpenMP runtime.

The packages build their ``__all__`` from their submodules' lists, so a name
added to or dropped from a submodule's ``__all__`` changes the package's too.
The lists below are written out so that such a change is a deliberate one.
"""

import importlib.metadata
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

import torch_tp
import torch_tp.parallel

PARALLEL = [
    "ColwiseParallel",
    "ExpertParallel",
    "ExpertTensorParallel",
    "ExpertsTensorParallel",
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
    "load_pretrained",
    "loss_parallel",
    "packed_tp_plan",
    "parallelize_module",
    "save_pretrained",
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


def _minor_release(version):
    return ".".join(version.split("+")[0].split(".")[:2])


def test_wheel_requires_the_torch_it_was_built_against():
    """NOTE [the torch a wheel is built against] in setup.py: the package's only requirement is the minor
    release of torch it was compiled for, so pip keeps that torch instead of swapping another in."""
    from torch_tp import _build

    assert _minor_release(_build.torch_version) == _minor_release(torch.__version__)
    assert importlib.metadata.requires("torch_tp") == [f"torch=={_minor_release(torch.__version__)}.*"]


def _import_copy(tmp_path, edit):
    """``import torch_tp`` in a fresh interpreter from a copy of the package that ``edit`` changed."""
    package = tmp_path / "torch_tp"
    shutil.copytree(pathlib.Path(torch_tp.__file__).parent, package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    edit(package)
    return subprocess.run([sys.executable, "-c", "import torch_tp"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})


def test_import_under_another_torch_names_both(tmp_path):
    """A library built against another minor release of torch is refused before it is loaded (where it
    would fail on an undefined symbol of torch's C++ API), naming both releases."""
    def built_against_2_10(package):
        (package / "_build.py").write_text('torch_version = "2.10.0+cu128"\n')

    result = _import_copy(tmp_path, built_against_2_10)
    assert result.returncode != 0
    assert (f"ImportError: torch_tp was built against torch 2.10.0+cu128 but torch {torch.__version__} "
            "is installed") in result.stderr, result.stderr


def test_native_library_that_does_not_load_names_both(tmp_path):
    """Where the release matches but the library still does not load (here: not a shared object at all; in
    the field, a CUDA build under a CPU torch), the error names both builds of torch and the loader's reason."""
    def corrupt_library(package):
        (package / "libtorch_tp.so").write_bytes(b"not an ELF file")

    result = _import_copy(tmp_path, corrupt_library)
    assert result.returncode != 0
    from torch_tp import _build

    assert (f"torch_tp's native library, built against torch {_build.torch_version}, does not load under "
            f"torch {torch.__version__}") in result.stderr, result.stderr
    assert "libtorch_tp.so" in result.stderr, result.stderr


@pytest.mark.parametrize("fake_torch, message", [
    ('__version__ = "2.16.0+cu132"', "the installed torch is 2.16.0+cu132; torch_tp supports torch 2.11 to 2.15"),
    ('__version__ = "2.10.0"', "the installed torch is 2.10.0; torch_tp supports torch 2.11 to 2.15"),
    ('raise ImportError("no torch here")', "no torch to build against: install torch 2.11 to 2.15 first"),
], ids=["newer", "older", "none"])
def test_build_refuses_unsupported_torch(tmp_path, fake_torch, message):
    """setup.py refuses a torch outside the supported range before it configures or compiles anything (its
    first statement that needs torch), naming the version it found and the range. run_tests.sh copies
    setup.py beside the tests; a fake ``torch`` package first on the path stands in for the installed one."""
    setup_py = pathlib.Path(__file__).resolve().parents[1] / "setup.py"
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(fake_torch + "\n")
    result = subprocess.run([sys.executable, str(setup_py), "--version"], cwd=tmp_path, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
