#!/usr/bin/env python3
r"""Benchmark the torch_tp process-group backend against gloo on one machine.

Launch with ``torchrun``, one process per rank::

    torchrun --nproc-per-node 2 benchmarks/bench_backend.py [--out-dir benchmarks] [--quick]
    torchrun --nproc-per-node 4 benchmarks/bench_backend.py

Both backends run in one job: the default group is gloo and a second group over
the same ranks is ``dist.new_group(backend="torch_tp")``. For all_reduce,
all_gather (into one tensor) and reduce_scatter (from one tensor), float32 and
bfloat16, and sizes from 4 KiB to 64 MiB, each repeat times the same call on
both groups, in an order alternating from repeat to repeat, so drift hits both.

NOTE [sizes and bandwidth]: sizes follow the nccl-tests convention: S is the
all_reduce tensor, the all_gather output and the reduce_scatter input (the full
tensor; each rank holds S/p of the latter two). Algorithm bandwidth is
``algbw = S / t``; bus bandwidth, the figure comparable across world sizes and
with a link's speed, is ``busbw = algbw * 2(p-1)/p`` for all_reduce and
``algbw * (p-1)/p`` for all_gather and reduce_scatter. At 2 ranks all_reduce's
busbw equals algbw: the time to reduce S bytes.

NOTE [method] (benchmarks/_common.py's, with these choices): before timing,
each (op, dtype) is checked on a 1 MiB tensor:
torch_tp's result equals gloo's (exactly for all_gather; for sums, the largest
difference within 1e-6 * p of the largest value for float32, 2^-8 * p for
bfloat16, where gloo adds in bfloat16 and torch_tp in float32). A timed sample is a batch of
back-to-back calls (``batch_calls(S)``: more for small S, so the clock
resolves them), preceded by a barrier on the group being timed; per-call time
is the batch time over its length. Each rank records its own times; afterwards
they are gathered, and a sample is the slowest rank's (a collective
is done when it is done everywhere). Reported: medians over the repeats
(p10/p90 in the json) and the ratio gloo / torch_tp of the medians.

The physical limit is measured in the same run: single-core memcpy bandwidth,
``dst.copy_(src)`` of 16 MiB with one intra-op thread on rank 0 while the other
ranks wait (bytes copied per second, the median of 20 copies after warm-up).

Rank 0 writes ``backend_ws<p>.json`` (every figure, per-repeat times, machine),
``backend_ws<p>.png`` (latency and bus bandwidth against size) and the
``bench_backend ws=<p>`` section of ``RESULTS.md`` into ``--out-dir``.

Targets (world size 2), printed PASS/MISS: torch_tp's 64 KiB all_reduce at
least 10x faster than gloo's, because at that size a collective is all fixed
cost (gloo's loopback TCP round trips against a shared-memory copy and a
flag); at 16 MiB, all_reduce bus bandwidth at least 20x gloo's and at least
half the single-core memcpy bandwidth, half being the ceiling of a design
that copies each byte into shared memory and back out besides reducing it
(NOTE [all-reduce traffic] in csrc/backend/shm_collectives.h).
"""

import argparse
import os
import sys
import time
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist

import torch_tp  # noqa: F401  (registers the torch_tp backend)
from _common import (
    KiB,
    MiB,
    Output,
    add_output_args,
    bandwidths_GBps,
    check_everywhere,
    figure,
    fmt_size,
    median,
    rel_diff,
    run,
    save_figure,
    target_lines,
    time_interleaved,
)

SIZES = [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB]
QUICK_SIZES = [4 * KiB, 64 * KiB, MiB, 16 * MiB]
OPS = ["all_reduce", "all_gather", "reduce_scatter"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BACKENDS = ["gloo", "torch_tp"]
MEMCPY_BYTES = 16 * MiB


def batch_calls(size: int) -> int:
    """Calls per timed sample: enough that a sample lasts well above the clock's and barrier's jitter."""
    return 20 if size <= 64 * KiB else 5 if size <= MiB else 1


def repeats(size: int, quick: bool) -> int:
    if quick:
        return 3
    return 30 if size <= MiB else 15 if size <= 16 * MiB else 7


class Collective:
    """One op on one group with preallocated buffers: ``call()`` runs it once."""

    def __init__(self, op: str, dtype: torch.dtype, size: int, group, p: int, rank: int):
        numel = size // torch.tensor([], dtype=dtype).element_size()
        numel -= numel % p  # S must split into p equal pieces for all_gather / reduce_scatter
        gen = torch.Generator().manual_seed(1234 + rank)
        self.op, self.group = op, group
        if op == "all_reduce":
            self.input = torch.randn(numel, generator=gen).to(dtype)
            self.work = self.input.clone()
        elif op == "all_gather":
            self.input = torch.randn(numel // p, generator=gen).to(dtype)
            self.work = torch.empty(numel, dtype=dtype)
        else:
            self.input = torch.randn(numel, generator=gen).to(dtype)
            self.work = torch.empty(numel // p, dtype=dtype)

    def call(self) -> None:
        if self.op == "all_reduce":
            # In place, on the same buffer every time: values grow by p per call
            # (times only; check() starts from a fresh copy).
            dist.all_reduce(self.work, group=self.group)
        elif self.op == "all_gather":
            dist.all_gather_into_tensor(self.work, self.input, group=self.group)
        else:
            dist.reduce_scatter_tensor(self.work, self.input, group=self.group)

    def result(self) -> torch.Tensor:
        if self.op == "all_reduce":
            self.work.copy_(self.input)
        self.call()
        return self.work.clone()


def check(groups: Dict[str, object], op: str, dtype: torch.dtype, p: int, rank: int) -> Dict[str, float]:
    """torch_tp's result against gloo's on a 1 MiB tensor; the largest difference relative to the largest value."""
    ours = Collective(op, dtype, MiB, groups["torch_tp"], p, rank).result().double()
    theirs = Collective(op, dtype, MiB, groups["gloo"], p, rank).result().double()
    # Normwise: sums of p O(1) terms differ by a few roundings of the largest.
    if op == "all_gather":
        tol = 0.0
    else:
        tol = (1e-6 if dtype == torch.float32 else 2.0**-8) * p
    worst = rel_diff(ours, theirs)
    if worst > tol:
        raise AssertionError(f"torch_tp differs from gloo by {worst:.3g} relative (tolerance {tol:g})")
    return {f"{op} {str(dtype).removeprefix('torch.')}": worst}


def memcpy_bandwidth(rank: int) -> float:
    """Single-core memcpy, bytes copied per second (rank 0 measures while the others wait)."""
    value = torch.zeros(1, dtype=torch.float64)
    if rank == 0:
        src = torch.randn(MEMCPY_BYTES // 4)
        dst = torch.empty_like(src)
        for _ in range(5):
            dst.copy_(src)
        times = []
        for _ in range(20):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        value[0] = MEMCPY_BYTES / median(times)
    dist.broadcast(value, src=0)
    return value.item()


def measure_pair(op: str, dtype_name: str, size: int, groups: Dict, p: int, rank: int, quick: bool,
                 memcpy: float) -> Dict:
    """Time the op on both groups, interleaved; its record (per-call medians, bandwidths, ratio)."""
    pair = {name: Collective(op, DTYPES[dtype_name], size, groups[name], p, rank) for name in BACKENDS}
    samples = time_interleaved(
        {name: c.call for name, c in pair.items()}, repeats(size, quick), dist.group.WORLD,
        calls=batch_calls(size), warmup=1, barrier=lambda name: dist.barrier(group=pair[name].group))
    record = {"op": op, "dtype": dtype_name, "bytes": size, "backends": {}}
    for name in BACKENDS:
        st = samples.stats(name, "us")
        algbw, busbw = bandwidths_GBps(op, size, st["median_us"] * 1e-6, p)
        record["backends"][name] = {
            **{k: st[k] for k in ("median_us", "p10_us", "p90_us")},
            "algbw_GBps": algbw, "busbw_GBps": busbw,
            "samples_s": samples.max(name).tolist(),
        }
    gloo, ours = record["backends"]["gloo"], record["backends"]["torch_tp"]
    record["speedup"] = gloo["median_us"] / ours["median_us"]
    record["busbw_over_memcpy"] = ours["busbw_GBps"] * 1e9 / memcpy
    return record


def find(records: List[Dict], op: str, dtype: str, size: int) -> Dict:
    return next(r for r in records if r["op"] == op and r["dtype"] == dtype and r["bytes"] == size)


def targets(records: List[Dict], p: int) -> List[Dict]:
    if p != 2:
        return []
    out = []
    sizes = {r["bytes"] for r in records}
    if 64 * KiB in sizes:
        r = find(records, "all_reduce", "float32", 64 * KiB)
        out.append({"target": "all_reduce 64 KiB float32: gloo / torch_tp latency >= 10",
                    "value": f"{r['speedup']:.1f}x ({r['backends']['gloo']['median_us']:.0f} us vs "
                             f"{r['backends']['torch_tp']['median_us']:.1f} us)", "pass": r["speedup"] >= 10})
    if 16 * MiB in sizes:
        r = find(records, "all_reduce", "float32", 16 * MiB)
        ours, gloo = r["backends"]["torch_tp"]["busbw_GBps"], r["backends"]["gloo"]["busbw_GBps"]
        out.append({"target": "all_reduce 16 MiB float32: torch_tp busbw >= 20x gloo's",
                    "value": f"{ours / gloo:.1f}x ({ours:.2f} vs {gloo:.2f} GB/s)", "pass": ours / gloo >= 20})
        out.append({"target": "all_reduce 16 MiB float32: torch_tp busbw >= 0.5 x single-core memcpy",
                    "value": f"{r['busbw_over_memcpy']:.2f} x memcpy", "pass": r["busbw_over_memcpy"] >= 0.5})
    return out


def plot(path: str, report: Dict) -> None:
    records, p, memcpy = report["records"], report["machine"]["world_size"], report["memcpy_GBps"] * 1e9
    fig, axes = figure(2, len(OPS), (4.2, 3.5))
    for col, op in enumerate(OPS):
        for dtype_name, style in (("float32", "-"), ("bfloat16", "--")):
            rows = sorted((r for r in records if r["op"] == op and r["dtype"] == dtype_name), key=lambda r: r["bytes"])
            if not rows:
                continue
            x = [r["bytes"] for r in rows]
            for name, color in (("gloo", "C1"), ("torch_tp", "C0")):
                axes[0][col].plot(x, [r["backends"][name]["median_us"] for r in rows], style, color=color,
                                  marker="o", ms=3, label=f"{name} {dtype_name}")
                axes[1][col].plot(x, [r["backends"][name]["busbw_GBps"] for r in rows], style, color=color,
                                  marker="o", ms=3, label=f"{name} {dtype_name}")
        axes[1][col].axhline(memcpy / 1e9, color="gray", lw=0.8, ls=":", label="1-core memcpy")
        axes[0][col].set_title(f"{op}, {p} ranks", fontsize=9)
        axes[0][col].set_ylabel("latency, us (median)", fontsize=8)
        axes[1][col].set_ylabel("bus bandwidth, GB/s", fontsize=8)
        for row in range(2):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("size S, bytes", fontsize=8)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6)
    save_figure(fig, path)


def results_section(report: Dict) -> List[str]:
    m, p, records = report["machine"], report["machine"]["world_size"], report["records"]
    lines = [
        f"## The torch_tp backend against gloo, {p} ranks on one machine",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {m['cpu_model']}, {m['cpus_usable']} usable cores, torch {m['torch_version']}, "
        f"Python {m['python_version']}, one intra-op thread per rank. Date: {report['date']}"
        + (" (quick smoke run, few repeats)" if report["quick"] else ""),
        "",
        f"Single-core memcpy bandwidth, same run: **{report['memcpy_GBps']:.2f} GB/s** (16 MiB `copy_`, median).",
        "",
        "Method: see the docstring of benchmarks/bench_backend.py (sizes and bus bandwidth as nccl-tests "
        "define them; medians over repeats of the slowest rank; both backends alternate within each repeat; "
        "results checked against gloo first).",
        "",
        "| op | dtype | size | gloo us | torch_tp us | gloo / torch_tp | gloo busbw GB/s | torch_tp busbw GB/s "
        "| torch_tp busbw / memcpy |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in records:
        g, t = r["backends"]["gloo"], r["backends"]["torch_tp"]
        lines.append(f"| {r['op']} | {r['dtype']} | {fmt_size(r['bytes'])} | {g['median_us']:.1f} | "
                     f"{t['median_us']:.1f} | {r['speedup']:.1f} | {g['busbw_GBps']:.3f} | {t['busbw_GBps']:.3f} | "
                     f"{r['busbw_over_memcpy']:.2f} |")
    if report["targets"]:
        lines += ["", "Targets:", "", *target_lines(report["targets"])]
    return lines + ["", f"![latency and bus bandwidth](backend_ws{p}.png)", "",
                    f"Raw figures and per-repeat times: [backend_ws{p}.json](backend_ws{p}.json)."]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="torch_tp backend vs gloo: all_reduce, all_gather, reduce_scatter latency and bus bandwidth "
                    "(launch with torchrun --nproc-per-node 2 or 4)")
    add_output_args(parser, "backend_ws<p>.json, backend_ws<p>.png", quick="smoke run: four sizes, three repeats")
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> Output:
    rank, p = dist.get_rank(), dist.get_world_size()
    groups = {"gloo": dist.group.WORLD, "torch_tp": dist.new_group(backend="torch_tp")}
    memcpy = memcpy_bandwidth(rank)
    checks: Dict[str, float] = {}
    for op in OPS:
        for dt in DTYPES.values():
            checks.update(check_everywhere(lambda: check(groups, op, dt, p, rank),
                                           f"bench_backend: {op} {dt}: torch_tp differs from gloo", dist.group.WORLD))
    records = []
    for size in (QUICK_SIZES if args.quick else SIZES):
        for op in OPS:
            for dtype_name in DTYPES:
                r = measure_pair(op, dtype_name, size, groups, p, rank, args.quick, memcpy)
                records.append(r)
                if rank == 0:
                    print(f"{op:>14} {dtype_name:>8} {fmt_size(size):>7}: gloo "
                          f"{r['backends']['gloo']['median_us']:9.1f} us  torch_tp "
                          f"{r['backends']['torch_tp']['median_us']:8.1f} us  x{r['speedup']:6.1f}  "
                          f"busbw {r['backends']['torch_tp']['busbw_GBps']:6.2f} GB/s", flush=True)
    target_list = targets(records, p)
    data = {"memcpy_GBps": memcpy / 1e9, "buffer_bytes_env": os.environ.get("TORCH_TP_SHM_BUFFER_BYTES"),
            "checks_worst_rel": checks, "records": records, "targets": target_list}
    return Output(tag=f"bench_backend ws={p}", stem=f"backend_ws{p}", data=data, section=results_section,
                  plot=plot, console=target_lines(target_list))


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    return run("bench_backend", args, lambda: measure(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
