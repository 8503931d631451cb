#!/usr/bin/env python3
"""Single-device cost of the linear ops against nn.Linear, and the fused epilogue.

    python benchmarks/bench_linear_gpu.py [--device cuda] [--size 4096] [--tokens 8192] [--dtype bfloat16]

One process, a process group of world size 1 (so the ops do no
communication): what is measured is the ops' own GEMM path against torch's.

* column_parallel_linear and row_parallel_linear, forward + backward, against
  F.linear with the same weight, bias and upstream gradient. Target: within 3%
  of nn.Linear for 4096x4096 bf16 layers: at world size 1 both run the same
  GEMMs, so what is over is the ops' own cost (dispatch, autograd node,
  checks), which at this size must be lost in the GEMMs' run-to-run spread;
* column_parallel_linear(activation="gelu_tanh"), whose CUDA kernel fuses the
  bias and GELU into the cuBLASLt epilogue, against the unfused
  F.gelu(F.linear(x, W, b), approximate="tanh"), forward and forward + backward.

Method: benchmarks/_common.py's NOTE [method]: the variants of a comparison
alternate within each repeat; each timed call is bracketed by CUDA events
(perf_counter on the CPU); figures are medians over repeats, ratios are ratios
of medians. Before timing, each pair is checked
to compute the same function (bf16: within 2e-2 of the output's scale). The
section between the bench_linear_gpu markers of RESULTS.md in --out-dir is
rewritten with the table, the device and the command.
"""

import argparse
import os
import sys
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torch_tp  # noqa: F401  (registers torch.ops.torch_tp.*)
from _common import Output, add_output_args, cuda_time, rel_diff, run, time_interleaved, wall_time

TAG = "bench_linear_gpu"
TOLERANCE = 2e-2  # bf16: the variants differ by a few roundings of the output's scale


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run)")
    parser.add_argument("--size", type=int, default=4096, help="in and out features of the layer (default 4096)")
    parser.add_argument("--tokens", type=int, default=8192, help="rows of x (default 8192)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    add_output_args(parser, out_dir=os.path.dirname(os.path.abspath(__file__)))
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> Output:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = dist.group.WORLD.group_name
    gen = torch.Generator(device=device).manual_seed(0)
    n, m = args.size, args.tokens
    x = torch.randn(m, n, device=device, dtype=dtype, generator=gen).requires_grad_()
    w = (torch.randn(n, n, device=device, dtype=dtype, generator=gen) / n**0.5).requires_grad_()
    b = torch.randn(n, device=device, dtype=dtype, generator=gen).requires_grad_()
    grad = torch.randn(m, n, device=device, dtype=dtype, generator=gen)

    def fwd_bwd(forward):
        def step():
            for t in (x, w, b):
                t.grad = None
            forward().backward(grad)
        return step

    def fwd(forward):
        def step():
            with torch.no_grad():
                forward()
        return step

    variants = {
        "nn.Linear": lambda: F.linear(x, w, b),
        "column_parallel_linear": lambda: torch.ops.torch_tp.column_parallel_linear(x, w, b, group),
        "row_parallel_linear": lambda: torch.ops.torch_tp.row_parallel_linear(x, w, b, group),
        "unfused linear+gelu": lambda: F.gelu(F.linear(x, w, b), approximate="tanh"),
        "fused epilogue": lambda: torch.ops.torch_tp.column_parallel_linear(x, w, b, group, activation="gelu_tanh"),
    }
    comparisons = [
        ("column fwd+bwd", "column_parallel_linear", "nn.Linear", fwd_bwd),
        ("row fwd+bwd", "row_parallel_linear", "nn.Linear", fwd_bwd),
        ("bias+GELU fwd", "fused epilogue", "unfused linear+gelu", fwd),
        ("bias+GELU fwd+bwd", "fused epilogue", "unfused linear+gelu", fwd_bwd),
    ]
    with torch.no_grad():
        for ours, theirs in [("column_parallel_linear", "nn.Linear"), ("row_parallel_linear", "nn.Linear"),
                             ("fused epilogue", "unfused linear+gelu")]:
            a, e = variants[ours]().float(), variants[theirs]().float()
            error = rel_diff(a, e)
            if error > TOLERANCE:
                raise RuntimeError(f"bench_linear_gpu: {ours} differs from {theirs} by {error:.2e} of the scale")

    rows = []
    for label, ours, theirs, mode in comparisons:
        samples = time_interleaved({name: mode(variants[name]) for name in (ours, theirs)}, args.repeats,
                                   dist.group.WORLD, warmup=args.warmup, barrier=lambda name: None,
                                   timer=cuda_time if device.type == "cuda" else wall_time)
        ours_us, theirs_us = samples.median(ours, "us"), samples.median(theirs, "us")
        rows.append((label, ours, ours_us, theirs, theirs_us, ours_us / theirs_us))

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    table = ["| comparison | torch_tp | us | reference | us | torch_tp / reference |", "|:---|:---|---:|:---|---:|---:|"]
    table += [f"| {label} | {ours} | {a:.1f} | {theirs} | {b_:.1f} | {ratio:.3f} |"
              for label, ours, a, theirs, b_, ratio in rows]

    def section(report: Dict) -> List[str]:
        return [
            "## Linear ops on one device: torch_tp's GEMM path against nn.Linear, and the fused epilogue",
            "",
            f"Command: `{report['command']}`",
            "",
            f"Device: {device_name}, torch {torch.__version__}, {args.dtype}, x [{m}, {n}] @ W [{n}, {n}]^T + b; "
            f"world size 1 (no communication). Date: {report['date']}",
            "",
            "Method: variants alternate within each repeat, each call timed with CUDA events (perf_counter on CPU), "
            f"medians over {args.repeats} repeats after {args.warmup} warm-up rounds. Target: the column and row "
            "ops within 3% of nn.Linear (the same GEMMs at world size 1; what is over is the ops' own cost).",
            "",
            *table,
        ]

    return Output(tag=TAG, data={"rows": rows}, section=section, console=table)


def main(argv):
    args = parse_args(argv)
    return run("bench_linear_gpu", args, lambda: measure(args), torchrun=False, threads=None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
