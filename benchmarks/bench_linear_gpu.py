#!/usr/bin/env python3
"""The linear ops on one GPU against nn.Linear, and the fused bias+GELU epilogue against the unfused ops, in one
process (world size 1: no communication), beside the device's ceilings and the FLOP rate of each side."""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import harness

N, M, REPEATS, WARMUP = 4096, 8192, 50, 10  # in and out features, rows of x, timed and untimed rounds


def cuda_time(fn, calls: int):
    """:func:`harness.wall_time` with CUDA events on the current stream (no laps)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls, {}


def limits(device, dtype, gen, repeats=20):
    """The ceilings a linear layer is judged against, medians of ``repeats`` single calls after a warm-up: an 8192^3
    matmul in ``dtype`` (TFLOP/s), a 1 GiB device-to-device copy (GB/s, read + written); random data (zeros: faster)."""
    a, b = (torch.randn(8192, 8192, device=device, dtype=dtype, generator=gen) for _ in range(2))
    src, dst = torch.randn(2**28, device=device, generator=gen), torch.empty(2**28, device=device)  # 1 GiB each

    def median_s(fn):
        fn()
        return harness.quantile([cuda_time(fn, 1)[0] for _ in range(repeats)], 0.5)

    tflops = 2 * 8192**3 / median_s(lambda: torch.mm(a, b)) / 1e12
    return tflops, 2 * src.numel() * src.element_size() / median_s(lambda: dst.copy_(src)) / 1e9


def measure(args):
    device, dtype = torch.device("cuda", torch.cuda.current_device()), getattr(torch, args.dtype)
    torch.cuda.set_device(device)  # torch 2.11's set_device wants an index
    group, gen = dist.group.WORLD.group_name, torch.Generator(device=device).manual_seed(0)
    x = torch.randn(M, N, device=device, dtype=dtype, generator=gen).requires_grad_()
    w = (torch.randn(N, N, device=device, dtype=dtype, generator=gen) / N**0.5).requires_grad_()
    b = torch.randn(N, device=device, dtype=dtype, generator=gen).requires_grad_()
    grad = torch.randn(M, N, device=device, dtype=dtype, generator=gen)

    def fwd_bwd(forward):
        def step():
            x.grad = w.grad = b.grad = None
            forward().backward(grad)
        return step

    fwd = torch.no_grad()  # fwd(forward): forward without autograd, as a decorator
    variants = {
        "nn.Linear": lambda: F.linear(x, w, b),
        "column_parallel_linear": lambda: torch.ops.torch_tp.column_parallel_linear(x, w, b, group),
        "row_parallel_linear": lambda: torch.ops.torch_tp.row_parallel_linear(x, w, b, group),
        "unfused linear+gelu": lambda: F.gelu(F.linear(x, w, b), approximate="tanh"),
        "fused epilogue": lambda: torch.ops.torch_tp.column_parallel_linear(x, w, b, group, activation="gelu_tanh")}
    table = harness.Table("us", ["torch_tp", "reference"], ratios=[("torch_tp", "reference")])
    for label, ours, theirs, mode in [("column fwd+bwd", "column_parallel_linear", "nn.Linear", fwd_bwd),
                                      ("row fwd+bwd", "row_parallel_linear", "nn.Linear", fwd_bwd),
                                      ("bias+GELU fwd", "fused epilogue", "unfused linear+gelu", fwd),
                                      ("bias+GELU fwd+bwd", "fused epilogue", "unfused linear+gelu", fwd_bwd)]:
        samples = harness.time_interleaved({"torch_tp": mode(variants[ours]), "reference": mode(variants[theirs])},
                                           REPEATS, warmup=WARMUP, barrier=lambda name: None, timer=cuda_time)
        # x @ W^T is 2mn^2 FLOP; the backward adds dx and dW, 4mn^2 more (the bias and GELU are noise).
        flop = (6 if mode is fwd_bwd else 2) * M * N * N
        extra = {f"{impl} TFLOP/s": flop / samples.median(impl, "s") / 1e12 for impl in ("torch_tp", "reference")}
        table.add({"comparison": label, "torch_tp": ours, "reference": theirs}, samples, extra=extra)
    tflops, copy_gbs = limits(device, dtype, gen)
    extra_bytes = 2 * M * N * dtype.itemsize
    return {
        # bfloat16, the default, keeps the plain names; another dtype gets a section and files of its own.
        "tag": "bench_linear_gpu" + ("" if args.dtype == "bfloat16" else f" {args.dtype}"),
        "stem": "linear_gpu" + ("" if args.dtype == "bfloat16" else f"_{args.dtype}"),
        "title": "Linear ops on one device: torch_tp's GEMM path against nn.Linear, and the fused epilogue",
        "about": f"Device: {torch.cuda.get_device_name(device)}, {args.dtype}, x [{M}, {N}] @ W [{N}, {N}]^T + b; "
        "world size 1 (no communication). Each call timed with CUDA events, no barrier.",
        "tables": [table],
        "notes": [f"Ceilings on this device: an 8192^3 {args.dtype} matmul ran at {tflops:.0f} TFLOP/s; a 1 GiB "
                  f"device-to-device copy moved {copy_gbs:.0f} GB/s (read plus written). The unfused GELU reads "
                  f"and writes the [{M}, {N}] output once more than the fused epilogue: {extra_bytes / 2**20:.0f} "
                  f"MiB, {extra_bytes / copy_gbs / 1e3:.0f} us at that copy rate."]}


if __name__ == "__main__":
    p = harness.parser(__doc__, launch="python")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    sys.exit(harness.run(p.parse_args(), measure, torchrun=False, threads=None))
