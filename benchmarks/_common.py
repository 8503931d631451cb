"""Helpers shared by the benchmark scripts (bench_collectives.py, bench_linear.py).

The scripts run as ``torchrun ... benchmarks/<script>.py``, so this directory is
``sys.path[0]`` and they import this module as ``_common``.
"""

import os
import platform
import shlex
import socket
import sys
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import torch_tp  # machine_info falls back on torch_tp.__version__

# The file RESULTS.md starts with when it does not exist yet.
RESULTS_MD_HEADER = (
    "# torch_tp benchmark results\n\nEach section is written by the benchmark script named in its markers.\n"
)


def require_torchrun(script: str) -> bool:
    """True under torchrun; otherwise say how to launch ``script`` and return False."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    print(f"{script}: launch with torchrun, e.g.\n  torchrun --nproc-per-node 2 benchmarks/{script} --quick",
          file=sys.stderr)
    return False


def check_everywhere(
    check: Callable[[], Dict[str, float]], what: str, group: dist.ProcessGroup
) -> Dict[str, float]:
    """Run ``check`` (worst relative difference per compared tensor) on every
    rank; if it fails on any rank, every rank raises (none is left waiting in a
    barrier). Returns the worst differences, maxed over the ranks. ``what``
    names the disagreement in the error."""
    err = ""
    worst: Dict[str, float] = {}
    try:
        worst = check()
    except Exception as e:  # reported below, on every rank
        err = f"{type(e).__name__}: {e}"
    flag = torch.tensor([1 if err else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item():
        raise RuntimeError(
            f"{what} (rank {dist.get_rank()}: {err or 'ok here, failed on another rank'}); "
            "refusing to time different computations"
        )
    vals = torch.tensor([worst[k] for k in sorted(worst)], dtype=torch.float64)
    dist.all_reduce(vals, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(sorted(worst), vals.tolist()))


def command_line() -> str:
    """The command as the user would type it (torchrun re-executes us as plain python)."""
    script = sys.argv[0]
    try:
        rel = os.path.relpath(script)
        if not rel.startswith(".."):
            script = rel
    except ValueError:
        pass
    nproc = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    prefix = ["torchrun", "--nproc-per-node", nproc]
    nnodes = int(os.environ.get("WORLD_SIZE", nproc)) // max(int(nproc), 1)
    if nnodes > 1:
        prefix += ["--nnodes", str(nnodes)]
    return shlex.join(prefix + [script] + sys.argv[1:])


def machine_info(world_size: int) -> Dict[str, object]:
    cpu_model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    try:
        import importlib.metadata as md

        tp_version = md.version("torch_tp")
    except Exception:
        tp_version = getattr(torch_tp, "__version__", "unknown")
    return {
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "torch_version": torch.__version__,
        "torch_tp_version": tp_version,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "backend": dist.get_backend(),
        "world_size": world_size,
        "torch_num_threads": torch.get_num_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        # glibc malloc tunables change the cost of the functional ops' fresh
        # output allocations (large blocks are mmap'd and page-faulted per call).
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_TUNABLES"))},
    }


def quantile(sorted_vals: List[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted list (numpy's default)."""
    if not sorted_vals:
        return float("nan")
    pos = q * (len(sorted_vals) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def stats_us(times_s: List[float]) -> Dict[str, float]:
    v = sorted(t * 1e6 for t in times_s)
    return {
        "median_us": quantile(v, 0.5),
        "p10_us": quantile(v, 0.1),
        "p90_us": quantile(v, 0.9),
        "min_us": v[0],
        "max_us": v[-1],
    }


def make_noop_group(world_group: dist.ProcessGroup) -> Tuple[Optional[dist.ProcessGroup], str]:
    """Create a group on torch's "fake" backend beside the gloo world group; (group, "") or (None, why not).

    Collective over the world group: every rank must call it.
    """
    group, why = None, ""
    try:
        # torch names the backend (dist.Backend.FAKE) but registers its creator
        # (FakeProcessGroup._create_internal) only when this module is imported.
        import torch.testing._internal.distributed.fake_pg  # noqa: F401

        group = dist.new_group(backend="fake")
        if dist.get_backend(group) != "fake":
            why, group = f"new_group(backend='fake') gave a {dist.get_backend(group)!r} group", None
    except Exception as e:  # an older or newer torch without it: skip the phase, say why
        why, group = f"{type(e).__name__}: {e}", None
    ok = torch.tensor([0 if group is None else 1], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=world_group)  # all ranks run the phase, or none
    if not ok.item():
        return None, why or "the fake group could not be created on another rank"
    return group, ""


def update_results_md(path: str, section: str, begin_marker: str, end_marker: str) -> None:
    """Replace the section between ``begin_marker`` and ``end_marker`` in RESULTS.md, or append it; keep
    everything else. ``section`` includes both markers."""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    else:
        text = RESULTS_MD_HEADER
    begin = text.find(begin_marker)
    end = text.find(end_marker, begin + len(begin_marker)) if begin >= 0 else -1
    if begin >= 0 and end >= 0:
        text = text[:begin] + section + text[end + len(end_marker):]
    else:
        if begin >= 0:  # a begin marker with no end: refuse to guess what to cut
            raise RuntimeError(f"{path}: found {begin_marker} without {end_marker}; fix the file by hand")
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)

