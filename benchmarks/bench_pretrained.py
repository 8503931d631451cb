#!/usr/bin/env python3
"""Loading a Hugging Face checkpoint into tensor-parallel shards: peak resident memory and wall time per rank
(CPU, gloo, float32). A Llama of over 2 GiB is saved once with ``save_pretrained``; each repeat loads it in
fresh torchrun processes per implementation, rotating:

- **torch_tp**: the model on the meta device, ``torch_tp.parallelize_module(model, mesh, model.tp_plan)``,
  ``torch_tp.parallel.load_pretrained(model, dir)``: each rank reads only its slices, and keeps the one-range ones
  as views of the file's memory map, read at first use;
- **torch_tp mmap=False**: the same, every slice copied into memory;
- **whole**: ``from_pretrained(dir)`` on every rank, then ``torch_tp.parallelize_module``;
- **hf tp_plan**: transformers' own ``from_pretrained(dir, tp_plan="auto")`` (its DTensor TP)."""

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import harness
import torch_tp

IMPLS = ["torch_tp", "torch_tp mmap=False", "whole", "hf tp_plan"]
CONFIG = dict(hidden_size=2048, num_hidden_layers=10, intermediate_size=5632, vocab_size=32000,
              num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=False)
GiB = 1024 ** 3


def load(impl: str, path: str):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM
    if impl == "hf tp_plan":
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if impl == "whole":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return torch_tp.parallelize_module(model, mesh, model.tp_plan)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    torch_tp.parallelize_module(model, mesh, model.tp_plan)
    result = torch_tp.parallel.load_pretrained(model, path, mmap=impl == "torch_tp")
    assert not result.missing_keys and not result.unexpected_keys, result
    return model


def worker(impl: str, path: str, out: str) -> None:
    """One rank of one load; writes to ``out``.<rank> its times from a barrier to the model loaded and to its first
    logits (one token: torch_tp and HF's tp_plan leave parameters views of the file's memory map, read at first
    use), its peak RSS, its RSS before loading and issue 52's bound (shard + replicated tensors + the largest one,
    + 10%)."""
    dist.init_process_group("gloo")
    with open("/proc/self/statm") as f:
        base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")  # resident now
    dist.barrier()
    start, error = time.perf_counter(), ""
    try:
        model = load(impl, path)
        seconds = time.perf_counter() - start
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 1, dtype=torch.long))
        first = time.perf_counter() - start
        tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
        local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        bound = 1.1 * (sum(t.numel() * t.element_size() for t in local)
                       + max(t.numel() * t.element_size() for t in tensors))
    except Exception as e:  # every rank says why, the driver records it
        seconds = first = bound = float("nan")
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    with open(f"{out}.{dist.get_rank()}", "w") as f:
        json.dump({"s": seconds, "first": first, "base": base, "bound": bound, "error": error,
                   "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}, f)
    dist.destroy_process_group()


def measure(args):
    from transformers import LlamaConfig, LlamaForCausalLM
    tmp = tempfile.mkdtemp(prefix="bench_pretrained_")
    try:
        torch.manual_seed(0)
        path, out = os.path.join(tmp, "llama"), os.path.join(tmp, "rank")  # the checkpoint, the workers' figures
        LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(path)
        ckpt_gib = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) / GiB
        ratios = [("torch_tp mmap=False", "torch_tp"), ("whole", "torch_tp"), ("hf tp_plan", "torch_tp")]
        table = harness.Table("s", IMPLS, ratios=ratios, title="Time to a loaded model")
        to_logits = harness.Table("s", IMPLS, ratios=ratios, title="Time to the first logits (load, then one token)")
        notes = []
        for tp in args.tps:
            runs = {impl: [] for impl in IMPLS}
            for r in range(args.repeats):
                for impl in harness.rotations(IMPLS)(r):  # one load: fresh processes, one per rank
                    subprocess.run(["torchrun", "--nproc-per-node", str(tp), "--master-port", "29633", sys.argv[0],
                                    "--worker", impl, "--dir", path, "--result", out], check=True,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
                    runs[impl].append([json.load(open(f"{out}.{k}")) for k in range(tp)])
            errors = {i: runs[i][0][0]["error"] for i in IMPLS if runs[i][0][0]["error"]}
            notes += [f"TP {tp}, {i}: failed on CPU: `{e}`" for i, e in errors.items()]
            ok = [i for i in IMPLS if i not in errors]
            samples, first = (harness.Samples({i: torch.tensor([[x[k][key] for x in runs[i]] for k in range(tp)])
                                               for i in ok}, 1) for key in ("s", "first"))
            extra = {"checkpoint GiB": ckpt_gib}
            for i in ok:
                last = runs[i][-1]
                extra[f"{i}: peak RSS GiB"] = max(x["peak"] for x in last) / GiB
                extra[f"{i}: peak - before GiB"] = max(x["peak"] - x["base"] for x in last) / GiB
            extra["bound GiB"] = max(x["bound"] for x in runs[ok[0]][-1]) / GiB if ok else float("nan")
            table.add({"tp": tp}, samples, extra=extra)
            to_logits.add({"tp": tp}, first)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "tag": "bench_pretrained", "stem": "pretrained",
        "title": "Loading a Hugging Face checkpoint into TP shards: torch_tp vs whole-model vs transformers' tp_plan",
        "about": f"CPU, gloo, float32, one intra-op thread per rank; a {ckpt_gib:.2f} GiB Llama ({CONFIG}) saved with "
        "`save_pretrained` to local disk. Time: each rank's wall time to a loaded model and to its first logits "
        "(torch_tp and HF's tp_plan leave parameters views of the file's memory map, read at first use; torch_tp "
        "mmap=False copies them), fresh processes per "
        f"load, medians over {args.repeats} repeats of the slowest rank, implementations rotating. Memory: the "
        "largest rank's peak RSS (ru_maxrss) and that peak less its RSS before loading, in the last repeat; "
        "bound: the largest rank's shard + replicated tensors + the largest single tensor, + 10% (issue 52).",
        "tables": [table, to_logits], "notes": notes}


if __name__ == "__main__":
    p = harness.parser(__doc__, launch="python3", quick="smoke run: TP 2, one repeat")
    p.add_argument("--tps", type=lambda text: [int(v) for v in text.split(",")], default="2,4")
    p.add_argument("--repeats", type=int, default=3, help="loads per implementation and degree (default: 3)")
    p.add_argument("--dir", help="internal: the worker's save_pretrained directory")
    p.add_argument("--worker", help="internal: run one rank of one load of this implementation")
    p.add_argument("--result", help="internal: where the worker writes its figures")
    args = p.parse_args()
    if args.worker:
        sys.exit(worker(args.worker, args.dir, args.result))
    if args.quick:
        args.tps, args.repeats = [2], 1
    sys.exit(harness.run(args, measure, torchrun=False))
