#!/usr/bin/env python3
"""torch_tp's own CPU kernels against torch's ops at one intra-op thread and at several, in one process (world
size 1: no communication). The kernels split their rows over the threads with at::parallel_for, which does so
only in code built with OpenMP (docs/architecture.md, "Build").
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import harness
import torch_tp

CASES = ["gemv bfloat16", "gemv float32", "rms_norm", "cross_entropy"]


def case_steps(name: str, group: str, gen: torch.Generator):
    """``{"torch_tp": step, "torch": step}`` for one case."""
    if name.startswith("gemv"):
        dtype = getattr(torch, name.split()[1])
        w = torch.randn(4096, 4096, generator=gen).to(dtype)
        x = torch.randn(1, 4096, generator=gen).to(dtype)

        def tp():
            with torch.no_grad():
                torch.ops.torch_tp.column_parallel_linear(x, w, None, group)

        def aten():
            with torch.no_grad():
                F.linear(x, w)
        return {"torch_tp": tp, "torch": aten}
    if name == "rms_norm":
        x = torch.randn(1024, 4096, generator=gen).requires_grad_()
        w = torch.rand(4096, generator=gen).add_(0.5).requires_grad_()
        grad = torch.randn(1024, 4096, generator=gen)

        def step(norm):
            def run():
                x.grad = w.grad = None
                norm(x, [4096], w, 1e-5).backward(grad)
            return run
        return {"torch_tp": step(torch_tp.ops.rms_norm), "torch": step(F.rms_norm)}
    logits = torch.randn(512, 32000, generator=gen).requires_grad_()
    target = torch.randint(0, 32000, (512,), generator=gen)

    def tp():
        logits.grad = None
        torch.ops.torch_tp.vocab_parallel_cross_entropy(logits, target, group, 32000).backward()

    def aten():
        logits.grad = None
        F.cross_entropy(logits, target).backward()
    return {"torch_tp": tp, "torch": aten}


def measure(args):
    gen = torch.Generator().manual_seed(0)
    repeats = 5 if args.quick else 30
    table = harness.Table("ms", ["torch_tp", "torch"], ratios=[("torch", "torch_tp")])
    for name in CASES:
        steps = case_steps(name, dist.group.WORLD.group_name, gen)
        one_thread = None
        for threads in (1, args.threads):
            torch.set_num_threads(threads)
            try:
                samples = harness.time_interleaved(steps, repeats, warmup=2, calls=3)
            finally:
                torch.set_num_threads(1)
            tp = samples.median("torch_tp", "ms")
            one_thread = one_thread or tp
            table.add({"case": name, "threads": threads}, samples,
                      extra={"torch_tp 1 thread / torch_tp": one_thread / tp})
    return {
        "tag": "bench_threads", "stem": "threads",
        "title": "torch_tp's CPU kernels at 1 and several intra-op threads, against torch's ops",
        "about": f"CPU, one process (world size 1, no communication), torch.set_num_threads(1) and "
        f"({args.threads}). Each sample: 3 calls back to back, the two sides interleaved. gemv: one row by a "
        "[4096, 4096] weight, no grad (torch_tp's column_parallel_linear against F.linear); rms_norm: [1024, 4096] "
        "float32, forward and backward; cross_entropy: [512, 32000] float32 logits, forward and backward "
        "(vocab_parallel_cross_entropy on one rank against F.cross_entropy).",
        "tables": [table],
    }


if __name__ == "__main__":
    p = harness.parser(__doc__, launch="python", quick="smoke run: 5 repeats per case")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="the intra-op threads of the second run (default: the CPUs this process may use, "
                   "%(default)s)")
    args = p.parse_args()
    if args.threads < 2:
        p.error(f"--threads={args.threads}: needs at least 2 to compare with 1")
    sys.exit(harness.run(args, measure, torchrun=False))
