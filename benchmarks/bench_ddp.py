#!/usr/bin/env python3
r"""Benchmark data-parallel training steps: torch_tp.DistributedDataParallel vs torch's DDP, same backend.

Launch with ``torchrun``, one process per rank (CPU tensors, float32, one
intra-op thread per rank)::

    torchrun --nproc-per-node 2 benchmarks/bench_ddp.py [--backend gloo|torch_tp] [--quick] [--out-dir DIR]

The model is an MLP of ``--layers`` Linear(d, d) + GELU layers (default 8 x
1536: 18.9 M parameters, 75 MB of fp32 gradients), batch ``--batch`` rows. Both
wrappers get deep copies of one model and the same inputs, at each bucket cap
of ``--bucket-mb`` (default 1, 5, 25, 100 MiB).

Per bucket cap and implementation, three times are measured:

* ``step``: forward, loss, ``loss.backward()``; ends when every ``.grad`` holds
  the average over the ranks (both reducers wait for their buckets inside backward);
* ``compute``: the same step under ``no_sync()`` (no communication at all);
* ``comm`` (one figure per bucket cap, shared): all-reducing a flat fp32
  gradient of the model's size in buckets of the cap, started back to back and
  then waited: the communication alone.

``hidden = (compute + comm - step) / comm`` is the share of the all-reduce time
that the step hides behind backward (1: all of it; 0: none; negative: the
step costs more than compute and communication one after the other).

NOTE [same computation]: before timing, one step of each implementation is
checked: the averaged gradients must be bitwise equal between torch_tp and
torch DDP (same backend, buckets and inputs) on every rank.

NOTE [method] (benchmarks/_common.py's, with these choices): two untimed warm-up steps (the buckets are rebuilt after the
first). Every repeat then runs one step of each implementation, the order
alternating between repeats, then one compute-only step of each and one
communication-only round; ``dist.barrier()`` precedes each; gradients are set
to None untimed. A repeat's time is the slowest rank's. Reported: median over
repeats, p10/p90; torch / torch_tp is the ratio of the step medians. Cyclic GC
is off while timing.

Target, printed PASS/MISS: torch_tp no slower than torch DDP on the same
backend, torch / torch_tp >= 1 at every bucket cap, within ``NOISE``: both
run the same all-reduces on the same buckets, so what a reducer can win is
its own bookkeeping and how early it launches a bucket; losing means its
Python or C++ overhead shows. ``NOISE`` is how much the figures of two
identical runs differ on a shared machine.

Rank 0 writes ``ddp.json`` (``ddp_<backend>.json`` for a backend other than
gloo), the matching ``.png`` and the ``bench_ddp`` section of ``RESULTS.md``.
"""

import argparse
import copy
import sys
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from _common import Output, add_output_args, check_everywhere, figure, rotations, run, save_figure, time_interleaved

import torch_tp

IMPLS = ("torch_tp", "torch")
NOISE = 0.03


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench_ddp.py",
        description=(
            "Time data-parallel training steps of a ~20M-parameter MLP with torch_tp.DistributedDataParallel "
            "and torch.nn.parallel.DistributedDataParallel side by side in one torchrun job, over a sweep of "
            "bucket caps, with the compute-only step (no_sync) and the communication alone."
        ),
    )
    p.add_argument("--backend", default="gloo", choices=["gloo", "torch_tp"],
                   help="process-group backend for both wrappers (default: %(default)s)")
    add_output_args(p, "ddp.json, ddp.png", quick="smoke run: small model, few repeats")
    p.add_argument("--bucket-mb", default="1,5,25,100", help="comma-separated bucket caps in MiB (default: %(default)s)")
    p.add_argument("--layers", type=int, default=8, help="Linear layers (default: %(default)s)")
    p.add_argument("--dim", type=int, default=1536, help="layer width (default: %(default)s)")
    p.add_argument("--batch", type=int, default=32, help="rows per rank (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=9, help="timed repeats per bucket cap (default: %(default)s)")
    args = p.parse_args(argv)
    args.bucket_mb = [float(v) for v in args.bucket_mb.split(",") if v.strip()]
    if args.quick:
        args.layers, args.dim, args.repeats = 4, 512, 3
    return args


class MLP(nn.Module):
    def __init__(self, layers: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return x


def bench(args: argparse.Namespace, rank: int) -> List[Dict]:
    torch.manual_seed(0)
    model = MLP(args.layers, args.dim)
    numel = sum(p.numel() for p in model.parameters())
    x = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(rank))
    records = []
    for cap in args.bucket_mb:
        wrapped = {
            "torch_tp": torch_tp.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=cap),
            "torch": torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=cap),
        }

        def step(ddp, sync=True):
            for p in ddp.parameters():
                p.grad = None
            if sync:
                ddp(x).square().mean().backward()
            else:
                with ddp.no_sync():
                    ddp(x).square().mean().backward()

        for ddp in wrapped.values():  # warm-up; the buckets are rebuilt after the first
            step(ddp)
            step(ddp)
        # NOTE [same computation]
        same = all(torch.equal(p.grad, q.grad)
                   for p, q in zip(wrapped["torch_tp"].parameters(), wrapped["torch"].parameters()))

        def same_grads() -> Dict[str, float]:
            if not same:
                raise AssertionError("gradients not bitwise equal")
            return {}

        check_everywhere(same_grads, f"bench_ddp: bucket {cap:g} MiB: torch_tp and torch DDP gradients differ",
                         dist.group.WORLD)

        flat = torch.zeros(numel)
        chunk = max(1, int(cap * 1024 * 1024) // 4)
        buckets = list(flat.split(chunk))

        def comm():
            works = [dist.all_reduce(b, async_op=True) for b in buckets]
            for w in works:
                w.wait()

        steps = {"comm": comm}
        for impl, ddp in wrapped.items():
            steps[f"{impl}_step"] = lambda ddp=ddp: step(ddp)
            steps[f"{impl}_compute"] = lambda ddp=ddp: step(ddp, sync=False)
        rotate = rotations(IMPLS)  # two: the order alternates
        samples = time_interleaved(
            steps, args.repeats, dist.group.WORLD,
            order=lambda r: [f"{i}_step" for i in rotate(r)] + [f"{i}_compute" for i in rotate(r)] + ["comm"])
        record = {"bucket_mb": cap, "params": numel, "buckets": len(wrapped["torch_tp"].reducer.bucket_indices())}
        for key in steps:
            record[key] = samples.stats(key, "ms")
        c = record["comm"]["median_ms"]
        for impl in IMPLS:
            s, k = record[f"{impl}_step"]["median_ms"], record[f"{impl}_compute"]["median_ms"]
            record[f"{impl}_hidden"] = (k + c - s) / c if c > 0 else float("nan")
        record["ratio"] = record["torch_step"]["median_ms"] / record["torch_tp_step"]["median_ms"]
        records.append(record)
        if rank == 0:
            print(f"[bench_ddp] {cap:g} MiB: torch_tp {record['torch_tp_step']['median_ms']:.1f} ms, "
                  f"torch {record['torch_step']['median_ms']:.1f} ms, ratio {record['ratio']:.3f}", flush=True)
        del wrapped
    return records


def markdown_table(records: List[Dict]) -> str:
    lines = [
        "| bucket cap | buckets | torch_tp step ms | torch step ms | torch / torch_tp | compute-only ms (torch_tp / torch) "
        "| comm-only ms | hidden: torch_tp / torch |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in records:
        lines.append(
            f"| {r['bucket_mb']:g} MiB | {r['buckets']} | {r['torch_tp_step']['median_ms']:.1f} "
            f"({r['torch_tp_step']['p10_ms']:.1f}-{r['torch_tp_step']['p90_ms']:.1f}) "
            f"| {r['torch_step']['median_ms']:.1f} ({r['torch_step']['p10_ms']:.1f}-{r['torch_step']['p90_ms']:.1f}) "
            f"| {r['ratio']:.3f} | {r['torch_tp_compute']['median_ms']:.1f} / {r['torch_compute']['median_ms']:.1f} "
            f"| {r['comm']['median_ms']:.1f} | {r['torch_tp_hidden']:.0%} / {r['torch_hidden']:.0%} |")
    return "\n".join(lines)


def targets(records: List[Dict]) -> List[str]:
    out = []
    for r in records:
        verdict = "PASS" if r["ratio"] >= 1.0 else ("PASS (within noise)" if r["ratio"] >= 1.0 - NOISE else "MISS")
        out.append(f"- {r['bucket_mb']:g} MiB: torch / torch_tp = {r['ratio']:.3f} (target >= 1): {verdict}")
    return out


def plot(path: str, report: Dict) -> None:
    records = report["results"]
    labels = [f"{r['bucket_mb']:g} MiB" for r in records]
    xs = range(len(records))
    fig, axes = figure(1, 1, (9, 4.5))
    ax = axes[0][0]
    width = 0.2
    series = [("torch_tp step", "torch_tp_step"), ("torch DDP step", "torch_step"),
              ("compute only (torch_tp, no_sync)", "torch_tp_compute"), ("all-reduce only", "comm")]
    for i, (label, key) in enumerate(series):
        ax.bar([x + (i - 1.5) * width for x in xs], [r[key]["median_ms"] for r in records], width, label=label)
    ax.set_xticks(list(xs), labels)
    ax.set_xlabel("bucket cap")
    ax.set_ylabel("median ms")
    ax.set_title(f"DDP step, {report['backend']}, world size {report['machine']['world_size']}, torch "
                 f"{report['machine']['torch_version']}" + (" [quick]" if report["quick"] else ""), fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def results_section(report: Dict) -> List[str]:
    m, records = report["machine"], report["results"]
    return [
        f"## Data parallel: torch_tp.DistributedDataParallel vs torch DDP ({report['backend']})",
        "",
        f"`{report['command']}` — {report['date']}, {m['cpu_model']} ({m['cpus_usable']} usable cores), "
        f"torch {m['torch_version']}, world size {m['world_size']}, 1 thread/rank"
        + (" **[quick]**" if report["quick"] else ""),
        "",
        f"Model: MLP of {report['layers']} x Linear({report['dim']}, {report['dim']}) + GELU, "
        f"{records[0]['params'] / 1e6:.1f} M fp32 parameters, batch {report['batch']} per rank. Gradients checked "
        "bitwise equal to torch DDP's before timing. Median over repeats (p10-p90); a repeat is the slowest rank. "
        "compute-only: the same step under no_sync(); comm-only: the model's gradient size all-reduced in buckets of "
        "the cap; hidden = (compute + comm - step) / comm.",
        "",
        markdown_table(records),
        "",
        "Target: torch_tp no slower than torch DDP on the same backend.",
        "",
        *targets(records),
    ]


def measure(args: argparse.Namespace) -> Output:
    records = bench(args, dist.get_rank())
    data = {"backend": args.backend, "layers": args.layers, "dim": args.dim, "batch": args.batch,
            "repeats": args.repeats, "results": records}
    suffix = "" if args.backend == "gloo" else f"_{args.backend}"
    return Output(tag=f"bench_ddp{suffix}", stem=f"ddp{suffix}", data=data, section=results_section, plot=plot,
                  console=[markdown_table(records), "", *targets(records)])


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    return run("bench_ddp", args, lambda: measure(args), backend=args.backend)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
