#!/usr/bin/env python3
"""Training steps of the example Llama (examples/llama_model.py) under its sequence-parallel TP plan, against
perfect scaling: torch_tp and DTensor TP over the ranks, beside the unsharded model on rank 0 alone with one
intra-op thread and with one per core (what a CPU user tries first) (CPU, eager).

A sample is a training loop's steady state (untimed steps of the same implementation first): right after another
implementation's step, a step starts with the other models' data in the caches and the other ranks' CPUs idle, which
no training loop sees. --amp's unsharded float32 step is the fair baseline on a CPU without a native bfloat16 GEMM
(torch's falls back to scalar code, torch_tp's does not: NOTE [half-precision GEMMs through float32 panels]). Minor
page faults per step are counted: glibc's malloc hands freed memory back to the kernel and the next step faults it in
again, page by page; --keep-freed-memory stops that, as a caching allocator would."""

import contextlib
import copy
import ctypes
import resource
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import harness
import llama_model as lm  # examples/llama_model.py, on sys.path through harness

# name: (LlamaConfig overrides, batch, seq, samples)
CONFIGS = {
    "example": ({"dim": 256, "n_layers": 4, "n_heads": 4}, 4, 64, 20),
    # weights, gradients, Adam state and activations several times the L3 of the machine in RESULTS.md
    "dim1024": ({"dim": 1024, "n_layers": 2, "n_heads": 8}, 8, 512, 5)}
WARM_STEPS, STEADY_STEPS = 1, 3  # a sample: untimed, then timed steps of one implementation
VOCAB = 256  # the example's byte vocabulary
IMPLS = ["unsharded", "unsharded 2 threads", "torch_tp", "dtensor"]
COMPILED_IMPLS = ["unsharded", "unsharded 2 threads", "torch_tp"]  # torch 2.14's TP fails compiled (RESULTS.md)
AMP_IMPLS = IMPLS + ["unsharded float32"]  # --amp: the unsharded step without autocast beside them


class Case:
    """One configuration: the unsharded model on rank 0 and its copies parallelized by each implementation;
    ``steps[impl]()`` is one training step."""

    def __init__(self, name: str, mesh, impls, compile_blocks: bool, amp: bool) -> None:
        overrides, batch, seq, _ = CONFIGS[name]
        c = self.config = lm.LlamaConfig(vocab_size=VOCAB, max_seq_len=seq, **overrides)
        torch.manual_seed(1234)
        reference = lm.Llama(c)
        tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=torch.Generator().manual_seed(4321))
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        self.steps: Dict[str, Callable[[], Dict[str, float]]] = {}
        self.faults: Dict[str, List[int]] = {impl: [] for impl in impls}  # per step taken, this rank's
        for impl in impls:
            unsharded = impl.startswith("unsharded")
            model, api = (copy.deepcopy(reference), None) if unsharded else harness.parallelized(reference, mesh, impl)
            threads, autocast = 2 if impl.endswith("2 threads") else 1, amp and not impl.endswith("float32")
            self.steps[impl] = (self._idle if unsharded and dist.get_rank() != 0
                                else self._step(model, api, inputs, targets, threads, autocast, self.faults[impl]))
            if compile_blocks:  # torchtitan's recipe, on every side alike
                for block in model.layers.values():
                    block.compile(fullgraph=True)

    @staticmethod
    def _idle() -> Dict[str, float]:  # the unsharded steps on ranks but 0: nothing, with the laps all ranks report
        return dict.fromkeys(("forward", "backward", "end"), time.perf_counter())

    @staticmethod
    def _step(model, api, inputs, targets, threads: int, autocast: bool, faults_taken: List[int]):
        optimizer = lm.make_optimizer(model, lr=1e-5)  # small: hundreds of repeats stay far from divergence
        loss_context = contextlib.nullcontext if api is None else api.loss_parallel

        def step() -> Dict[str, float]:
            """One training step; returns its laps: the loss computed, the gradients complete, the end; appends
            the minor page faults it took to ``faults_taken``."""
            torch.set_num_threads(threads)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            try:
                with loss_context():
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                        loss = lm.cross_entropy_loss(model(inputs), targets)
                    t_forward = time.perf_counter()
                    loss.backward()
                if api is not None:
                    harness.complete_grads(model.parameters())
                t_backward = time.perf_counter()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                end = time.perf_counter()
                faults_taken.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
                return {"forward": t_forward, "backward": t_backward, "end": end}
            finally:
                torch.set_num_threads(1)
        return step


def measure(args):
    p = dist.get_world_size()
    mesh = init_device_mesh("cpu", (p,), mesh_dim_names=("tp",))
    if args.keep_freed_memory:  # glibc's malloc keeps freed memory for reuse: no trimming of the heap's top
        # (M_TRIM_THRESHOLD -1), blocks up to 32 MiB (the largest mmap threshold glibc takes on 64-bit) from the heap
        libc, m_trim_threshold, m_mmap_threshold = ctypes.CDLL(None), -1, -3
        if not (libc.mallopt(m_trim_threshold, -1) and libc.mallopt(m_mmap_threshold, 32 << 20)):
            raise RuntimeError("bench_train: --keep-freed-memory: glibc's mallopt refused the thresholds")
    impls = COMPILED_IMPLS if args.compile else AMP_IMPLS if args.amp else IMPLS
    ratios = [(i, "torch_tp") for i in (AMP_IMPLS if args.amp else IMPLS) if i != "torch_tp"]
    table, notes = harness.Table("ms", impls, ratios=ratios), []
    for name in args.configs:
        overrides, batch, seq, repeats = CONFIGS[name]
        case = Case(name, mesh, impls, args.compile, args.amp)
        repeats = max(2, repeats // 4) if args.amp else repeats  # torch's bfloat16 steps: seconds (scalar GEMMs)
        repeats = max(2, repeats // 5) if args.quick else repeats
        warm = harness.steady(case.steps, WARM_STEPS)
        # Two phases: the 2-thread run leaves an OpenMP worker spinning on the other core for a while (GOMP's
        # spin-wait), which would slow whichever TP step ran next; so it is timed beside the 1-thread step alone.
        tp_keys = [k for k in impls if k != "unsharded 2 threads"]
        samples = harness.time_interleaved({k: case.steps[k] for k in tp_keys}, repeats, reset=warm, warmup=1,
                                           order=harness.permutations(tp_keys), calls=STEADY_STEPS)
        threads = harness.time_interleaved({k: case.steps[k] for k in ("unsharded", "unsharded 2 threads")},
                                           repeats, reset=warm, warmup=1, calls=STEADY_STEPS)
        samples.per_rank["unsharded 2 threads"] = threads.per_rank["unsharded 2 threads"]
        parts = harness.profile_split(case.steps["torch_tp"], 3, ("aten::mm", "aten::addmm", "aten::bmm"))
        tp, unsharded = samples.median("torch_tp", "ms"), samples.median("unsharded", "ms")
        extra = {f"{i} scaling": unsharded / (p * samples.median(i, "ms")) for i in ("torch_tp", "dtensor")
                 if i in impls}
        if args.amp:
            extra["torch_tp scaling against float32"] = samples.median("unsharded float32", "ms") / (p * tp)
        extra |= harness.split_columns(parts, tp, "gemm")
        table.add({"config": name}, samples, extra=extra)
        c, two = case.config, threads.median("unsharded", "ms") / threads.median("unsharded 2 threads", "ms")
        split = {}  # forward + loss, backward, optimizer (ms): the last step's laps, the slowest rank's, median
        for impl in ("unsharded", "torch_tp"):
            forward, backward, end = (samples.per_rank[f"{impl}/{lap}"] for lap in ("forward", "backward", "end"))
            split[impl] = [harness.quantile(t.max(dim=0).values.tolist(), 0.5) * 1e3
                           for t in (forward, backward - forward, end - backward)]
        faults = {impl: harness.quantile(f, 0.5) if f else float("nan") for impl, f in case.faults.items()}
        per_phase = "; ".join(
            f"{phase} {u:.2f} unsharded, {t:.2f} torch_tp (scaling {u / (p * t):.2f})"
            for phase, u, t in zip(("forward + loss", "backward", "optimizer"), split["unsharded"], split["torch_tp"]))
        per_call = ", ".join(f"{k[4:]} {v:.3f} ms" for k, v in parts.items() if k.startswith("per "))
        notes.append(f"- {name}: {c.n_layers} layers, dim {c.dim}, {c.n_heads} heads, ffn {c.ffn_hidden_dim}, vocab "
                     f"{VOCAB}; batch {batch} x seq {seq}. Rank 0's collectives per call (profiler self time, "
                     f"waiting included): {per_call}. The 2-thread phase: 2 threads {two:.2f}x faster than 1 thread. "
                     f"Per phase (ms, medians of the slowest rank's laps): {per_phase}. Minor page faults per step "
                     f"(rank 0, median): {faults['unsharded']:.0f} unsharded, {faults['torch_tp']:.0f} torch_tp.")
        del case
    compiled = ("; every side's blocks compiled (`block.compile(fullgraph=True)`, torchtitan's recipe; DTensor TP "
                "left out: torch 2.14's own TP fails compiled in backward)") if args.compile else ""
    amp = ("; every side but **unsharded float32** runs its forward and loss under `torch.autocast(\"cpu\", "
           "dtype=torch.bfloat16)` (float32 parameters and optimizer); `torch_tp scaling against float32` = "
           f"unsharded float32 / ({p} x torch_tp)") if args.amp else ""
    keep = ("; glibc's malloc keeps freed memory for reuse (`--keep-freed-memory`: no trimming, mmap threshold 32 "
            "MiB), as a caching allocator does") if args.keep_freed_memory else ""
    mode = (" compile" if args.compile else " amp" if args.amp else "") + (" keep" if args.keep_freed_memory else "")
    return {
        "tag": "bench_train" + mode, "stem": "train" + mode.replace(" ", "_"),
        "title": "Training steps against perfect scaling: torch_tp vs DTensor TP vs unsharded"
        + (", blocks compiled" if args.compile else ", bfloat16 autocast" if args.amp else "")
        + (", freed memory kept by malloc" if args.keep_freed_memory else ""),
        "about": f"CPU, {'compiled blocks' if args.compile else 'eager'}{compiled}{amp}{keep}, {args.backend} backend, "
        f"{p} ranks. `examples/llama_model.py`'s model and `tp_plan(api)` (sequence parallel, loss_parallel) "
        "applied to copies of one model by **torch_tp** and **dtensor**; **unsharded**: the model on rank 0 alone "
        "with 1 intra-op thread, and with 2 (**unsharded 2 threads**, timed in a phase of its own beside the "
        "1-thread step). A step: forward, cross entropy (inside `loss_parallel()` for TP), backward, fused AdamW "
        "(lr 1e-5) and zero_grad; DTensor's Partial norm-weight gradients redistributed before the optimizer. "
        f"A sample: the mean of {STEADY_STEPS} steps back to back after {WARM_STEPS} untimed one(s) of the same "
        f"implementation. Scaling = unsharded / ({p} x TP step). Per phase (notes): from each sample's last step's "
        "laps at the loss and at complete gradients. " + harness.split_about("gemm", "aten::mm/addmm/bmm", 3),
        "tables": [table], "notes": ["\n".join(notes)]}


if __name__ == "__main__":
    p = harness.parser(__doc__, quick="smoke run: a fifth of the repeats", backend="torch_tp", configs=CONFIGS)
    p.add_argument("--compile", action="store_true", help="compile every model's blocks (torch_tp and the "
                   "unsharded model; not DTensor TP); writes train_compile.*")
    p.add_argument("--amp", action="store_true",
                   help="bfloat16 autocast on every side, beside the unsharded float32 step; writes train_amp.*")
    p.add_argument("--keep-freed-memory", action="store_true", help="glibc's malloc keeps freed memory for the next "
                   "step instead of returning it to the kernel (see above); writes train[_compile|_amp]_keep.*")
    args = p.parse_args()
    if args.amp and args.compile:
        p.error("--amp and --compile are separate runs")
    sys.exit(harness.run(args, measure))
