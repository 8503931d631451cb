"""What every benchmark here shares: interleaved timing, cross-rank medians and the JSON a run writes.

As torch.utils.benchmark's and nccl-tests': the implementations compared run side by side in one job, one timed
sample (a call or a batch of calls) of each per repeat, in an order that changes between repeats, so drift hits
them alike; before each an untimed reset, then a barrier; a repeat's time is the slowest rank's; GC off. Reported:
medians over repeats with p10/p90, ratios of medians, medians of per-repeat differences (:class:`Table`)."""

import argparse
import copy
import datetime
import gc
import itertools
import json
import os
import platform
import random
import shlex
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

import report
import torch_tp  # registers the "torch_tp" backend and torch.ops.torch_tp.* for every script

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))  # llama_model
# DeepSpeed (a peer, never a dependency) sets up its shared-memory all-reduce only when these are set before it is
# imported; torchrun sets neither.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
UNITS = {"s": 1.0, "ms": 1e3, "us": 1e6}


def materialize(t):
    """Wait for an eager functional collective's result, also inside a DTensor (handed back before it finishes)."""
    inner = t._local_tensor if isinstance(t, DTensor) else t
    if isinstance(inner, funcol.AsyncCollectiveTensor):
        inner.wait()
    return t


def wall_time(fn: Callable[[], Any], calls: int):
    """``(seconds per call, laps)`` of ``calls`` back-to-back calls; a step returning a dict of ``perf_counter()``
    stamps gets the last call's back as seconds since that call's start."""
    t0 = last = time.perf_counter()
    for _ in range(calls):
        last = time.perf_counter()
        out = fn()
    return (time.perf_counter() - t0) / calls, {k: v - last for k, v in out.items()} if isinstance(out, dict) else {}


def rotations(keys: Sequence[str]) -> Callable[[int], List[str]]:
    """Repeat r runs ``keys`` rotated by r."""
    return lambda r, keys=list(keys): keys[r % len(keys):] + keys[: r % len(keys)]


def permutations(keys: Sequence[str]) -> Callable[[int], List[str]]:
    """Repeat r runs the r-th of all orders of ``keys`` in a fixed shuffled sequence: each key in each position
    and after each other key equally often, spread over few repeats."""
    orders = [list(o) for o in itertools.permutations(keys)]
    random.Random(0).shuffle(orders)
    return lambda r: orders[r % len(orders)]


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default)."""
    return torch.tensor(values, dtype=torch.float64).quantile(q).item()


class Samples:
    """What :func:`time_interleaved` measured: ``per_rank[key]`` is ``[ranks, repeats]`` in seconds; per repeat,
    the slowest rank's time counts."""

    def __init__(self, per_rank: Dict[str, torch.Tensor], calls: int) -> None:
        self.per_rank, self.calls = per_rank, calls

    def max(self, key: str) -> List[float]:
        return self.per_rank[key].max(dim=0).values.tolist()

    def stats(self, key: str, unit: str, times: Optional[List[float]] = None) -> Dict[str, Any]:
        v = [t * UNITS[unit] for t in (self.max(key) if times is None else times)]
        return {"median": quantile(v, 0.5), "p10": quantile(v, 0.1), "p90": quantile(v, 0.9), "times": v}

    def median(self, key: str, unit: str) -> float:
        return quantile(self.max(key), 0.5) * UNITS[unit]

    def paired(self, a: str, b: str, unit: str) -> Dict[str, Any]:
        """Over repeats, ``a - b``: both ran in every repeat, so the difference cancels drift."""
        return self.stats("", unit, [x - y for x, y in zip(self.max(a), self.max(b))])


def time_interleaved(steps: Dict[str, Callable[[], Any]], repeats: int, *, order=None, reset=None, calls: int = 1,
                     warmup: int = 0, barrier="step", timer=wall_time, gc_off: bool = True) -> Samples:
    """Time ``steps`` side by side: ``warmup`` untimed rounds, then ``repeats`` rounds of ``order(r)`` (default:
    :func:`rotations`) after ``reset[key]()``, on every rank; ``barrier``: a world barrier ``"step"`` before every
    sample or ``"round"`` before each round, or ``barrier(key)`` before every sample; ``timer``: as
    :func:`wall_time`. A step returning laps adds the samples ``"<key>/<lap>"``."""
    order, reset, local, gc_was_enabled = order or rotations(list(steps)), reset or {}, {}, gc.isenabled()
    if gc_off:
        gc.collect()
        gc.disable()
    try:
        for r in range(-warmup, repeats):
            if barrier == "round":
                dist.barrier()
            for key in order(r):
                if key in reset:
                    reset[key]()
                if barrier == "step":
                    dist.barrier()
                elif callable(barrier):
                    barrier(key)
                seconds, laps = timer(steps[key], calls)
                if r >= 0:
                    local.setdefault(key, []).append(seconds)
                    for lap, t in laps.items():
                        local.setdefault(f"{key}/{lap}", []).append(t)
    finally:
        if gc_off and gc_was_enabled:
            gc.enable()
    mine = torch.tensor(list(local.values()), dtype=torch.float64).reshape(len(local), repeats)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    per_rank = torch.stack(gathered)  # [rank, key, repeat]
    return Samples({k: per_rank[:, i] for i, k in enumerate(local)}, calls)


def complete_grads(params) -> None:
    """Finish a step's gradients: redistribute the Partial(sum) ones DTensor TP leaves on the SequenceParallel norm
    weights for an optimizer (torch_tp completes them in backward), then wait for collectives in flight."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g = g.redistribute(p.device_mesh, p.placements)
        materialize(g)


def profile_split(step: Callable[[], Any], calls: int, mm_events: Sequence[str]) -> Dict[str, float]:
    """Rank 0's torch.profiler view of ``calls`` untimed calls of ``step`` (every rank runs them), per call in ms:
    ``mm``, the self time of ``mm_events``; ``collectives``, that of the ``c10d::*`` and ``torch_tp_backend::*``
    events but barriers (waiting for the peer included); ``per <op>``, each collective op's time per call of it."""
    sys.stderr.flush()
    saved = os.dup(2)  # Kineto's lines on fd 2 hidden
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                step()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    mm, collectives, per = 0.0, 0.0, {}
    for e in prof.key_averages():
        kind, _, op = e.key.partition("::")
        if e.key in mm_events:
            mm += e.self_cpu_time_total
        elif kind in ("c10d", "torch_tp_backend") and "barrier" not in op:
            collectives += e.self_cpu_time_total
            per[f"per {op}"] = e.self_cpu_time_total / e.count / 1e3
    out = [{"mm": mm / calls / 1e3, "collectives": collectives / calls / 1e3, **per}]
    dist.broadcast_object_list(out, src=0)
    return out[0]


def split_columns(parts: Dict[str, float], step_ms: float, mm: str) -> Dict[str, float]:
    """:func:`profile_split`'s figures and the rest of torch_tp's step as extra columns (:func:`split_about`)."""
    return {f"torch_tp: {mm} ms": parts["mm"], "torch_tp: collectives ms": parts["collectives"],
            "torch_tp: rest ms": step_ms - parts["mm"] - parts["collectives"]}


def split_about(mm: str, events: str, calls: int) -> str:
    return (f"`torch_tp: {mm}/collectives/rest`: rank 0's torch.profiler self times per step over {calls} untimed "
            f"steps ({mm}: {events}; collectives include waiting for the peer; rest = the step's median minus both).")


def steady(steps: Dict[str, Callable[[], Any]], calls: int) -> Dict[str, Callable[[], None]]:
    """Resets that run each step ``calls`` times untimed, so a sample is a loop's steady state."""
    return {k: (lambda step=step: [step() for _ in range(calls)]) for k, step in steps.items()}


def parallelized(reference: torch.nn.Module, mesh, impl: str, plan: Optional[Callable] = None):
    """``(model, api)``: a deep copy of ``reference`` under examples/llama_model.py's ``tp_plan(api)`` (or
    ``plan(api)``), applied by torch's DTensor TP for ``impl`` "dtensor", else by torch_tp."""
    import llama_model as lm
    api, model = lm.load_tp_api("torch" if impl == "dtensor" else "torch_tp"), copy.deepcopy(reference)
    api.parallelize_module(model, mesh, (plan or lm.tp_plan)(api))
    return model, api


class Table:
    """Rows of one comparison for :mod:`report`: a row is a case's labels, each implementation's stats, the
    paired differences and ``extra`` figures; ratios are taken at report time."""

    def __init__(self, unit: str, impls: Sequence[str], ratios=(), paired=(), title: str = "") -> None:
        self.unit, self.impls, self.title = unit, list(impls), title
        self.ratios, self.paired = [list(r) for r in ratios], [list(p) for p in paired]
        self.rows: List[Dict[str, Any]] = []

    def add(self, case: Dict[str, Any], samples: Samples, keys: Optional[Dict[str, str]] = None,
            extra: Optional[Dict[str, Any]] = None, x: Optional[float] = None, panel: str = "") -> Dict[str, Any]:
        """``keys[impl]``: the sample key of ``impl`` (default: itself); ``x``, ``panel``: the plot's lines over a
        numeric x, a panel per ``panel`` (no x: bars)."""
        key, have = (lambda impl: (keys or {}).get(impl, impl)), samples.per_rank
        self.rows.append({
            "case": case, "x": x, "panel": panel, "calls_per_sample": samples.calls,
            "stats": {i: samples.stats(key(i), self.unit) for i in self.impls if key(i) in have},
            "paired": {f"{a} - {b}": samples.paired(key(a), key(b), self.unit) for a, b in self.paired
                       if key(a) in have and key(b) in have},
            "extra": extra or {}})
        return self.rows[-1]


def noop_group() -> dist.ProcessGroup:
    """A group on torch's "fake" backend beside the world group; every rank must call this."""
    why = ""
    try:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the backend)
        group = dist.new_group(backend="fake")
    except Exception as e:  # a torch without it: every rank says why below
        why = f"{type(e).__name__}: {e}"
    ok = torch.tensor([0 if why else 1], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        raise RuntimeError(f"--noop-group: torch cannot make a 'fake' group here ({why or 'on another rank'})")
    return group


def deepspeed_peer():
    """``(deepspeed, "DeepSpeed <version>")`` with its communication on the world group and its shared-memory
    all-reduce built, or ``(None, why not)``, the same on every rank."""
    try:
        import deepspeed

        if os.environ["LOCAL_SIZE"] != str(dist.get_world_size()):
            raise RuntimeError(f"LOCAL_SIZE={os.environ['LOCAL_SIZE']} is not the world size: no shared memory")
        deepspeed.init_distributed(dist_backend="gloo")
        backend = deepspeed.comm.comm.cdb
        if getattr(backend, "shm_comm_op", None) is None:
            raise RuntimeError("DeepSpeed's deepspeed_shm_comm op did not build")
        if getattr(backend, "shm_vector_kernel_level", 0) < 2:
            raise RuntimeError("the CPU lacks avx512bw, which DeepSpeed's bf16 shm kernel needs")
        peer = (deepspeed, f"DeepSpeed {deepspeed.__version__}")
    except Exception as e:  # not installed, or unusable here
        peer = (None, f"DeepSpeed skipped ({type(e).__name__}: {e})")
    ok = torch.tensor([0 if peer[0] is None else 1], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return peer if ok.item() else (None, peer[1] if peer[0] is None else "DeepSpeed skipped (unusable on another rank)")


def parser(doc: str, *, launch: str = "torchrun --nproc-per-node 2", quick: str = "", noop_batch: int = 0,
           backend: str = "", configs: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The options scripts share, each left out where its argument is empty: ``quick``, --quick's help; ``noop_batch``,
    --noop-group's default --batch; ``backend``, --backend's default; ``configs``, what --configs chooses from."""
    p = argparse.ArgumentParser(prog=f"{launch} {os.path.relpath(sys.argv[0])}", description=doc,
                                epilog="Method and outputs: benchmarks/harness.py, benchmarks/report.py.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default=os.path.dirname(os.path.abspath(__file__)),
                   help="where the json, the png and RESULTS.md go (default: benchmarks/)")
    p.add_argument("--no-results-md", action="store_true", help="write the json and png, not RESULTS.md")
    if quick:
        p.add_argument("--quick", action="store_true", help=quick)
    if noop_batch:
        p.add_argument("--noop-group", action="store_true", help="bind the steps to a no-op group (torch's fake "
                       "backend), which leaves each layer's own per-call cost; its own section")
        p.add_argument("--batch", type=int, default=noop_batch,
                       help="with --noop-group: calls per timed sample (default: %(default)s)")
    if backend:
        p.add_argument("--backend", choices=["gloo", "torch_tp"], default=backend,
                       help="the process group's backend, of every implementation (default: %(default)s)")
    if configs:
        p.add_argument("--configs", type=names(configs), default=",".join(configs),
                       help="comma-separated subset of %(default)s")
    return p


def names(allowed: Sequence[str]) -> Callable[[str], List[str]]:
    """An argparse type: a comma-separated list, each one of ``allowed`` (argparse converts a default too)."""
    def parse(text: str) -> List[str]:
        if set(text.split(",")) - set(allowed):
            raise argparse.ArgumentTypeError(f"choose from {','.join(allowed)}")
        return text.split(",")
    return parse


def run(args: argparse.Namespace, measure: Callable[[argparse.Namespace], Dict[str, Any]], *,
        threads: Optional[int] = 1, torchrun: bool = True) -> int:
    """Set up the process group (``args.backend``, else gloo; ``torchrun=False``: one process, world size 1),
    ``measure(args)``, and on rank 0 write ``<stem>.json`` and :mod:`report`'s outputs. ``measure`` returns ``tag``
    (the RESULTS.md markers), ``stem``, ``title``, ``about``, ``tables`` (:class:`Table`) and optionally ``notes``.
    ``threads``: intra-op threads per rank."""
    name, backend = os.path.splitext(os.path.basename(sys.argv[0]))[0], getattr(args, "backend", "gloo")
    if torchrun and "RANK" not in os.environ:
        print(f"{name}: launch with torchrun, e.g. torchrun --nproc-per-node 2 benchmarks/{name}.py", file=sys.stderr)
        return 2
    if threads is not None:
        torch.set_num_threads(threads)
    dist.init_process_group(backend, **({} if torchrun else dict(store=dist.HashStore(), rank=0, world_size=1)))
    start = time.perf_counter()
    try:
        out = measure(args)
        if getattr(args, "noop_group", False):  # a section and files of their own
            out.update(tag=out["tag"] + " noop", stem=out["stem"] + "_noop", title=out["title"] + ", no-op group",
                       about=out["about"] + f" No-op group (torch's fake backend): samples of {args.batch} "
                       "back-to-back steps, one world barrier per round; values are not the collectives'.")
        if dist.get_rank() == 0:
            nproc = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
            launcher, cpu = ["torchrun", "--nproc-per-node", nproc] if torchrun else ["python"], platform.processor()
            with open("/proc/cpuinfo") as f:
                cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu or "unknown")
            machine = {
                "cpu_model": cpu, "cpus_usable": len(os.sched_getaffinity(0)), "torch_version": torch.__version__,
                "torch_tp_version": torch_tp.__version__, "python_version": platform.python_version(),
                "backend": dist.get_backend(), "world_size": dist.get_world_size(),
                "threads_per_rank": torch.get_num_threads(),  # glibc malloc tunables change what allocations cost
                "malloc_env": {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}}
            data = {
                "benchmark": name, "command": shlex.join(launcher + [os.path.relpath(sys.argv[0])] + sys.argv[1:]),
                "args": vars(args), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "machine": machine, "elapsed_s": time.perf_counter() - start,
                **out, "tables": [vars(t) for t in out["tables"]]}
            os.makedirs(args.out_dir, exist_ok=True)
            path = os.path.join(args.out_dir, f"{out['stem']}.json")
            with open(path, "w") as f:
                json.dump(data, f, indent=1)
            report.write(path, results_md=None if args.no_results_md else os.path.join(args.out_dir, "RESULTS.md"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0
