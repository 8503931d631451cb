#!/usr/bin/env python3
r"""The torch_tp backend at the latency limit: against DeepSpeed's CPU shared-memory all-reduce and gloo.

Launch with ``torchrun``, one process per rank::

    torchrun --nproc-per-node 2 benchmarks/bench_backend_latency.py [--quick] [--no-breakdown]

One job times, for float32 and bfloat16 (``--dtypes``: float16 too) and S in 4 KiB, 64 KiB, 1 MiB, 16 MiB
(sizes as in bench_backend.py: S is the all_reduce tensor, the all_gather output, the reduce_scatter input),
side by side:

- ``tp dist``: ``dist.all_reduce`` on a ``dist.new_group(backend="torch_tp")`` group (in place);
- ``tp op``: ``torch.ops.torch_tp.all_reduce`` on that group (functional: a fresh output), which skips the
  Python c10d wrapper, and ``tp op_``: ``torch.ops.torch_tp.all_reduce_`` (in place, as DeepSpeed's raw op);
- ``ds``: ``deepspeed.comm.inference_all_reduce`` (in place), and ``ds raw``: the op behind it,
  ``torch.ops.deepspeed.inference_all_reduce_``;
- ``gloo``: ``dist.all_reduce`` on the default (gloo) group;
- ``tp dist`` and ``tp op`` of all_gather (``dist.all_gather_single``, ``torch.ops.torch_tp.all_gather``)
  and reduce_scatter (``dist.reduce_scatter_single``, ``torch.ops.torch_tp.reduce_scatter``), which DeepSpeed
  has no counterpart of: they are compared with the same-size all-reduce. (Before torch 2.13 the two are
  ``all_gather_into_tensor`` and ``reduce_scatter_tensor``; from 2.13 those names are deprecated and warn on
  every call, about 1.5 us at 4 KiB.)

DeepSpeed is a peer, never a dependency: when it is not installed (or its op does not build, or the CPU lacks
the ISA its kernels need) its columns are skipped and the section says why. It needs ``DS_ACCELERATOR=cpu``
and ``LOCAL_SIZE`` equal to the world size before it is imported (it sets up shared memory only then;
torchrun does not set it): this script sets both. Its op builds on first use (g++, ninja).

NOTE [method] (benchmarks/_common.py's): every implementation of one (dtype, size) runs in the same rounds, in
an order rotating from round to round; a sample is a batch of back-to-back calls (many for small S, so the
clock resolves them) preceded by a torch_tp barrier (a tight start for every implementation), the per-call
time is the batch time over its length, a round's time is the slowest rank's, and figures are medians over
rounds with p10/p90. Results are checked first: every implementation's sum of known values is exact.

With ``--breakdown`` (the default), a first phase splits a 4 KiB float32 all-reduce into its layers, the same
rounds timing: ``dist.all_reduce`` on a no-op group (torch's fake backend: the Python c10d wrapper, the
dispatcher and the Work, with no communication), ``dist.barrier`` on the torch_tp group (one transport step
without data), ``dist.all_reduce(async_op=True).wait()`` (the call handed to the worker thread), the
synchronous call, which runs inline (NOTE [synchronous calls run inline] in work_queue.h), the ops (which call
the backend directly: NOTE [direct calls from the ops] in process_group_shm.h), and ``torch.ops.aten.clone``
of the same tensor: what any functional op called through ``torch.ops`` pays before it communicates.

Targets (2 ranks), printed PASS/MISS: at 4 KiB and 64 KiB, ``tp dist`` at or below ``ds`` and ``tp op`` at or
below ``ds raw`` (and ``tp op_``, the like-for-like in-place op, too); at 1 MiB ``tp dist`` at or below ``ds``;
at 16 MiB ``tp dist`` at least 1.5x faster than ``ds``; all_gather and reduce_scatter (``tp dist``) at or below
the same-size ``ds`` all-reduce.
"""

import argparse
import os
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

# DeepSpeed reads these when it is imported and initialised; set before anything imports it.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))

import torch
import torch.distributed as dist

import torch_tp  # noqa: F401  (registers the torch_tp backend and ops)
from _common import (
    KiB,
    MiB,
    Output,
    add_output_args,
    fmt_size,
    make_noop_group,
    run,
    section_head,
    target_lines,
    time_interleaved,
)

SIZES = [4 * KiB, 64 * KiB, MiB, 16 * MiB]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_DTYPES = "float32,bfloat16"
ALL_REDUCE = ["tp dist", "tp op", "tp op_", "ds", "ds raw", "gloo"]
OTHERS = ["all_gather tp dist", "all_gather tp op", "reduce_scatter tp dist", "reduce_scatter tp op"]


def batch_calls(size: int) -> int:
    return 100 if size <= 64 * KiB else 10 if size <= MiB else 1


def rounds(size: int, quick: bool) -> int:
    return 5 if quick else 15 if size <= MiB else 7


def setup_deepspeed(p: int) -> Tuple[Optional[Callable], Optional[Callable], str]:
    """DeepSpeed's ``(inference_all_reduce, raw op)``, or ``(None, None, why not)``; the same on every rank."""
    ds_call = ds_raw = None
    why = ""
    try:
        import deepspeed
        import deepspeed.comm as ds_comm

        if os.environ["LOCAL_SIZE"] != str(p):
            raise RuntimeError(f"LOCAL_SIZE={os.environ['LOCAL_SIZE']} is not the world size {p}: "
                               "DeepSpeed would not use shared memory")
        deepspeed.init_distributed(dist_backend="gloo")
        backend = ds_comm.comm.cdb
        if getattr(backend, "shm_comm_op", None) is None:
            raise RuntimeError("DeepSpeed's deepspeed_shm_comm op did not build")
        if getattr(backend, "shm_vector_kernel_level", 0) < 2:
            raise RuntimeError("the CPU lacks avx512bw, which DeepSpeed's bf16 shm kernel needs")
        ds_call = lambda t: ds_comm.inference_all_reduce(t)  # noqa: E731
        ds_raw = torch.ops.deepspeed.inference_all_reduce_
        why = f"DeepSpeed {deepspeed.__version__}"
    except Exception as e:  # not installed, or unusable here: skip its columns, say why
        ds_call, ds_raw, why = None, None, f"{type(e).__name__}: {e}"
    ok = torch.tensor([0 if ds_call is None else 1], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        return None, None, why if ds_call is None else "DeepSpeed is unusable on another rank"
    return ds_call, ds_raw, why


def make_steps(dtype: torch.dtype, size: int, tp, p: int, ds_call, ds_raw) -> Dict[str, Callable[[], object]]:
    """Every implementation of one (dtype, size), each on buffers of its own; in-place sums of zeros stay zero."""
    numel = size // torch.tensor([], dtype=dtype).element_size()
    numel -= numel % p
    name = tp.group_name
    buf = {k: torch.zeros(numel, dtype=dtype) for k in ALL_REDUCE}
    shard = torch.zeros(numel // p, dtype=dtype)
    full = torch.zeros(numel, dtype=dtype)
    gathered = torch.empty(numel, dtype=dtype)
    scattered = torch.empty(numel // p, dtype=dtype)
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    steps = {
        "tp dist": lambda: dist.all_reduce(buf["tp dist"], group=tp),
        "tp op": lambda: torch.ops.torch_tp.all_reduce(buf["tp op"], "sum", name),
        "tp op_": lambda: torch.ops.torch_tp.all_reduce_(buf["tp op_"], "sum", name),
        "gloo": lambda: dist.all_reduce(buf["gloo"]),
        "all_gather tp dist": lambda: all_gather_single(gathered, shard, group=tp),
        "all_gather tp op": lambda: torch.ops.torch_tp.all_gather(shard, 0, name, None),
        "reduce_scatter tp dist": lambda: reduce_scatter_single(scattered, full, group=tp),
        "reduce_scatter tp op": lambda: torch.ops.torch_tp.reduce_scatter(full, 0, "sum", name),
    }
    if ds_call is not None:
        steps["ds"] = lambda: ds_call(buf["ds"])
        steps["ds raw"] = lambda: ds_raw(buf["ds raw"])
    return steps


def check(dtype: torch.dtype, tp, p: int, rank: int, ds_call, ds_raw) -> None:
    """Every implementation on small integers (exact in both dtypes): all-reduce gives the sum over ranks."""
    x = torch.arange(1024, dtype=torch.float32).remainder(7).to(dtype) + rank
    want = (torch.arange(1024, dtype=torch.float32).remainder(7) * p + sum(range(p))).to(dtype)
    results = {
        "tp dist": (lambda t: (dist.all_reduce(t, group=tp), t)[1])(x.clone()),
        "tp op": torch.ops.torch_tp.all_reduce(x, "sum", tp.group_name),
        "tp op_": (lambda t: (torch.ops.torch_tp.all_reduce_(t, "sum", tp.group_name), t)[1])(x.clone()),
        "gloo": (lambda t: (dist.all_reduce(t), t)[1])(x.clone()),
        "reduce_scatter tp op": torch.ops.torch_tp.reduce_scatter(x, 0, "sum", tp.group_name),
        "all_gather tp op": torch.ops.torch_tp.all_gather(x, 0, tp.group_name, None),
    }
    if ds_call is not None:
        results["ds"] = ds_call(x.clone())
        results["ds raw"] = ds_raw(x.clone())
    piece = 1024 // p
    for key, got in results.items():
        if key.startswith("all_gather"):
            ref = torch.cat([torch.arange(1024, dtype=torch.float32).remainder(7).to(dtype) + r for r in range(p)])
        elif key.startswith("reduce_scatter"):
            ref = want[rank * piece:(rank + 1) * piece]
        else:
            ref = want
        if not torch.equal(got, ref):
            raise AssertionError(f"bench_backend_latency: {key} {dtype}: wrong result on rank {rank}")


def breakdown(tp, p: int, quick: bool, ds_raw) -> Dict[str, Dict]:
    """The layers of a 4 KiB float32 all-reduce, timed in the same rounds (see the module docstring)."""
    fake, why = make_noop_group(dist.group.WORLD)
    t = {k: torch.zeros(1024) for k in ("fake", "sync", "async", "ds raw", "clone")}
    steps = {
        "torch_tp barrier": lambda: dist.barrier(group=tp),
        "tp dist async_op=True + wait": lambda: dist.all_reduce(t["async"], group=tp, async_op=True).wait(),
        "tp dist": lambda: dist.all_reduce(t["sync"], group=tp),
        "tp op": lambda: torch.ops.torch_tp.all_reduce(t["sync"], "sum", tp.group_name),
        "tp op_": lambda: torch.ops.torch_tp.all_reduce_(t["sync"], "sum", tp.group_name),
        "aten.clone through torch.ops (no communication)": lambda: torch.ops.aten.clone(t["clone"]),
    }
    if fake is not None:
        steps["no-op group dist.all_reduce"] = lambda: dist.all_reduce(t["fake"], group=fake)
    if ds_raw is not None:
        steps["ds raw"] = lambda: ds_raw(t["ds raw"])
    samples = time_interleaved(steps, rounds(4 * KiB, quick), dist.group.WORLD, calls=batch_calls(4 * KiB),
                               warmup=1, barrier=lambda key: dist.barrier(group=tp))
    out = {k: samples.stats(k, "us") for k in steps}
    if fake is None:
        out["no-op group dist.all_reduce"] = {"skipped": why}
    return out


def measure_one(dtype_name: str, size: int, tp, p: int, quick: bool, ds_call, ds_raw) -> Dict:
    steps = make_steps(DTYPES[dtype_name], size, tp, p, ds_call, ds_raw)
    samples = time_interleaved(steps, rounds(size, quick), dist.group.WORLD, calls=batch_calls(size), warmup=1,
                               barrier=lambda key: dist.barrier(group=tp))
    return {"dtype": dtype_name, "bytes": size,
            "impls": {k: {s: v for s, v in samples.stats(k, "us").items() if not s.startswith("per_rank")}
                      for k in steps}}


def us(record: Dict, key: str) -> Optional[float]:
    impl = record["impls"].get(key)
    return None if impl is None else impl["median_us"]


def targets(records: List[Dict], p: int) -> List[Dict]:
    if p != 2:
        return []
    out = []

    def add(target: str, ours: Optional[float], theirs: Optional[float], factor: float = 1.0) -> None:
        if ours is None or theirs is None:
            return
        out.append({"target": target, "value": f"{ours:.1f} vs {theirs:.1f} us ({theirs / ours:.2f}x)",
                    "pass": ours * factor <= theirs})

    for r in records:
        where = f"{r['dtype']} {fmt_size(r['bytes'])}"
        if r["bytes"] <= 64 * KiB:
            add(f"{where}: tp dist <= ds", us(r, "tp dist"), us(r, "ds"))
            add(f"{where}: tp op <= ds raw", us(r, "tp op"), us(r, "ds raw"))
            add(f"{where}: tp op_ <= ds raw", us(r, "tp op_"), us(r, "ds raw"))
        elif r["bytes"] <= MiB:
            add(f"{where}: tp dist <= ds", us(r, "tp dist"), us(r, "ds"))
        else:
            add(f"{where}: tp dist >= 1.5x faster than ds", us(r, "tp dist"), us(r, "ds"), 1.5)
        for op in ("all_gather", "reduce_scatter"):
            add(f"{where}: {op} tp dist <= ds all_reduce", us(r, f"{op} tp dist"), us(r, "ds"))
    return out


def results_section(report: Dict) -> List[str]:
    p = report["machine"]["world_size"]
    keys = ALL_REDUCE + OTHERS
    lines = section_head(report, f"## The torch_tp backend against DeepSpeed's shm all-reduce and gloo, {p} ranks")
    lines += [
        f"Peers: {report['deepspeed']}. Method: the docstring of benchmarks/bench_backend_latency.py "
        "(every column of a row timed in the same rounds; medians of the slowest rank, us per call).",
        "",
        "Load average (1, 5, 15 min) at the start: {:.1f}, {:.1f}, {:.1f}; at the end: {:.1f}, {:.1f}, {:.1f} "
        "(the machine is shared: other jobs run beside this one).".format(*report["loadavg_start"],
                                                                           *report["loadavg_end"]),
        "",
        "| dtype | size | " + " | ".join(keys) + " | ds / tp dist | ds raw / tp op | ds raw / tp op_ |",
        "| --- | ---: | " + " | ".join("---:" for _ in keys) + " | ---: | ---: | ---: |",
    ]
    for r in report["records"]:
        cells = []
        for k in keys:
            v = us(r, k)
            cells.append("-" if v is None else
                         f"{v:.1f} ({r['impls'][k]['p10_us']:.1f}-{r['impls'][k]['p90_us']:.1f})")
        ratio = lambda a, b: "-" if us(r, a) is None or us(r, b) is None else f"{us(r, a) / us(r, b):.2f}"  # noqa
        lines.append(f"| {r['dtype']} | {fmt_size(r['bytes'])} | " + " | ".join(cells)
                     + f" | {ratio('ds', 'tp dist')} | {ratio('ds raw', 'tp op')} | {ratio('ds raw', 'tp op_')} |")
    lines += ["", "Cells: median (p10-p90) us per call."]
    if report.get("breakdown"):
        lines += ["", "4 KiB float32 all-reduce by layer (same rounds; median (p10-p90) us per call):", "",
                  "| what | us |", "| --- | ---: |"]
        for k, v in report["breakdown"].items():
            lines.append(f"| {k} | " + (f"skipped: {v['skipped']}" if "skipped" in v else
                                        f"{v['median_us']:.1f} ({v['p10_us']:.1f}-{v['p90_us']:.1f})") + " |")
    if report["targets"]:
        lines += ["", "Targets:", "", *target_lines(report["targets"])]
    return lines + ["", "Raw figures: [backend_latency_ws{0}.json](backend_latency_ws{0}.json).".format(p)]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="torch_tp backend latency against DeepSpeed's CPU shm all-reduce and gloo "
                    "(launch with torchrun --nproc-per-node 2)")
    add_output_args(parser, "backend_latency_ws<p>.json", quick="smoke run: five rounds per row")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the 4 KiB layer breakdown phase")
    parser.add_argument("--sizes", default=None,
                        help="comma-separated subset of the sizes in bytes (default: 4 KiB, 64 KiB, 1 MiB, 16 MiB)")
    parser.add_argument("--dtypes", default=DEFAULT_DTYPES,
                        help=f"comma-separated dtypes, of {', '.join(DTYPES)} (default: {DEFAULT_DTYPES})")
    args = parser.parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"--dtypes: {', '.join(unknown)} is not one of {', '.join(DTYPES)}")
    return args


def measure(args: argparse.Namespace) -> Output:
    rank, p = dist.get_rank(), dist.get_world_size()
    load_start = os.getloadavg()
    tp = dist.new_group(backend="torch_tp")
    ds_call, ds_raw, ds_note = setup_deepspeed(p)
    if rank == 0:
        print(f"[bench_backend_latency] peers: {ds_note}", flush=True)
    for dtype_name in args.dtypes:
        check(DTYPES[dtype_name], tp, p, rank, ds_call, ds_raw)
    parts = None if args.no_breakdown else breakdown(tp, p, args.quick, ds_raw)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else SIZES
    records = []
    for size in sizes:
        for dtype_name in args.dtypes:
            r = measure_one(dtype_name, size, tp, p, args.quick, ds_call, ds_raw)
            records.append(r)
            if rank == 0:
                print(f"{dtype_name:>8} {fmt_size(size):>7}: " + "  ".join(
                    f"{k} {us(r, k):.1f}" for k in ALL_REDUCE + OTHERS if us(r, k) is not None), flush=True)
    if rank == 0 and parts:
        print("breakdown: " + "  ".join(f"{k} {v['median_us']:.1f}" for k, v in parts.items() if "median_us" in v))
    target_list = targets(records, p)
    data = {"deepspeed": ds_note if ds_call is not None else f"DeepSpeed skipped ({ds_note})",
            "records": records, "breakdown": parts, "targets": target_list,
            "loadavg_start": load_start, "loadavg_end": os.getloadavg()}
    return Output(tag=f"bench_backend_latency ws={p}", stem=f"backend_latency_ws{p}", data=data,
                  section=results_section, console=target_lines(target_list))


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    return run("bench_backend_latency", args, lambda: measure(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
