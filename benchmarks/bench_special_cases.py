#!/usr/bin/env python3
"""What each of torch_tp's hot-path special cases gains (issue 53 goal 1): the same model, the same step, with
one case switched off and on, paired in one process, at the example size and at a realistic one, for a
training step (examples/llama_model.py under its sequence-parallel plan) and a decode step (one token with a
KV cache, the plan without sequence parallelism).

A case is switched off by making torch_tp take its general path instead, exactly as a call the case does not
cover would: the layouts' short paths by clearing the flags or returning None where they decline, the C entry
points by calling torch.ops, fused Adam's local rule by forgetting torch_tp's parameters, the C++ parameter
unwrap (with the two shortcuts of its backward) by DTensor.to_local (what torch.compile runs).
"""

import sys
from typing import Callable, Dict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial

import harness
import llama_model as lm
import bench_train

import torch_tp.parallel._params as params
import torch_tp.parallel.style as style

# name: (LlamaConfig overrides, batch, seq) of a training step; (overrides, None, None) of a decode step
SIZES = {
    "train example": ({"dim": 256, "n_layers": 4, "n_heads": 4}, 4, 64),
    "train dim1024 seq512": ({"dim": 1024, "n_layers": 2, "n_heads": 8}, 2, 512),
    "decode example": ({"dim": 256, "n_layers": 4, "n_heads": 4}, None, None),
    "decode dim2048x8": ({"dim": 2048, "n_layers": 8, "n_heads": 16}, None, None),
}
REPEATS = {"train example": 30, "train dim1024 seq512": 8, "decode example": 40, "decode dim2048x8": 12}
DECODE_VOCAB, PROMPT = 8192, 64
WARM, STEADY = 1, 3  # a sample: untimed steps after the switch, then timed ones


def _switch_attribute(owner, name: str, off_value) -> Callable[[bool], None]:
    on_value = getattr(owner, name)
    return lambda on: setattr(owner, name, on_value if on else off_value)


def _switch_states(model, field: str) -> Callable[[bool], None]:
    states = [m._tp_state for m in model.modules() if isinstance(getattr(m, "_tp_state", None), style.ShardedState)]
    saved = [getattr(s, field) for s in states]

    def switch(on: bool) -> None:
        for s, v in zip(states, saved):
            setattr(s, field, v if on else False)
    return switch


def _switch_fused_adam() -> Callable[[bool], None]:
    saved = set(params._distributed)

    def switch(on: bool) -> None:
        params._distributed.clear()
        if on:
            params._distributed.update(saved)
    return switch


def _to_local_unwrap(param, local, spec, new_grad, differentiable_grad, take_partial=None):
    return param.to_local(grad_placements=(Partial(),) if take_partial is not None else None)


def _column_by_torch_ops(x, weight, bias, group_name, partial_grad_input=False):
    return torch.ops.torch_tp.column_parallel_linear(x, weight, bias, group_name,
                                                     partial_grad_input=partial_grad_input)


def _row_by_torch_ops(x, weight, bias, group_name, scatter_dim):
    return torch.ops.torch_tp.row_parallel_linear(x, weight, bias, group_name, scatter_dim)


def switches(model) -> Dict[str, Callable[[bool], None]]:
    """case -> switch(on)."""
    column, row = _switch_attribute(style, "_column_parallel_linear", _column_by_torch_ops), \
        _switch_attribute(style, "_row_parallel_linear", _row_by_torch_ops)
    cases = {
        "colwise plain-tensor path": _switch_states(model, "replicated_in_local_out"),
        "rowwise plain-tensor path": _switch_states(model, "features_in_local_out"),
        "C entry points of the linears": lambda on: (column(on), row(on)),
        "weight and bias from _parameters": _switch_attribute(style, "_weight_and_bias",
                                                              lambda m: (m.weight, m.bias)),
        "gather of a handed shard": _switch_attribute(style, "_gather_handed", lambda *a: None),
        "norm of a recorded shard": _switch_attribute(style._SequenceParallelModule, "_tp_norm_of_recorded_shard",
                                                      lambda self, x: None),
        "fused Adam on local tensors": _switch_fused_adam(),
        "C++ parameter unwrap": _switch_attribute(params, "local_parameter", _to_local_unwrap),
    }
    every = list(cases.values())
    cases["all of them"] = lambda on: [s(on) for s in every]
    return cases


def training_step(size: str, mesh) -> tuple:
    overrides, batch, seq = SIZES[size]
    bench_train.CONFIGS[size] = (overrides, batch, seq, 0)
    step = bench_train.Case(size, mesh, ["torch_tp"], False, False).steps["torch_tp"]
    model = next(c.cell_contents for c in step.__closure__ if isinstance(c.cell_contents, torch.nn.Module))
    return step, model


def decode_step(size: str, mesh) -> tuple:
    overrides = SIZES[size][0]
    c = lm.LlamaConfig(vocab_size=DECODE_VOCAB, max_seq_len=PROMPT + 8, **overrides)
    torch.manual_seed(1234)
    reference = lm.Llama(c)
    model, _ = harness.parallelized(reference, mesh, "torch_tp",
                                    lambda api: lm.tp_plan(api, sequence_parallel=False, loss_parallel=False))
    del reference
    prompt = torch.randint(0, DECODE_VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(4321))
    cache = lm.KVCache(c.max_seq_len)
    with torch.no_grad():
        model(prompt, cache)

    @torch.no_grad()
    def step():
        cache.pos = PROMPT
        return model(prompt[:, -1:], cache)
    return step, model


def measure(args):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    table = harness.Table("ms", ["on", "off"], ratios=[("off", "on")], paired=[("off", "on")])
    for size in args.sizes:
        step, model = (training_step if size.startswith("train") else decode_step)(size, mesh)
        warm = lambda: [step() for _ in range(WARM)]  # noqa: E731
        for name, switch in switches(model).items():
            if args.cases and name not in args.cases:
                continue
            reset = {"on": lambda s=switch: (s(True), warm()), "off": lambda s=switch: (s(False), warm())}
            try:
                samples = harness.time_interleaved({"on": step, "off": step}, REPEATS[size], reset=reset,
                                                   warmup=1, calls=STEADY)
            finally:
                switch(True)
            on = samples.median("on", "ms")
            gain = samples.paired("off", "on", "ms")["median"]
            table.add({"size": size, "case": name}, samples, extra={"gain % of the step": 100 * gain / on})
    return {
        "tag": "bench_special_cases", "stem": "special_cases",
        "title": "torch_tp's hot-path special cases: each one on and off, paired",
        "about": f"CPU, eager, {args.backend} backend, {dist.get_world_size()} ranks. **on**: torch_tp as it "
        "is; **off**: the same model and step with the one case switched off (its calls take the general path). "
        "Training: `examples/llama_model.py` under `tp_plan(api)` (sequence parallel, loss_parallel), a step is "
        "forward, loss, backward, fused AdamW, zero_grad; sizes: example (4 layers, dim 256, batch 4 x seq 64), "
        "dim1024 seq512 (2 layers, dim 1024, batch 2 x seq 512). Decode: the plan without sequence parallelism, "
        f"one token with a {PROMPT}-token KV cache, vocab {DECODE_VOCAB}; example (4 layers, dim 256) and "
        "dim2048x8 (8 layers, dim 2048, 1.7 GiB of float32 weights). A sample: the mean of "
        f"{STEADY} steps after {WARM} untimed one(s) with the switch set. `gain %`: median of the paired "
        "(off - on) differences over the on step.",
        "tables": [table],
    }


if __name__ == "__main__":
    p = harness.parser(__doc__, backend="torch_tp")
    p.add_argument("--sizes", type=harness.names(list(SIZES)), default=",".join(SIZES))
    p.add_argument("--cases", type=lambda t: t.split(","), default=[],
                   help="comma-separated case names (default: every case)")
    sys.exit(harness.run(p.parse_args(), measure))
