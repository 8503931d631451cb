"""The benchmark runner: what every script in this directory shares, so that each script is its workload.

The scripts run as ``torchrun ... benchmarks/<script>.py`` (bench_linear_gpu.py as plain ``python``), so this
directory is ``sys.path[0]`` and they import this module as ``_common``. A script builds its steps, then::

    samples = time_interleaved({"ours": step_a, "theirs": step_b}, repeats, group, reset=resets)
    samples.stats("ours", "ms")            # median, p10, p90, min, max over repeats of the slowest rank
    samples.paired("theirs", "ours", "ms")  # median of the per-repeat differences

and hands the figures to :func:`run` as an :class:`Output` (the json data, the RESULTS.md section, the plot).

NOTE [method]: the method every benchmark here shares, in the manner of ``torch.utils.benchmark`` and
nccl-tests. The implementations a benchmark compares are timed side by side in one run: every repeat runs one
step of each, in an order that changes from repeat to repeat, so machine drift hits them all equally and none
always runs first (cold) or after the same one (whose leftovers it would pay for). Each timed step is preceded
by an untimed reset and ``dist.barrier()`` so the ranks start together; each rank times its own steps with
``time.perf_counter`` (CUDA events on a GPU); afterwards the times are gathered and a repeat's time is the
slowest rank's (a distributed step is done when it is done everywhere). Reported are medians over repeats
(p10/p90 beside them), ratios of medians, and paired differences as the median of per-repeat differences.
Cyclic GC is off while timing, as timeit does. Steps too short for the clock are timed as batches of
back-to-back calls, with one barrier per round (per-call time: batch time / batch length).
"""

import datetime
import gc
import itertools
import json
import os
import platform
import shlex
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import torch_tp  # machine_info falls back on torch_tp.__version__

KiB = 1024
MiB = 1024 * KiB

# The file RESULTS.md starts with when it does not exist yet.
RESULTS_MD_HEADER = (
    "# torch_tp benchmark results\n\nEach section is written by the benchmark script named in its markers.\n"
)
# Plots are written small (RESULTS.md shows them; they are kept in git): this dpi, then a 256-colour palette.
PLOT_DPI = 90

# ---------------------------------------------------------------------------
# sizes


def parse_size(text: str) -> int:
    """Parse ``4K``, ``16KiB``, ``1M``, ``64MiB`` or a plain byte count."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = 1
    if t.endswith("K"):
        mult, t = KiB, t[:-1]
    elif t.endswith("M"):
        mult, t = MiB, t[:-1]
    elif t.endswith("G"):
        mult, t = 1024 * MiB, t[:-1]
    return int(float(t) * mult)


def fmt_size(nbytes: int) -> str:
    if nbytes >= MiB and nbytes % MiB == 0:
        return f"{nbytes // MiB} MiB"
    if nbytes >= KiB and nbytes % KiB == 0:
        return f"{nbytes // KiB} KiB"
    return f"{nbytes} B"


def bandwidths_GBps(op: str, nbytes: int, seconds: float, p: int) -> Tuple[float, float]:
    """``(algbw, busbw)`` of a collective over ``nbytes`` (S: the all_reduce tensor, the all_gather output, the
    reduce_scatter input) in ``seconds`` on ``p`` ranks, GB/s (1e9 B/s), as nccl-tests define them: ``algbw =
    S / t``; ``busbw = algbw * 2(p-1)/p`` for all_reduce, ``algbw * (p-1)/p`` for all_gather and reduce_scatter."""
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * (2 * (p - 1) / p if op == "all_reduce" else (p - 1) / p)


# ---------------------------------------------------------------------------
# the run's setting


def require_torchrun(script: str) -> bool:
    """True under torchrun; otherwise say how to launch ``script`` and return False."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    print(f"{script}: launch with torchrun, e.g.\n  torchrun --nproc-per-node 2 benchmarks/{script} --quick",
          file=sys.stderr)
    return False


def command_line(torchrun: bool = True) -> str:
    """The command as the user would type it (torchrun re-executes us as plain python)."""
    script = sys.argv[0]
    try:
        rel = os.path.relpath(script)
        if not rel.startswith(".."):
            script = rel
    except ValueError:
        pass
    if not torchrun:
        return shlex.join(["python", script] + sys.argv[1:])
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


def rel_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference, relative to the largest magnitude of ``ref``."""
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def close(got: torch.Tensor, ref: torch.Tensor, what: str, rtol: float, atol_scale: float,
          min_scale: float = 1e-30) -> float:
    """``torch.testing.assert_close`` in float32, ``atol = atol_scale * max(max|ref|, min_scale)`` (a tolerance
    on the tensor's own scale), naming ``what`` in the error. Returns :func:`rel_diff`."""
    got, ref = got.detach().float(), ref.detach().float()
    scale = ref.abs().max().item() if ref.numel() else 0.0
    torch.testing.assert_close(got, ref, rtol=rtol, atol=atol_scale * max(scale, min_scale),
                               msg=lambda m: f"{what}: {m}")
    return rel_diff(got, ref)


def materialize(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Wait for an eager functional collective's result (an AsyncCollectiveTensor, also inside a DTensor):
    DTensor hands back its outputs and gradients before their collectives have finished."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        if isinstance(t._local_tensor, funcol.AsyncCollectiveTensor):
            t._local_tensor.wait()
        return t
    if isinstance(t, funcol.AsyncCollectiveTensor):
        return t.wait()
    return t


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


def noop_phase(name: str, world_group: dist.ProcessGroup, measure: Callable[[dist.ProcessGroup], Dict]) -> Dict:
    """``measure(fake_group)`` on a no-op group (:func:`make_noop_group`), with the group's backend, the world
    size and the phase's seconds, or ``{"skipped": why}`` where torch cannot make one. Its collectives complete at once without communicating, so what a step costs there is
    each layer's own work: dispatch, argument checks, allocation, autograd."""
    fake_group, why = make_noop_group(world_group)
    if fake_group is None:
        if dist.get_rank() == 0:
            print(f"[{name}] no-op group phase skipped: {why}", flush=True)
        return {"skipped": why, "world_size": world_group.size()}
    start = time.perf_counter()
    phase = measure(fake_group)
    return {"backend": dist.get_backend(fake_group), "world_size": world_group.size(), **phase,
            "elapsed_s": time.perf_counter() - start}


# ---------------------------------------------------------------------------
# statistics


def quantile(sorted_vals: List[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted list (numpy's default)."""
    if not sorted_vals:
        return float("nan")
    pos = q * (len(sorted_vals) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


UNITS = {"s": 1.0, "ms": 1e3, "us": 1e6}


def median(values: Union[Sequence[float], torch.Tensor]) -> float:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    return quantile(sorted(values), 0.5)


def stats(times_s: Union[Sequence[float], torch.Tensor], unit: str = "us") -> Dict[str, float]:
    """``median_<unit>``, ``p10``, ``p90``, ``min``, ``max`` of times in seconds."""
    if isinstance(times_s, torch.Tensor):
        times_s = times_s.tolist()
    v = sorted(t * UNITS[unit] for t in times_s)
    return {f"median_{unit}": quantile(v, 0.5), f"p10_{unit}": quantile(v, 0.1), f"p90_{unit}": quantile(v, 0.9),
            f"min_{unit}": v[0], f"max_{unit}": v[-1]}


# ---------------------------------------------------------------------------
# timing


def rotations(keys: Sequence[str]) -> Callable[[int], List[str]]:
    """Repeat r runs ``keys`` rotated by r: none always first. (Two keys: the order alternates.)"""
    keys = list(keys)
    return lambda r: keys[r % len(keys):] + keys[: r % len(keys)]


def permutations(keys: Sequence[str]) -> Callable[[int], List[str]]:
    """Repeat r runs the r-th of all orders of ``keys``: none always first, none always after the same one."""
    orders = [list(o) for o in itertools.permutations(keys)]
    return lambda r: orders[r % len(orders)]


def wall_time(fn: Callable[[], Any], calls: int) -> Tuple[float, Dict[str, float]]:
    """Seconds per call of ``calls`` back-to-back calls, by ``time.perf_counter``. A step that returns a dict
    of ``perf_counter()`` stamps ("laps") gets them back as seconds since its start."""
    t0 = time.perf_counter()
    for _ in range(calls):
        out = fn()
    t1 = time.perf_counter()
    laps = {k: v - t0 for k, v in out.items()} if isinstance(out, dict) else {}
    return (t1 - t0) / calls, laps


def cuda_time(fn: Callable[[], Any], calls: int) -> Tuple[float, Dict[str, float]]:
    """:func:`wall_time` on a GPU: seconds per call between CUDA events recorded on the current stream (no laps)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls, {}


class Samples:
    """The times :func:`time_interleaved` took: ``per_rank[key]`` is ``[ranks, repeats]``, seconds."""

    def __init__(self, per_rank: Dict[str, torch.Tensor]) -> None:
        self.per_rank = per_rank

    def max(self, key: str) -> torch.Tensor:
        """Per repeat, the slowest rank's time."""
        return self.per_rank[key].max(dim=0).values

    def stats(self, key: str, unit: str = "ms") -> Dict[str, Any]:
        """:func:`stats` of the slowest rank's times, each rank's own median, and every repeat's time."""
        t = self.max(key)
        out: Dict[str, Any] = stats(t, unit)
        out[f"per_rank_median_{unit}"] = [median(r) * UNITS[unit] for r in self.per_rank[key]]
        out[f"times_{unit}"] = [v * UNITS[unit] for v in t.tolist()]
        return out

    def median(self, key: str, unit: str = "ms") -> float:
        return median(self.max(key)) * UNITS[unit]

    def paired_stats(self, a: str, b: str, unit: str = "ms") -> Dict[str, float]:
        """:func:`stats` over repeats of ``a - b``: the repeats interleave both, so the difference cancels drift."""
        return stats(self.max(a) - self.max(b), unit)

    def paired(self, a: str, b: str, unit: str = "ms") -> float:
        """The median over repeats of ``a - b`` (:meth:`paired_stats`)."""
        return self.paired_stats(a, b, unit)[f"median_{unit}"]


def time_interleaved(
    steps: Dict[str, Callable[[], Any]],
    repeats: int,
    group: dist.ProcessGroup,
    *,
    order: Optional[Callable[[int], Sequence[str]]] = None,
    reset: Optional[Dict[str, Callable[[], None]]] = None,
    calls: int = 1,
    warmup: int = 0,
    barrier: Union[str, Callable[[str], None]] = "step",
    timer: Callable[[Callable[[], Any], int], Tuple[float, Dict[str, float]]] = wall_time,
    gc_off: bool = True,
) -> Samples:
    """Time ``steps`` side by side (NOTE [method]): ``repeats`` rounds, each running every step once.

    Args:
        steps: the implementations, each one step without arguments.
        repeats: timed rounds.
        group: the ranks whose times are gathered (a round's time per step: the slowest rank's) and, by
            default, the group of the barriers.
        order: ``order(r)`` lists the steps round r runs, in order (default :func:`rotations` of ``steps``).
        reset: ``reset[key]()`` runs untimed before that step (gradients to None, buffers refilled).
        calls: back-to-back calls per timed sample (one batch); the sample is the per-call time.
        warmup: untimed rounds first, the same as the timed ones.
        barrier: ``"step"``: ``dist.barrier(group)`` before every timed step; ``"round"``: once before each
            round (batched steps); or a callable, ``barrier(key)`` before that step.
        timer: ``timer(fn, calls) -> (seconds per call, laps)`` (:func:`wall_time`; :func:`cuda_time` on a GPU).
        gc_off: cyclic GC off while timing.

    Returns:
        :class:`Samples` over ``steps`` and, for a step returning laps, ``"<key>/<lap>"``.
    """
    order = order or rotations(list(steps))
    reset = reset or {}
    local: Dict[str, List[float]] = {}
    gc_was_enabled = gc.isenabled()
    if gc_off:
        gc.collect()
        gc.disable()
    try:
        for r in range(-warmup, repeats):
            if barrier == "round":
                dist.barrier(group=group)
            for key in order(r):  # warm-up rounds have r < 0
                if key in reset:
                    reset[key]()
                if barrier == "step":
                    dist.barrier(group=group)
                elif callable(barrier):
                    barrier(key)
                seconds, laps = timer(steps[key], calls)
                if r >= 0:
                    local.setdefault(key, []).append(seconds)
                    for lap, t in laps.items():
                        local.setdefault(f"{key}/{lap}", []).append(t)
    finally:
        if gc_off and gc_was_enabled:
            gc.enable()
    keys = list(local)
    mine = torch.tensor([local[k] for k in keys], dtype=torch.float64).reshape(len(keys), repeats)
    gathered = [torch.empty_like(mine) for _ in range(group.size())]
    dist.all_gather(gathered, mine, group=group)
    per_rank = torch.stack(gathered)  # [rank, key, repeat]
    return Samples({k: per_rank[:, i] for i, k in enumerate(keys)})


# ---------------------------------------------------------------------------
# RESULTS.md and plots


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


def method_notes(unit: str) -> Dict[str, Any]:
    """The json's "method" entries for NOTE [method] as every torchrun benchmark applies it; ``unit``: what one
    timed sample is ("step", "call")."""
    return {
        f"barrier_before_each_{unit}": True,
        "per_repeat_time": f"max over ranks of each rank's wall time (perf_counter) of the {unit}",
        "stat": "median over repeats; p10/p90 reported",
    }


def plot_title(report: Dict, threads: bool = True) -> str:
    """A plot's title past its subject: backend, world size, CPU, cores (and ``threads`` per rank), torch."""
    m = report["machine"]
    cores = f"{m['cpus_usable']} cores" + (f", {m['torch_num_threads']} thread/rank" if threads else "")
    return (f"{m['backend']}, world size {m['world_size']}, {m['cpu_model']} ({cores}), torch {m['torch_version']}"
            + (" [quick]" if report["quick"] else ""))


def quick_note(meta: Dict) -> str:
    return " (quick smoke run: few repeats, not for conclusions)" if meta["quick"] else ""


def section_head(meta: Dict, title: str, threads_note: str = "") -> List[str]:
    """Title, command, machine and date: how the sections of the torchrun benchmarks begin."""
    m = meta["machine"]
    return [
        title,
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Machine: {m['cpu_model']}, {m['cpus_usable']} usable cores ({m['cpu_count']} online), "
        f"torch {m['torch_version']}, torch_tp {m['torch_tp_version']}, Python {m['python_version']}, "
        f"backend {m['backend']}, world size {m['world_size']}, "
        f"{m['torch_num_threads']} intra-op thread(s) per rank{threads_note}.",
        "",
        f"Date: {meta['date']}" + quick_note(meta),
        "",
    ]


def noop_section(phase: Optional[Dict], title: str, body: Callable[[Dict], List[str]]) -> List[str]:
    """The RESULTS.md lines of a :func:`noop_phase`: none when it was not run, a "Skipped" line when torch
    could not make the group, else the heading and ``body(phase)``. The heading is ``title``, ending in an open
    bracket the world size closes: ``### <title>, world size <p>)``."""
    if phase is None:
        return []
    head = f"### {title}, world size {phase['world_size']})"
    if "skipped" in phase:
        return [head, "", f"Skipped: {phase['skipped']}", ""]
    return [head, "", *body(phase)]


def json_link(stem: str, phase: Optional[Dict]) -> str:
    """The line that ends a section with a no-op phase: where its raw figures are."""
    return (f"Raw figures, per-repeat times and p10/p90: [{stem}.json]({stem}.json)"
            + (" (no-op group: `overhead_noop_pg`)." if phase and "skipped" not in phase else "."))


def target_lines(targets: List[Dict]) -> List[str]:
    return [f"- **{'PASS' if t['pass'] else 'MISS'}** {t['target']}: {t['value']}" for t in targets]


def figure(nrows: int, ncols: int, panel_size: Tuple[float, float]):
    """A matplotlib figure (Agg) of ``nrows x ncols`` panels, ``axes`` always 2-D."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, figsize=(panel_size[0] * ncols, panel_size[1] * nrows), squeeze=False)


def save_figure(fig, path: str, title: Optional[str] = None, title_size: int = 10) -> None:
    """Write ``fig`` small: :data:`PLOT_DPI`, then a 256-colour palette (line and bar plots lose nothing)."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title, fontsize=title_size)
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)
    try:
        from PIL import Image

        Image.open(path).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(
            path, optimize=True)
    except ImportError:
        pass


def bar_panel(ax, labels: List[str], colors: List[str], stats_list: List[Dict], unit: str, title: str,
              ylabel: str, title_size: int = 9) -> None:
    """One panel of median bars with p10-p90 whiskers, the median written on each bar."""
    xs = range(len(labels))
    med = [s[f"median_{unit}"] for s in stats_list]
    err = [[m - s[f"p10_{unit}"] for m, s in zip(med, stats_list)],
           [s[f"p90_{unit}"] - m for m, s in zip(med, stats_list)]]
    ax.bar(xs, med, yerr=err, capsize=3, color=colors)
    for x, m in zip(xs, med):
        ax.text(x, m / 2, f"{m:.0f}" if m >= 100 else f"{m:.3g}", ha="center", va="center", fontsize=8,
                color="white", fontweight="bold")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_title(title, fontsize=title_size)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)


# ---------------------------------------------------------------------------
# the runner


def add_output_args(parser, files: str = "", quick: Optional[str] = None, out_dir: str = "benchmarks") -> None:
    """``--out-dir`` (for ``files`` and RESULTS.md), ``--no-results-md`` and, for a script with a smoke mode
    (``quick``: its help), ``--quick``."""
    parser.add_argument("--out-dir", default=out_dir,
                        help=f"directory for {files + ' and ' if files else ''}RESULTS.md (default: %(default)s)")
    if quick is not None:
        parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--no-results-md", action="store_true",
                        help="do not update RESULTS.md" + (" (still writes the json and png)" if files else ""))


def add_repeat_scale_arg(parser, per: str) -> None:
    """``--repeat-scale``: a factor on the number of timed repeats of each ``per`` (size, configuration)."""
    parser.add_argument("--repeat-scale", type=float, default=1.0,
                        help=f"multiply the per-{per} number of timed repeats by this factor (default: %(default)s)")


def scaled_repeats(repeats: int, scale: float) -> int:
    """``repeats`` times ``--repeat-scale``, at least 3 (a median and p10/p90 need a few)."""
    return max(3, round(repeats * scale))


def add_no_overhead_arg(parser, what: str) -> None:
    """``--no-overhead``: skip the :func:`noop_phase` (``what``: "per-call", "per-step")."""
    parser.add_argument("--no-overhead", action="store_true",
                        help=f"skip the {what} overhead phase on the no-op (fake backend) process group")


@dataclass
class Output:
    """What a benchmark hands :func:`run` (rank 0's is written).

    ``stem``: ``<out-dir>/<stem>.json`` (the run's metadata and ``data``) and ``<stem>.png`` (``plot(path,
    report)``); ``tag``: the RESULTS.md section ``<!-- tag:begin -->`` .. ``<!-- tag:end -->``, whose lines
    between the markers are ``section(report)``; ``console``: printed. ``report`` is the json's dict.
    """

    tag: str
    data: Dict[str, Any]
    section: Callable[[Dict], List[str]]
    stem: Optional[str] = None
    plot: Optional[Callable[[str, Dict], None]] = None
    console: List[str] = field(default_factory=list)


def run(name: str, args, measure: Callable[[], Output], *, backend: str = "gloo", threads: Optional[int] = 1,
        torchrun: bool = True) -> int:
    """Run one benchmark: set up the process group, ``measure()``, write its outputs on rank 0.

    ``torchrun=False``: one process, a process group of world size 1 over a file store (the ops do no
    communication). ``threads``: intra-op threads per rank (one: 2 ranks on 2 cores, no oversubscription).
    Returns the exit status.
    """
    if torchrun and not require_torchrun(f"{name}.py"):
        return 2
    if threads is not None:
        torch.set_num_threads(threads)
    if torchrun:
        dist.init_process_group(backend)
    else:
        store = tempfile.mkdtemp(prefix=f"{name}_")
        dist.init_process_group(backend, init_method=f"file://{store}/store", rank=0, world_size=1)
    start = time.perf_counter()
    try:
        meta = {
            "benchmark": name,
            "command": command_line(torchrun),
            "argv": sys.argv,
            "date": datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds"),
            "quick": getattr(args, "quick", False),
            "machine": machine_info(dist.get_world_size()),
        }
        out = measure()
        meta["elapsed_s"] = time.perf_counter() - start
        if dist.get_rank() == 0:
            report = {**meta, **out.data}
            written = []
            os.makedirs(args.out_dir, exist_ok=True)
            if out.stem:
                path = os.path.join(args.out_dir, f"{out.stem}.json")
                with open(path, "w") as f:
                    json.dump(report, f, indent=1)
                written.append(path)
                if out.plot:
                    path = os.path.join(args.out_dir, f"{out.stem}.png")
                    out.plot(path, report)
                    written.append(path)
            print("\n" + "\n".join(out.console) + "\n")
            if not args.no_results_md:
                begin, end = f"<!-- {out.tag}:begin -->", f"<!-- {out.tag}:end -->"
                path = os.path.join(args.out_dir, "RESULTS.md")
                update_results_md(path, "\n".join([begin, *out.section(report), end]), begin, end)
                written.append(path)
            print(f"[{name}] {meta['elapsed_s']:.1f} s; wrote " + ", ".join(written), flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0
