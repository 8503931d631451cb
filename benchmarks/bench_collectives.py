#!/usr/bin/env python3
r"""Benchmark torch_tp's collective ops against torch's functional collectives and raw c10d.

Launch with ``torchrun``, one process per rank, on a gloo process group (CPU
tensors, float32)::

    torchrun --nproc-per-node 2 benchmarks/bench_collectives.py [--out-dir benchmarks] [--quick]

For each message size (bytes of the per-rank input for all_reduce and
reduce_scatter, of the per-rank input shard for all_gather) and each op, three
implementations are timed side by side in one run:

* ``torch_tp``: ``torch.ops.torch_tp.{all_reduce, all_gather, reduce_scatter}``
  called with the group name (functional: returns a new tensor);
* ``functional``: ``torch.distributed._functional_collectives``
  (``all_reduce``, ``all_gather_tensor``, ``reduce_scatter_tensor``, or their
  ``*_single`` successors where torch has them), including the wait that
  materialises the result;
* ``raw``: the c10d collective into preallocated buffers (``dist.all_reduce``
  in place, ``dist.all_gather_into_tensor``, ``dist.reduce_scatter_tensor``,
  or their ``*_single`` successors where torch has them),
  the floor any wrapper pays on top of.

NOTE [method]: every repeat runs all three implementations of every op, in an
order rotated from repeat to repeat, so machine drift hits them equally; each
timed call is preceded by ``dist.barrier()`` so the ranks start together. Each
rank records its own per-call wall time; after the run the times are all-reduced
with MAX, so a repeat's time is that of the slowest rank (a collective is done
when it is done everywhere). Reported: median, p10 and p90 over the repeats;
algorithm bandwidth ``algbw = S / t`` and bus bandwidth in the nccl-tests
convention (all_reduce ``busbw = algbw * 2(p-1)/p`` with S the tensor size;
all_gather and reduce_scatter ``busbw = algbw * (p-1)/p`` with S the full,
gathered/unscattered tensor size); torch_tp's overhead over raw c10d as the
median of the per-repeat paired differences (us) and as the ratio of medians;
and the ratio of medians torch_tp / functional.

Rank 0 writes ``collectives.json`` (all figures, the per-repeat times and the
machine), ``collectives.png`` (latency vs size, log-log, one subplot per op)
and the ``bench_collectives`` section of ``RESULTS.md`` (text outside its
markers is kept) into ``--out-dir``, and prints the markdown table.
"""

import argparse
import datetime
import json
import os
import platform
import shlex
import socket
import sys
import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import torch_tp  # noqa: F401  (registers torch.ops.torch_tp.*)

KiB = 1024
MiB = 1024 * KiB

DEFAULT_SIZES = [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]
OPS = ["all_reduce", "all_gather", "reduce_scatter"]
IMPLS = ["torch_tp", "functional", "raw"]
IMPL_LABELS = {"torch_tp": "torch_tp", "functional": "functional collectives", "raw": "raw c10d"}

# Timed repeats per size for the full run: many for small messages (where the
# median needs many samples to settle against scheduler noise), fewer for large
# ones (where one call takes tens of ms). Sized so the full run stays within
# about 4 minutes on 2 cores with 2 ranks.
FULL_REPEATS = {
    4 * KiB: 400,
    16 * KiB: 400,
    64 * KiB: 300,
    256 * KiB: 200,
    1 * MiB: 120,
    4 * MiB: 60,
    16 * MiB: 30,
    64 * MiB: 15,
}
QUICK_REPEATS = {
    4 * KiB: 30,
    16 * KiB: 30,
    64 * KiB: 25,
    256 * KiB: 15,
    1 * MiB: 10,
    4 * MiB: 6,
    16 * MiB: 4,
    64 * MiB: 3,
}

# torch 2.14 deprecates all_gather_into_tensor / reduce_scatter_tensor in favour
# of the *_single names; the deprecated wrappers call warnings.warn on every
# call, which would inflate the floor. Use the new names where they exist.
RAW_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
RAW_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# Same for the functional collectives (all_gather_tensor / reduce_scatter_tensor
# became all_gather_single / reduce_scatter_single, same signatures).
FC_ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
FC_REDUCE_SCATTER = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor

SECTION_BEGIN = "<!-- bench_collectives:begin -->"
SECTION_END = "<!-- bench_collectives:end -->"


# ---------------------------------------------------------------------------
# arguments and helpers


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


def default_repeats(nbytes: int, quick: bool) -> int:
    table = QUICK_REPEATS if quick else FULL_REPEATS
    if nbytes in table:
        return table[nbytes]
    # Sizes not in the table: take the nearest listed size at or above it.
    larger = [s for s in sorted(table) if s >= nbytes]
    return table[larger[0]] if larger else table[max(table)]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench_collectives.py",
        description=(
            "Time torch_tp's all_reduce / all_gather / reduce_scatter against torch's functional "
            "collectives and the raw c10d collectives on a gloo group (CPU, float32), side by side "
            "in one run. Launch with: torchrun --nproc-per-node 2 benchmarks/bench_collectives.py"
        ),
        epilog=(
            "Method: all implementations interleaved per repeat (rotating order), dist.barrier() "
            "before each timed call, per-call times max-reduced over ranks, medians (p10/p90) over "
            "repeats. Rank 0 writes collectives.json, collectives.png and the bench_collectives "
            "section of RESULTS.md into --out-dir."
        ),
    )
    p.add_argument(
        "--out-dir",
        default="benchmarks",
        help="directory for collectives.json, collectives.png and RESULTS.md (default: %(default)s)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run (~30 s): same sizes, about a tenth of the repeats",
    )
    p.add_argument(
        "--sizes",
        default=None,
        help="comma-separated message sizes, e.g. '4K,1M,64M' (default: 4 KiB .. 64 MiB, x4 steps)",
    )
    p.add_argument(
        "--ops",
        default=",".join(OPS),
        help="comma-separated subset of the ops to run (default: %(default)s)",
    )
    p.add_argument(
        "--repeat-scale",
        type=float,
        default=1.0,
        help="multiply the per-size number of timed repeats by this factor (default: %(default)s)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed calls per (size, op, implementation) before timing (default: 5, 2 with --quick; "
        "halved for sizes >= 16 MiB)",
    )
    p.add_argument(
        "--no-results-md",
        action="store_true",
        help="do not update RESULTS.md (still writes the json and png)",
    )
    args = p.parse_args(argv)
    args.sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else list(DEFAULT_SIZES)
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    for o in args.ops:
        if o not in OPS:
            p.error(f"--ops: unknown op {o!r}; choose from {', '.join(OPS)}")
    if args.warmup is None:
        args.warmup = 2 if args.quick else 5
    return args


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


# ---------------------------------------------------------------------------
# the three implementations of each op


def make_calls(
    op: str, nbytes: int, group: dist.ProcessGroup, rank: int, world: int
) -> Tuple[Dict[str, Callable[[], None]], Callable[[], None], Dict[str, Callable[[], torch.Tensor]], int]:
    """Build (timed calls, untimed per-repeat reset, result getters, full-tensor bytes) for one op/size.

    The timed calls take no arguments: inputs and the raw collective's output
    buffers are allocated here, once, so the raw path is pure communication.
    """
    elt = torch.tensor([], dtype=torch.float32).element_size()
    numel = nbytes // elt
    if numel < world or numel % world:
        raise ValueError(f"size {nbytes} B is not a multiple of {world} float32 elements")
    gname = group.group_name
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.rand(numel, generator=gen, dtype=torch.float32)
    results: Dict[str, torch.Tensor] = {}

    def funcol_wait(y: torch.Tensor) -> torch.Tensor:
        # Eager funcol returns an AsyncCollectiveTensor; wait() blocks until
        # the result is there and unwraps it.
        if isinstance(y, funcol.AsyncCollectiveTensor):
            return y.wait()
        return funcol.wait_tensor(y)

    if op == "all_reduce":
        full_bytes = nbytes
        raw_buf = x.clone()  # in place: refreshed from x before every timed call

        def tp() -> None:
            results["torch_tp"] = torch.ops.torch_tp.all_reduce(x, "sum", gname)

        def fc() -> None:
            results["functional"] = funcol_wait(funcol.all_reduce(x, "sum", group))

        def raw() -> None:
            dist.all_reduce(raw_buf, op=dist.ReduceOp.SUM, group=group)

        def reset() -> None:
            raw_buf.copy_(x)  # the in-place sum would otherwise grow to inf

        raw_out = raw_buf
    elif op == "all_gather":
        full_bytes = nbytes * world
        raw_out = torch.empty(numel * world, dtype=torch.float32)

        def tp() -> None:
            results["torch_tp"] = torch.ops.torch_tp.all_gather(x, 0, gname)

        def fc() -> None:
            results["functional"] = funcol_wait(FC_ALL_GATHER(x, 0, group))

        def raw() -> None:
            RAW_ALL_GATHER(raw_out, x, group=group)

        def reset() -> None:
            pass
    elif op == "reduce_scatter":
        full_bytes = nbytes
        raw_out = torch.empty(numel // world, dtype=torch.float32)

        def tp() -> None:
            results["torch_tp"] = torch.ops.torch_tp.reduce_scatter(x, 0, "sum", gname)

        def fc() -> None:
            results["functional"] = funcol_wait(FC_REDUCE_SCATTER(x, "sum", 0, group))

        def raw() -> None:
            RAW_REDUCE_SCATTER(raw_out, x, op=dist.ReduceOp.SUM, group=group)

        def reset() -> None:
            pass
    else:
        raise ValueError(op)

    getters = {
        "torch_tp": lambda: results["torch_tp"],
        "functional": lambda: results["functional"],
        "raw": lambda: raw_out,
    }
    return {"torch_tp": tp, "functional": fc, "raw": raw}, reset, getters, full_bytes


def check_agreement(
    op: str, calls: Dict[str, Callable[[], None]], reset: Callable[[], None], getters: Dict[str, Callable]
) -> None:
    """Run each implementation once and check they agree (guards against timing a wrong thing)."""
    reset()
    for impl in IMPLS:
        calls[impl]()
    ref = getters["raw"]()
    for impl in ("torch_tp", "functional"):
        got = getters[impl]()
        if got.shape != ref.shape or not torch.allclose(got, ref, rtol=1e-6, atol=1e-6):
            raise RuntimeError(
                f"{op}: {impl} disagrees with raw c10d (shapes {tuple(got.shape)} vs {tuple(ref.shape)})"
            )


# ---------------------------------------------------------------------------
# measurement


def bench(args: argparse.Namespace, group: dist.ProcessGroup, rank: int, world: int) -> List[Dict]:
    records = []
    for nbytes in args.sizes:
        repeats = max(3, round(default_repeats(nbytes, args.quick) * args.repeat_scale))
        warmup = max(1, args.warmup // 2) if nbytes >= 16 * MiB else args.warmup
        per_op = {}
        for op in args.ops:
            calls, reset, getters, full_bytes = make_calls(op, nbytes, group, rank, world)
            check_agreement(op, calls, reset, getters)
            per_op[op] = (calls, reset, full_bytes)
            for _ in range(warmup):
                for impl in IMPLS:
                    reset()
                    dist.barrier(group=group)
                    calls[impl]()

        # times[op][impl][repeat] on this rank, seconds
        local = torch.zeros(len(args.ops), len(IMPLS), repeats, dtype=torch.float64)
        t_size = time.perf_counter()
        for r in range(repeats):
            # Rotate the order so no implementation always runs first (cold) or last.
            order = IMPLS[r % len(IMPLS):] + IMPLS[: r % len(IMPLS)]
            for oi, op in enumerate(args.ops):
                calls, reset, _ = per_op[op]
                for impl in order:
                    reset()
                    dist.barrier(group=group)
                    t0 = time.perf_counter()
                    calls[impl]()
                    t1 = time.perf_counter()
                    local[oi, IMPLS.index(impl), r] = t1 - t0
        elapsed = time.perf_counter() - t_size
        # The slowest rank defines a collective's time: max over ranks, per repeat.
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)

        for oi, op in enumerate(args.ops):
            full_bytes = per_op[op][2]
            bus_factor = 2.0 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
            rec = {
                "op": op,
                "size_bytes": nbytes,
                "size": fmt_size(nbytes),
                "full_tensor_bytes": full_bytes,
                "repeats": repeats,
                "warmup": warmup,
                "impls": {},
            }
            for ii, impl in enumerate(IMPLS):
                times = local[oi, ii].tolist()
                s = stats_us(times)
                med_s = s["median_us"] * 1e-6
                algbw = full_bytes / med_s / 1e9
                s["algbw_GBps"] = algbw
                s["busbw_GBps"] = algbw * bus_factor
                s["times_us"] = [t * 1e6 for t in times]
                rec["impls"][impl] = s
            tp_t = local[oi, 0]
            fc_t = local[oi, 1]
            raw_t = local[oi, 2]
            med = {k: rec["impls"][k]["median_us"] for k in IMPLS}
            # Paired: repeats were interleaved, so the per-repeat difference cancels drift.
            rec["torch_tp_overhead_us"] = quantile(sorted(((tp_t - raw_t) * 1e6).tolist()), 0.5)
            rec["torch_tp_minus_raw_medians_us"] = med["torch_tp"] - med["raw"]
            rec["torch_tp_over_raw"] = med["torch_tp"] / med["raw"]
            rec["torch_tp_over_functional"] = med["torch_tp"] / med["functional"]
            rec["functional_overhead_us"] = quantile(sorted(((fc_t - raw_t) * 1e6).tolist()), 0.5)
            records.append(rec)
        if rank == 0:
            print(
                f"[bench_collectives] {fmt_size(nbytes):>7}: {repeats} repeats x {len(args.ops)} ops x "
                f"{len(IMPLS)} impls in {elapsed:.1f} s",
                flush=True,
            )
    return records


# ---------------------------------------------------------------------------
# reporting


def markdown_table(records: List[Dict]) -> str:
    lines = [
        "| size | op | torch_tp us | functional us | raw c10d us | torch_tp overhead us "
        "| torch_tp / raw | torch_tp / functional | busbw GB/s (torch_tp) | busbw GB/s (raw) |",
        "|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rec in records:
        im = rec["impls"]
        lines.append(
            f"| {rec['size']} | {rec['op']} | {im['torch_tp']['median_us']:.1f} | "
            f"{im['functional']['median_us']:.1f} | {im['raw']['median_us']:.1f} | "
            f"{rec['torch_tp_overhead_us']:+.1f} | {rec['torch_tp_over_raw']:.2f} | "
            f"{rec['torch_tp_over_functional']:.2f} | {im['torch_tp']['busbw_GBps']:.3f} | "
            f"{im['raw']['busbw_GBps']:.3f} |"
        )
    return "\n".join(lines)


def plot(records: List[Dict], ops: List[str], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ops), figsize=(5.2 * len(ops), 4.4), squeeze=False)
    styles = {"torch_tp": ("o-", "C0"), "functional": ("s--", "C1"), "raw": ("^:", "C2")}
    for ax, op in zip(axes[0], ops):
        recs = sorted((r for r in records if r["op"] == op), key=lambda r: r["size_bytes"])
        xs = [r["size_bytes"] for r in recs]
        for impl in IMPLS:
            med = [r["impls"][impl]["median_us"] for r in recs]
            lo = [m - r["impls"][impl]["p10_us"] for m, r in zip(med, recs)]
            hi = [r["impls"][impl]["p90_us"] - m for m, r in zip(med, recs)]
            fmt, color = styles[impl]
            ax.errorbar(xs, med, yerr=[lo, hi], fmt=fmt, color=color, capsize=2, ms=4, label=IMPL_LABELS[impl])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([fmt_size(x).replace(" ", "") for x in xs], rotation=45)
        ax.set_title(op)
        ax.set_xlabel("message size (per-rank input" + (" shard" if op == "all_gather" else "") + ")")
        ax.set_ylabel("latency, us (median; bars p10-p90)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def results_section(meta: Dict, table: str) -> str:
    m = meta["machine"]
    return "\n".join(
        [
            SECTION_BEGIN,
            "## Collectives: torch_tp vs functional collectives vs raw c10d",
            "",
            f"Command: `{meta['command']}`",
            "",
            f"Machine: {m['cpu_model']}, {m['cpus_usable']} usable cores ({m['cpu_count']} online), "
            f"torch {m['torch_version']}, torch_tp {m['torch_tp_version']}, Python {m['python_version']}, "
            f"backend {m['backend']}, world size {m['world_size']}, "
            f"{m['torch_num_threads']} intra-op thread(s) per rank.",
            "",
            f"Date: {meta['date']}" + (" (quick smoke run: few repeats, not for conclusions)" if meta["quick"] else ""),
            "",
            "Method: CPU float32 tensors; size is the per-rank input (all_gather: the per-rank input shard). "
            "The three implementations of every op are interleaved within each repeat in a rotating order, "
            "each timed call is preceded by `dist.barrier()`, each rank times its own calls and the per-repeat "
            "time is the max over ranks. Figures are medians over repeats (p10/p90 in the json); "
            "`torch_tp overhead` is the median of the per-repeat paired differences torch_tp - raw; "
            "ratios are ratios of medians. busbw follows nccl-tests: all_reduce algbw*2(p-1)/p, "
            "all_gather/reduce_scatter algbw*(p-1)/p on the full tensor size; GB = 1e9 bytes. "
            "`raw c10d` writes into preallocated buffers (all_reduce in place); torch_tp and "
            "functional collectives allocate their outputs.",
            "",
            table,
            "",
            "![latency vs message size](collectives.png)",
            "",
            "Raw figures, per-repeat times and p10/p90: [collectives.json](collectives.json).",
            SECTION_END,
        ]
    )


def update_results_md(path: str, section: str) -> None:
    """Replace the bench_collectives section of RESULTS.md, or append it; keep everything else."""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    else:
        text = "# torch_tp benchmark results\n\nEach section is written by the benchmark script named in its markers.\n"
    begin = text.find(SECTION_BEGIN)
    end = text.find(SECTION_END, begin + len(SECTION_BEGIN)) if begin >= 0 else -1
    if begin >= 0 and end >= 0:
        text = text[:begin] + section + text[end + len(SECTION_END):]
    else:
        if begin >= 0:  # a begin marker with no end: refuse to guess what to cut
            raise RuntimeError(f"{path}: found {SECTION_BEGIN} without {SECTION_END}; fix the file by hand")
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print(
            "bench_collectives.py: launch with torchrun, e.g.\n"
            "  torchrun --nproc-per-node 2 benchmarks/bench_collectives.py --quick",
            file=sys.stderr,
        )
        return 2
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    start = time.perf_counter()
    try:
        for nbytes in args.sizes:
            if nbytes % (4 * world):
                raise ValueError(f"size {nbytes} B must be a multiple of 4 * world_size = {4 * world}")
        meta = {
            "benchmark": "bench_collectives",
            "command": command_line(),
            "argv": sys.argv,
            "date": datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds"),
            "quick": args.quick,
            "machine": machine_info(world),
            "dtype": "float32",
            "device": "cpu",
            "method": {
                "interleaved": "all impls of all ops within each repeat, order rotated per repeat",
                "barrier_before_each_call": True,
                "per_repeat_time": "max over ranks of each rank's wall time (perf_counter) of the call",
                "stat": "median over repeats; p10/p90 reported",
                "overhead_us": "median over repeats of the paired difference torch_tp - raw",
                "ratios": "ratio of medians",
                "busbw": "nccl-tests: all_reduce algbw*2(p-1)/p; all_gather, reduce_scatter algbw*(p-1)/p; "
                "algbw = full tensor bytes / median time; GB = 1e9 bytes",
                "size": "bytes of the per-rank input (all_gather: per-rank input shard)",
                "raw_calls": {
                    "all_reduce": "dist.all_reduce (in place)",
                    "all_gather": f"dist.{RAW_ALL_GATHER.__name__}",
                    "reduce_scatter": f"dist.{RAW_REDUCE_SCATTER.__name__}",
                },
                "functional_calls": {
                    "all_reduce": "funcol.all_reduce + wait",
                    "all_gather": f"funcol.{FC_ALL_GATHER.__name__} + wait",
                    "reduce_scatter": f"funcol.{FC_REDUCE_SCATTER.__name__} + wait",
                },
            },
        }
        records = bench(args, group, rank, world)
        meta["elapsed_s"] = time.perf_counter() - start
        if rank == 0:
            os.makedirs(args.out_dir, exist_ok=True)
            table = markdown_table(records)
            json_path = os.path.join(args.out_dir, "collectives.json")
            with open(json_path, "w") as f:
                json.dump({**meta, "results": records}, f, indent=1)
            png_path = os.path.join(args.out_dir, "collectives.png")
            m = meta["machine"]
            plot(
                records,
                args.ops,
                png_path,
                f"{m['backend']}, world size {world}, {m['cpu_model']} ({m['cpus_usable']} cores), "
                f"torch {m['torch_version']}" + (" [quick]" if args.quick else ""),
            )
            print()
            print(table)
            print()
            written = [json_path, png_path]
            if not args.no_results_md:
                md_path = os.path.join(args.out_dir, "RESULTS.md")
                update_results_md(md_path, results_section(meta, table))
                written.append(md_path)
            print(f"[bench_collectives] {meta['elapsed_s']:.1f} s; wrote " + ", ".join(written), flush=True)
        dist.barrier(group=group)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
