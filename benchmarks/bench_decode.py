#!/usr/bin/env python3
"""Decode steps of the example Llama (examples/llama_model.py): one new token with a KV cache, under the TP
plan without sequence parallelism, applied by torch_tp and by torch's DTensor TP, beside the unsharded model
on one rank and beside the memory-bandwidth limit (CPU, eager, one intra-op thread per rank).

A decode step streams every weight once per token, so the limit is measured as the step is, in the same run:
the step's weight GEMVs alone, through F.linear (what the unsharded model runs) and through torch_tp's
column-parallel op (what the TP linears run). A sample is a decode loop's steady state (untimed tokens of the
same implementation first); --cold times each token right after another implementation's, when a rank's
weight shard may still be in the last-level cache where the whole model's is not. --prefill times the prompt's
forward instead (GEMMs, not GEMVs). float16 (outside issue 26's goals) and --cold write sections of their own.

--hf: Hugging Face's greedy ``generate()`` of a LlamaForCausalLM built from config, with over 1 GiB of float32
linear weights (twice the last-level cache of the machine in RESULTS.md), parallelized by its own ``tp_plan``
through torch_tp, torch's DTensor TP, transformers' own TP and DeepSpeed's AutoTP; each must give the unsharded
model's tokens.
"""

import copy
import sys
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import harness
import torch_tp
import llama_model as lm  # examples/llama_model.py, on sys.path through harness

# name: LlamaConfig overrides. Heads of 128 dims, as Llama's; vocab 8192.
CONFIGS = {
    "dim1024x4": {"dim": 1024, "n_layers": 4, "n_heads": 8},
    "dim512x8": {"dim": 512, "n_layers": 8, "n_heads": 4},
}
VOCAB = 8192
PROMPT = 64  # tokens in the cache when a step decodes the next one
IMPLS = ["unsharded", "torch_tp", "dtensor", "unsharded gemv", "tp gemv", "unsharded gemv torch_tp op",
         "tp gemv torch_tp op"]
PREFILL_IMPLS = IMPLS[:3]
WARM_TOKENS, STEADY_TOKENS = 2, 4  # a decode sample: untimed, then timed tokens of one implementation
# The GEMVs' profiler events: ATen's, and torch_tp's own small-batch kernel (NOTE [few-row GEMV on the CPU]).
GEMV_EVENTS = ("aten::mm", "aten::addmm", "torch_tp::small_batch_linear_cpu")
# --hf: 16 layers x dim 1024 (16 heads, 8 KV heads), ffn 4096, vocab 32000: 1.06 GiB of linear weights in float32.
HF_CONFIG = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=16, vocab_size=32000,
                 num_attention_heads=16, num_key_value_heads=8)
HF_IMPLS = ["unsharded", "torch_tp", "dtensor", "hf tp_plan", "deepspeed"]
HF_PROMPT, HF_NEW = 32, 16  # prompt tokens, and tokens each generate() call adds


def _linears(model: nn.Module) -> List[torch.Tensor]:
    """Each nn.Linear's weight as this rank holds it (a TP shard, or whole)."""
    weights = []
    for module in model.modules():
        if isinstance(module, nn.Linear):
            w = module.weight.detach()
            weights.append(w.to_local() if isinstance(w, DTensor) else w)
    return weights


def _gemvs(weights: List[torch.Tensor], torch_tp_op: bool = False) -> Callable[[], None]:
    """The step's GEMVs alone: one token through every weight, as F.linear computes it, or (``torch_tp_op``)
    as torch_tp's column-parallel op does (its forward on a replicated input is the local GEMV alone, no
    communication), which the TP model's linears run."""
    xs = [torch.randn(1, 1, w.size(1), dtype=w.dtype) for w in weights]
    group_name = dist.group.WORLD.group_name

    def run() -> None:
        for w, x in zip(weights, xs):
            torch.nn.functional.linear(x, w)

    def run_op() -> None:
        for w, x in zip(weights, xs):
            torch.ops.torch_tp.column_parallel_linear(x, w, None, group_name)
    return run_op if torch_tp_op else run


class Case:
    """One (configuration, dtype): the unsharded model and its copies parallelized by each implementation, with
    a KV cache holding a PROMPT-token prompt; ``steps[impl]()`` decodes the next token (the cache rewound to
    PROMPT first, so every token does the same work), or with ``prefill`` runs the prompt (the cache rewound
    to 0)."""

    def __init__(self, name: str, dtype: torch.dtype, mesh, prefill: bool) -> None:
        c = self.config = lm.LlamaConfig(vocab_size=VOCAB, max_seq_len=PROMPT + 8, **CONFIGS[name])
        torch.manual_seed(1234)
        reference = lm.Llama(c).to(dtype)
        prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(4321))
        self.models = {"unsharded": reference}
        for impl in ("torch_tp", "dtensor"):
            self.models[impl], _ = harness.parallelized(
                reference, mesh, impl, lambda api: lm.tp_plan(api, sequence_parallel=False, loss_parallel=False))
        self.rank = dist.get_rank()
        self.weight_mib = sum(w.numel() * w.element_size() for w in _linears(reference)) / 2**20
        self.steps: Dict[str, Callable[[], None]] = {}
        self.outputs: Dict[str, torch.Tensor] = {}
        for impl, model in self.models.items():
            if impl == "unsharded" and self.rank != 0:
                self.steps[impl] = lambda: None  # the unsharded model runs on rank 0 alone
                continue
            cache = lm.KVCache(c.max_seq_len)
            with torch.no_grad():
                model(prompt, cache)
            self.steps[impl] = self._decode(model, cache, prompt, 0) if prefill else \
                self._decode(model, cache, prompt[:, -1:], PROMPT)
            self.outputs[impl] = self.steps[impl]()
        if prefill:
            return
        for suffix, op in (("", False), (" torch_tp op", True)):
            self.steps["unsharded gemv" + suffix] = _gemvs(_linears(reference), op) if self.rank == 0 \
                else (lambda: None)
            self.steps["tp gemv" + suffix] = _gemvs(_linears(self.models["torch_tp"]), op)

    @staticmethod
    def _decode(model, cache, tokens, start: int):
        """The forward of ``tokens`` at positions ``start ..`` of the cache."""
        @torch.no_grad()
        def step():
            cache.pos = start
            return harness.materialize(model(tokens, cache))  # DTensor's gather may still be in flight
        return step

    def check(self) -> float:
        """The TP logits against the unsharded model's (rank 0): their largest difference relative to the
        largest logit, so a broken case never gets timed."""
        if self.rank != 0:
            return 0.0
        ref = self.outputs["unsharded"].float()
        return max(float((self.outputs[impl].float() - ref).abs().max() / ref.abs().max())
                   for impl in ("torch_tp", "dtensor"))


class HFCase:
    """``steps[impl]()``: greedy ``generate()`` of HF_NEW tokens after a HF_PROMPT-token prompt, by copies of one
    HF Llama: unsharded (rank 0), ``torch_tp.parallelize_module(model, mesh, model.tp_plan)``, torch's
    ``parallelize_module`` with the torch styles of the plan's strings, transformers' own TP (what
    ``from_pretrained(tp_plan="auto")`` applies) and DeepSpeed AutoTP (``init_inference``)."""

    def __init__(self, mesh) -> None:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        torch.manual_seed(1234)
        reference = LlamaForCausalLM(LlamaConfig(**HF_CONFIG)).eval()
        self.weight_mib = sum(w.numel() * w.element_size() for w in _linears(reference)) / 2**20
        torch_styles = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel(),
                        "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()),
                        "colwise_gather_output": ColwiseParallel(output_layouts=Replicate())}
        plan = reference.tp_plan
        models = {"unsharded": reference,
                  "torch_tp": torch_tp.parallelize_module(copy.deepcopy(reference), mesh, plan),
                  "dtensor": parallelize_module(copy.deepcopy(reference), mesh,
                                                {k: torch_styles[v] for k, v in plan.items()}),
                  "hf tp_plan": apply_tensor_parallelism(copy.deepcopy(reference), mesh,
                                                         reference._expand_parallel_plan(plan))}
        deepspeed, self.peer = harness.deepspeed_peer()
        if deepspeed is not None:
            models["deepspeed"] = deepspeed.init_inference(
                copy.deepcopy(reference), tensor_parallel={"tp_size": dist.get_world_size()}, dtype=torch.float32,
                replace_with_kernel_inject=False).module
        prompt = torch.randint(0, HF_CONFIG["vocab_size"], (1, HF_PROMPT),
                               generator=torch.Generator().manual_seed(4321))
        self.steps: Dict[str, Callable[[], torch.Tensor]] = {}
        for impl, model in models.items():
            generate = torch.no_grad()(lambda model=model: model.generate(
                prompt, max_new_tokens=HF_NEW, min_new_tokens=HF_NEW, do_sample=False))
            self.steps[impl] = (lambda: None) if impl == "unsharded" and dist.get_rank() != 0 else generate
        tokens = {impl: step() for impl, step in self.steps.items()}
        if dist.get_rank() == 0:
            wrong = [impl for impl in models if not torch.equal(tokens[impl], tokens["unsharded"])]
            if wrong:
                raise AssertionError(f"--hf: {', '.join(wrong)} generated other tokens than the unsharded model")


def measure_hf(args):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    case = HFCase(mesh)
    impls = [impl for impl in HF_IMPLS if impl in case.steps]
    samples = harness.time_interleaved(case.steps, 5 if args.quick else 15, order=harness.permutations(impls),
                                       warmup=1)
    parts = harness.profile_split(case.steps["torch_tp"], 2, GEMV_EVENTS)
    table = harness.Table("ms", impls, ratios=[(impl, "torch_tp") for impl in impls if impl != "torch_tp"],
                          paired=[("deepspeed", "torch_tp")])
    table.add({"config": "hf1g", "dtype": "float32"}, samples, extra={
        "weights MiB": case.weight_mib, **harness.split_columns(parts, samples.median("torch_tp", "ms"), "gemv")})
    shape = ", ".join(f"{k} {v}" for k, v in HF_CONFIG.items())
    return {
        "tag": "bench_decode hf", "stem": "decode_hf",
        "title": "HF generate() of a 1 GiB Llama: torch_tp vs DTensor TP vs transformers' TP vs DeepSpeed AutoTP",
        "about": f"CPU, eager, float32, {args.backend} backend (DeepSpeed: its own shared-memory all-reduce; peer: "
        f"{case.peer}). transformers' LlamaForCausalLM from config ({shape}; {case.weight_mib:.0f} MiB of linear "
        f"weights), greedy `generate()` of {HF_NEW} tokens after a {HF_PROMPT}-token prompt, the prefill included. "
        "**torch_tp**: `torch_tp.parallelize_module(model, mesh, model.tp_plan)`; **dtensor**: torch's "
        "`parallelize_module` with `ColwiseParallel`/`RowwiseParallel` for the plan's strings; **hf tp_plan**: "
        "transformers' `apply_tensor_parallelism` (what `from_pretrained(tp_plan=\"auto\")` applies); "
        f"**deepspeed**: `deepspeed.init_inference(model, tensor_parallel={{\"tp_size\": {dist.get_world_size()}}})` "
        "(AutoTP); "
        "**unsharded**: the model on rank 0 alone. Every implementation's tokens equal the unsharded model's. "
        + harness.split_about("gemv", "aten::mm/addmm and the torch_tp kernel", 2),
        "tables": [table],
    }


def measure(args):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    impls = PREFILL_IMPLS if args.prefill else IMPLS
    gemv_ratios = [("unsharded gemv", "tp gemv"), ("unsharded gemv", "unsharded gemv torch_tp op"),
                   ("unsharded gemv torch_tp op", "tp gemv torch_tp op")]
    table = harness.Table("ms", impls, ratios=[("unsharded", "torch_tp"), ("dtensor", "torch_tp")]
                          + ([] if args.prefill else gemv_ratios),
                          paired=[] if args.prefill else [("torch_tp", "tp gemv torch_tp op")])
    repeats = (15 if args.quick else 100) if args.cold else (10 if args.quick else 30)
    steady = not (args.prefill or args.cold)
    mm = "gemm" if args.prefill else "gemv"
    for name in args.configs:
        for dtype_name in args.dtypes:
            case = Case(name, getattr(torch, dtype_name), mesh, args.prefill)
            error = case.check()
            if error > (1e-4 if dtype_name == "float32" else 5e-2):
                raise AssertionError(f"{name} {dtype_name}: TP logits differ from the unsharded model's by {error:.2e}")
            samples = harness.time_interleaved(case.steps, repeats, order=harness.permutations(impls), warmup=3,
                                               reset=harness.steady(case.steps, WARM_TOKENS) if steady else None,
                                               calls=STEADY_TOKENS if steady else 1)
            parts = harness.profile_split(case.steps["torch_tp"], 10, GEMV_EVENTS)
            tp = samples.median("torch_tp", "ms")
            extra = {"weights MiB": case.weight_mib, "torch_tp tokens/s": (PROMPT if args.prefill else 1) * 1e3 / tp,
                     **harness.split_columns(parts, tp, mm)}
            table.add({"config": name, "dtype": dtype_name}, samples, extra=extra)
            del case
    shapes = "; ".join(f"{name}: {c['n_layers']} layers, dim {c['dim']}, {c['n_heads']} heads, ffn "
                       f"{lm.LlamaConfig(**c).ffn_hidden_dim}" for name, c in CONFIGS.items() if name in args.configs)
    about = (f"CPU, eager, {args.backend} backend. `examples/llama_model.py`'s model, `tp_plan(api, "
             "sequence_parallel=False, loss_parallel=False)` applied to copies of one model by **torch_tp** and "
             f"**dtensor** (torch.distributed.tensor.parallel) over the {dist.get_world_size()} ranks; "
             f"**unsharded**: the model on rank 0 alone. Models ({shapes}; vocab {VOCAB}). ")
    if args.prefill:
        about += (f"A step runs the {PROMPT}-token prompt into an empty `KVCache`, logits gathered: every linear a "
                  f"GEMM of {PROMPT} rows (in bfloat16 and float16 on a CPU without native GEMMs for them, "
                  "torch_tp's run float32 panels). `torch_tp tokens/s`: prompt tokens. ")
    else:
        about += (f"A step decodes one token with `KVCache` holding {PROMPT} (rewound before each token), logits "
                  "gathered. " + ("A sample: one token right after another implementation's (--cold). " if args.cold
                                  else f"A sample: the mean of {STEADY_TOKENS} tokens back to back after "
                                  f"{WARM_TOKENS} untimed ones of the same implementation. ") +
                  "**unsharded gemv** / **tp gemv**: the step's weight GEMVs alone (`F.linear` of one token, whole "
                  "weights on rank 0 alone / each rank's shards at once), the bandwidth limit measured like the "
                  "step; **... torch_tp op**: the same through torch_tp's column-parallel op (its own few-row "
                  "kernel on the CPU, NOTE [few-row GEMV on the CPU]), the limit of the TP step, whose linears run "
                  "that op. ")
    about += harness.split_about(mm, "aten::mm/addmm" + ("" if args.prefill else " and the torch_tp kernel"), 10)
    suffix = (" float16" if args.dtypes == ["float16"] else "") + (" cold" if args.cold else "")
    mode = (" prefill" if args.prefill else "") + suffix
    return {
        "tag": "bench_decode" + mode, "stem": "decode" + mode.replace(" ", "_"),
        "title": (f"Prefill of a {PROMPT}-token prompt" if args.prefill else "Decode with a KV cache")
        + ": torch_tp vs DTensor TP vs unsharded" + (f" ({', '.join(suffix.split())})" if suffix else ""),
        "about": about + " Before timing, the TP logits are checked against the unsharded model's (1e-4 fp32, 5e-2 "
        "bf16 and fp16 of the largest logit).",
        "tables": [table],
    }


if __name__ == "__main__":
    p = harness.parser(__doc__, quick="smoke run: 10 repeats per configuration (15 with --cold)", backend="torch_tp",
                       configs=CONFIGS)
    p.add_argument("--dtypes", type=harness.names(["float32", "bfloat16", "float16"]), default="float32,bfloat16",
                   help="comma-separated subset of %(default)s, or float16 alone (its own section)")
    p.add_argument("--cold", action="store_true",
                   help="time single tokens right after another implementation's, not a decode loop's steady "
                   "state (see above)")
    p.add_argument("--prefill", action="store_true",
                   help=f"time the {PROMPT}-token prompt's forward instead of one token; writes decode_prefill.*")
    p.add_argument("--hf", action="store_true", help="HF generate() of a 1 GiB Llama, against DTensor TP, "
                   "transformers' TP and DeepSpeed AutoTP (see above; needs transformers); writes decode_hf.*")
    args = p.parse_args()
    if args.hf and (args.cold or args.prefill):
        p.error("--hf times whole generate() calls, the prefill included")
    if args.cold and args.prefill:
        p.error("--cold times decode tokens; a prompt's forward (--prefill) is timed once per sample already")
    if "float16" in args.dtypes and len(args.dtypes) > 1:
        p.error(f"--dtypes {','.join(args.dtypes)}: float16 runs alone (its own section and files)")
    sys.exit(harness.run(args, measure_hf if args.hf else measure))
