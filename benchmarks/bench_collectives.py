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

NOTE [method] (benchmarks/_common.py's, with these choices): every repeat runs all three implementations of every op, in an
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

On gloo the collective itself takes hundreds of microseconds with tens of
microseconds of jitter, so the paired difference above cannot resolve an
overhead of a few microseconds. A separate phase (run first; it takes seconds) measures each layer's
own per-call cost (dispatcher, group-name resolution, argument checks, output
allocation, layout work, Work/wait) with the communication taken out:

NOTE [no-op process group]: the same three implementations (the same call
forms as above) run on a second group created inside the same torchrun run,
``dist.new_group(backend="fake")``, next to the gloo world group. The "fake"
backend is torch's ``FakeProcessGroup`` (``torch._C._distributed_c10d``); it is
registered with c10d by importing
``torch.testing._internal.distributed.fake_pg``. Its collectives return an
already completed Work without communicating (all_reduce does nothing;
all_gather / reduce_scatter copy local data into the output so it is not left
uninitialised), so output contents are meaningless there and are not checked;
only shapes are. Sizes are small (default 64 B, 4 KiB, 64 KiB per rank). For
each (size, op), every round runs one batch of back-to-back calls of each
implementation, in an order rotated from round to round, after a gloo barrier
that lines the ranks' rounds up; per-call time = batch time / batch length.
A batch's time is the max over ranks; reported are the median over batches
of the per-call time of each implementation, and the medians over rounds of
the paired per-round differences torch_tp - raw and torch_tp - functional.
``--no-overhead`` skips this phase.

Rank 0 writes ``collectives.json`` (all figures, the per-repeat times and the
machine; the no-op-group phase under ``"overhead_noop_pg"``),
``collectives.png`` (latency vs size, log-log, one subplot per op) and the
``bench_collectives`` section of ``RESULTS.md`` (text outside its markers is
kept; both tables) into ``--out-dir``, and prints the markdown tables.
"""

import argparse
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import torch_tp  # noqa: F401  (registers torch.ops.torch_tp.*)
from _common import (
    KiB,
    MiB,
    Output,
    add_no_overhead_arg,
    add_output_args,
    add_repeat_scale_arg,
    bandwidths_GBps,
    figure,
    fmt_size,
    json_link,
    method_notes,
    noop_phase,
    noop_section,
    parse_size,
    plot_title,
    rotations,
    run,
    save_figure,
    scaled_repeats,
    section_head,
    time_interleaved,
)

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

# The per-call overhead phase on the no-op ("fake") process group: small
# messages, many calls timed in batches (perf_counter around a whole batch, so
# timer resolution and the timer call itself vanish in the per-call figure).
OVERHEAD_SIZES = [64, 4 * KiB, 64 * KiB]
OVERHEAD_CALLS = 5000  # timed calls per (size, op, implementation); --quick: OVERHEAD_CALLS_QUICK
OVERHEAD_CALLS_QUICK = 600
OVERHEAD_BATCH = 100  # calls per timed batch; --quick: OVERHEAD_BATCH_QUICK
OVERHEAD_BATCH_QUICK = 50
OVERHEAD_WARMUP_BATCHES = 2  # untimed batches per (size, op, implementation)

# torch 2.14 deprecates all_gather_into_tensor / reduce_scatter_tensor in favour
# of the *_single names; the deprecated wrappers call warnings.warn on every
# call, which would inflate the floor. Use the new names where they exist.
RAW_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
RAW_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# Same for the functional collectives (all_gather_tensor / reduce_scatter_tensor
# became all_gather_single / reduce_scatter_single, same signatures).
FC_ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
FC_REDUCE_SCATTER = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


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
            "repeats. First (unless --no-overhead), the per-call overhead of each layer: the same three "
            "implementations on a no-op process group (dist.new_group(backend='fake'), torch's "
            "FakeProcessGroup, which does no communication) beside the gloo group, small sizes, many "
            "calls timed in batches, rounds interleaved, median per-call time over batches. "
            "Rank 0 writes collectives.json, collectives.png and the bench_collectives "
            "section of RESULTS.md into --out-dir."
        ),
    )
    add_output_args(p, "collectives.json, collectives.png",
                    quick="smoke run (~40 s): same sizes, about a tenth of the repeats and of the no-op-group calls")
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
    add_repeat_scale_arg(p, "size")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed calls per (size, op, implementation) before timing (default: 5, 2 with --quick; "
        "halved for sizes >= 16 MiB)",
    )
    add_no_overhead_arg(p, "per-call")
    p.add_argument(
        "--overhead-sizes",
        default=None,
        help="comma-separated message sizes for the overhead phase "
        f"(default: {','.join(fmt_size(x).replace(' ', '') for x in OVERHEAD_SIZES)})",
    )
    p.add_argument(
        "--overhead-calls",
        type=int,
        default=None,
        help=f"timed calls per (size, op, implementation) in the overhead phase (default: {OVERHEAD_CALLS}, "
        f"{OVERHEAD_CALLS_QUICK} with --quick)",
    )
    p.add_argument(
        "--overhead-batch",
        type=int,
        default=None,
        help=f"calls per timed batch in the overhead phase (default: {OVERHEAD_BATCH}, "
        f"{OVERHEAD_BATCH_QUICK} with --quick)",
    )
    args = p.parse_args(argv)
    args.sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else list(DEFAULT_SIZES)
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    for o in args.ops:
        if o not in OPS:
            p.error(f"--ops: unknown op {o!r}; choose from {', '.join(OPS)}")
    if args.warmup is None:
        args.warmup = 2 if args.quick else 5
    args.overhead_sizes = (
        [parse_size(s) for s in args.overhead_sizes.split(",")] if args.overhead_sizes else list(OVERHEAD_SIZES)
    )
    if args.overhead_calls is None:
        args.overhead_calls = OVERHEAD_CALLS_QUICK if args.quick else OVERHEAD_CALLS
    if args.overhead_batch is None:
        args.overhead_batch = OVERHEAD_BATCH_QUICK if args.quick else OVERHEAD_BATCH
    if args.overhead_calls < 1 or args.overhead_batch < 1:
        p.error("--overhead-calls and --overhead-batch must be positive")
    return args


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
        repeats = scaled_repeats(default_repeats(nbytes, args.quick), args.repeat_scale)
        warmup = max(1, args.warmup // 2) if nbytes >= 16 * MiB else args.warmup
        steps, resets, full_bytes = {}, {}, {}
        for op in args.ops:
            calls, reset, getters, full_bytes[op] = make_calls(op, nbytes, group, rank, world)
            check_agreement(op, calls, reset, getters)
            for impl in IMPLS:
                steps[f"{op} {impl}"], resets[f"{op} {impl}"] = calls[impl], reset
        rotate = rotations(IMPLS)  # so no implementation always runs first (cold) or last
        t_size = time.perf_counter()
        samples = time_interleaved(
            steps, repeats, group, reset=resets, warmup=warmup, gc_off=False,
            order=lambda r: [f"{op} {impl}" for op in args.ops for impl in rotate(r)])
        elapsed = time.perf_counter() - t_size

        for op in args.ops:
            rec = {
                "op": op,
                "size_bytes": nbytes,
                "size": fmt_size(nbytes),
                "full_tensor_bytes": full_bytes[op],
                "repeats": repeats,
                "warmup": warmup,
                "impls": {},
            }
            for impl in IMPLS:
                s = samples.stats(f"{op} {impl}", "us")
                s["algbw_GBps"], s["busbw_GBps"] = bandwidths_GBps(op, full_bytes[op], s["median_us"] * 1e-6, world)
                rec["impls"][impl] = s
            med = {k: rec["impls"][k]["median_us"] for k in IMPLS}
            rec["torch_tp_overhead_us"] = samples.paired(f"{op} torch_tp", f"{op} raw", "us")
            rec["torch_tp_minus_raw_medians_us"] = med["torch_tp"] - med["raw"]
            rec["torch_tp_over_raw"] = med["torch_tp"] / med["raw"]
            rec["torch_tp_over_functional"] = med["torch_tp"] / med["functional"]
            rec["functional_overhead_us"] = samples.paired(f"{op} functional", f"{op} raw", "us")
            records.append(rec)
        if rank == 0:
            print(
                f"[bench_collectives] {fmt_size(nbytes):>7}: {repeats} repeats x {len(args.ops)} ops x "
                f"{len(IMPLS)} impls in {elapsed:.1f} s",
                flush=True,
            )
    return records


# ---------------------------------------------------------------------------
# per-call overhead on a no-op process group (see NOTE [no-op process group])


def bench_overhead(
    args: argparse.Namespace, fake_group: dist.ProcessGroup, world_group: dist.ProcessGroup, rank: int, world: int
) -> Dict:
    """Per-call time of each implementation on the no-op group; figures in us per call."""
    batch = args.overhead_batch
    n_batches = max(3, -(-args.overhead_calls // batch))
    records = []
    for nbytes in args.overhead_sizes:
        t_size = time.perf_counter()
        for op in args.ops:
            # The same call forms as the gloo phase, bound to the fake group.
            calls, _, getters, _ = make_calls(op, nbytes, fake_group, rank, world)
            # The fake backend's outputs are not the collective's result, so
            # only the shapes are checked, not the values.
            for impl in IMPLS:
                calls[impl]()
            got = {impl: tuple(getters[impl]().shape) for impl in IMPLS}
            if len(set(got.values())) != 1:
                raise RuntimeError(f"{op} on the fake group: output shapes differ: {got}")
            # A round: one batch of each implementation; the gloo barrier before it (untimed) lines the
            # ranks' rounds up so the max over ranks pairs like with like.
            samples = time_interleaved(calls, n_batches, world_group, calls=batch,
                                       warmup=OVERHEAD_WARMUP_BATCHES, barrier="round")
            rec = {"op": op, "size_bytes": nbytes, "size": fmt_size(nbytes), "output_shape": list(got["raw"]),
                   "impls": {impl: samples.stats(impl, "us") for impl in IMPLS}}
            med = {k: rec["impls"][k]["median_us"] for k in IMPLS}
            # Paired per round (the three batches of a round ran back to back).
            rec["torch_tp_minus_raw_us"] = samples.paired("torch_tp", "raw", "us")
            rec["torch_tp_minus_functional_us"] = samples.paired("torch_tp", "functional", "us")
            rec["functional_minus_raw_us"] = samples.paired("functional", "raw", "us")
            rec["torch_tp_minus_raw_medians_us"] = med["torch_tp"] - med["raw"]
            rec["torch_tp_minus_functional_medians_us"] = med["torch_tp"] - med["functional"]
            records.append(rec)
        if rank == 0:
            print(
                f"[bench_collectives] no-op group {fmt_size(nbytes):>7}: {n_batches} x {batch} calls x "
                f"{len(args.ops)} ops x {len(IMPLS)} impls in {time.perf_counter() - t_size:.1f} s",
                flush=True,
            )
    return {
        "group": "dist.new_group(backend='fake') beside the gloo world group, after importing "
        "torch.testing._internal.distributed.fake_pg (registers torch's FakeProcessGroup)",
        "sizes": list(args.overhead_sizes),
        "calls_per_impl": n_batches * batch,
        "batch": batch,
        "batches": n_batches,
        "warmup_batches": OVERHEAD_WARMUP_BATCHES,
        "method": {
            "backend_semantics": "collectives return a completed Work without communicating: all_reduce does "
            "nothing, all_gather / reduce_scatter copy local data into the output; values are not checked, "
            "shapes are",
            "timing": "perf_counter around a batch of back-to-back calls; per-call = batch time / batch",
            "interleaved": "each round: one batch of each implementation, order rotated per round; "
            "gloo barrier (untimed) before each round",
            "per_batch_time": "max over ranks",
            "stat": "median over batches (p10/p90 in impls); per_rank_median_us: each rank's own median",
            "differences": "*_us: median over rounds of the paired per-round difference; "
            "*_medians_us: difference of the medians",
            "gc": "cyclic GC disabled during the timed batches",
        },
        "results": records,
    }


def overhead_markdown_table(records: List[Dict]) -> str:
    lines = [
        "| size | op | torch_tp us/call | functional us/call | raw c10d us/call "
        "| torch_tp - raw us | torch_tp - functional us |",
        "|---:|:---|---:|---:|---:|---:|---:|",
    ]
    for rec in records:
        im = rec["impls"]
        lines.append(
            f"| {rec['size']} | {rec['op']} | {im['torch_tp']['median_us']:.2f} | "
            f"{im['functional']['median_us']:.2f} | {im['raw']['median_us']:.2f} | "
            f"{rec['torch_tp_minus_raw_us']:+.2f} | {rec['torch_tp_minus_functional_us']:+.2f} |"
        )
    return "\n".join(lines)


def overhead_section(overhead: Optional[Dict]) -> List[str]:
    """The RESULTS.md lines for the no-op-group phase ([] when it was not asked for)."""
    return noop_section(overhead, "Per-call overhead on a no-op process group (fake backend", lambda o: [
        "Method: the same three calls on a second group, `dist.new_group(backend=\"fake\")` (torch's "
        "FakeProcessGroup: collectives complete at once without communicating; all_reduce does nothing, "
        "all_gather/reduce_scatter copy local data into the output), so what remains is each layer's own "
        "cost (dispatch, group resolution, checks, output allocation, Work/wait); "
        f"each rank times batches of {o['batch']} back-to-back calls "
        f"({o['calls_per_impl']} calls per size, op and implementation), one batch per implementation "
        "per round in a rotating order, a batch's per-call time is the max over ranks, and figures are "
        "medians over batches (differences: medians of the per-round paired differences).",
        "",
        overhead_markdown_table(o["results"]),
        "",
    ])


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


def plot(path: str, report: Dict) -> None:
    records = report["results"]
    ops = [op for op in OPS if any(r["op"] == op for r in records)]
    fig, axes = figure(1, len(ops), (5.2, 4.4))
    styles = {"torch_tp": ("o-", "C0"), "functional": ("s--", "C1"), "raw": ("^:", "C2")}
    for ax, op in zip(axes[0], ops):
        recs = sorted((r for r in records if r["op"] == op), key=lambda r: r["size_bytes"])
        xs = [r["size_bytes"] for r in recs]
        for impl in IMPLS:
            med = [r["impls"][impl]["median_us"] for r in recs]
            lo = [m_ - r["impls"][impl]["p10_us"] for m_, r in zip(med, recs)]
            hi = [r["impls"][impl]["p90_us"] - m_ for m_, r in zip(med, recs)]
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
    save_figure(fig, path, plot_title(report, threads=False))


def results_section(report: Dict) -> List[str]:
    overhead = report.get("overhead_noop_pg")
    return [
        *section_head(report, "## Collectives: torch_tp vs functional collectives vs raw c10d"),
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
        markdown_table(report["results"]),
        "",
        "![latency vs message size](collectives.png)",
        "",
        *overhead_section(overhead),
        json_link("collectives", overhead),
    ]


# ---------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> Output:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    for nbytes in args.sizes + ([] if args.no_overhead else args.overhead_sizes):
        if nbytes % (4 * world):
            raise ValueError(f"size {nbytes} B must be a multiple of 4 * world_size = {4 * world}")
    data: Dict = {
        "dtype": "float32",
        "device": "cpu",
        "method": {
            "interleaved": "all impls of all ops within each repeat, order rotated per repeat",
            **method_notes("call"),
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
    overhead: Optional[Dict] = None
    if not args.no_overhead:
        # First, so a problem with the fake backend shows in seconds, not minutes.
        overhead = noop_phase("bench_collectives", group,
                              lambda fake: bench_overhead(args, fake, group, rank, world))
    data["results"] = bench(args, group, rank, world)
    if overhead is not None:
        data["overhead_noop_pg"] = overhead
    return Output(tag="bench_collectives", stem="collectives", data=data, section=results_section, plot=plot,
                  console=[markdown_table(data["results"]), "", *overhead_section(overhead)])


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    return run("bench_collectives", args, lambda: measure(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
