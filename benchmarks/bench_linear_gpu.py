#!/usr/bin/env python3
"""The linear ops on one device against nn.Linear, and the fused bias+GELU epilogue against the unfused ops.

    python benchmarks/bench_linear_gpu.py [--device cuda] [--size 4096] [--tokens 8192] [--dtype bfloat16]

One process, a process group of world size 1, so the ops do no communication: what is measured is their own
GEMM path against torch's. Method and outputs: benchmarks/harness.py, benchmarks/report.py.
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import harness
import torch_tp  # noqa: F401  (registers torch.ops.torch_tp.*)


def measure(args):
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
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
            x.grad = w.grad = b.grad = None
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
    table = harness.Table("us", ["torch_tp", "reference"], ratios=[("torch_tp", "reference")])
    for label, ours, theirs, mode in [("column fwd+bwd", "column_parallel_linear", "nn.Linear", fwd_bwd),
                                      ("row fwd+bwd", "row_parallel_linear", "nn.Linear", fwd_bwd),
                                      ("bias+GELU fwd", "fused epilogue", "unfused linear+gelu", fwd),
                                      ("bias+GELU fwd+bwd", "fused epilogue", "unfused linear+gelu", fwd_bwd)]:
        samples = harness.time_interleaved(
            {"torch_tp": mode(variants[ours]), "reference": mode(variants[theirs])}, args.repeats, dist.group.WORLD,
            warmup=args.warmup, barrier=lambda name: None,
            timer=harness.cuda_time if device.type == "cuda" else harness.wall_time)
        table.add({"comparison": label, "torch_tp": ours, "reference": theirs}, samples)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return {
        "tag": "bench_linear_gpu", "stem": "linear_gpu",
        "title": "Linear ops on one device: torch_tp's GEMM path against nn.Linear, and the fused epilogue",
        "about": f"Device: {name}, {args.dtype}, x [{m}, {n}] @ W [{n}, {n}]^T + b; world size 1 (no "
        "communication). Each call timed with CUDA events (perf_counter on the CPU), no barrier.",
        "tables": [table],
    }


def main(argv) -> int:
    p = harness.parser(__doc__)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run)")
    p.add_argument("--size", type=int, default=4096, help="in and out features of the layer (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=8192, help="rows of x (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--repeats", type=int, default=50, help="timed repeats (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=10, help="untimed rounds first (default: %(default)s)")
    args = p.parse_args(argv)
    return harness.run("bench_linear_gpu", args, lambda: measure(args), torchrun=False, threads=None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
