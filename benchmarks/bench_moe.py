#!/usr/bin/env python3
"""An MoE layer's experts under expert parallelism (EP), forward + backward (CPU, float32, one thread per rank).

Qwen3-MoE's transformers experts module (``grouped_mm``), the same weights everywhere; each rank has its own
tokens and top-k routing. A step: the experts' forward and the backward of a fixed output gradient.

**unsharded**: the whole module on this rank's tokens; **torch_tp**: ``torch_tp.parallelize_module(holder,
mesh, {"experts": torch_tp.ExpertParallel()})``; **torchtitan**: its ``RoutedExperts`` (``AllToAllTokenDispatcher``,
``GroupedExperts`` of this rank's experts, w1 = gate, w3 = up, w2 = down; GEMMs in float32); **hf ep**:
transformers' ``apply_expert_parallelism`` (``from_pretrained``'s EP), Qwen3-MoE's ep_plan, ``all_to_all``.

torch_tp's parts: **gemm**, ``torch_tp::moe_gated_experts`` (how torch_tp runs this rank's experts) on the rows
it receives; **d+c**, ``moe_token_dispatch`` and ``moe_token_combine`` around identity experts; **a2a**,
``torch.distributed.all_to_all_single`` of the same rows, twice in the forward and twice in the backward."""

import copy
import sys
import time
import types

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import harness
import torch_tp

IMPLS = ["torch_tp", "unsharded", "torchtitan", "hf ep"]
PARTS = {"gemm": "gemm", "d+c fwd": "exchange/fwd", "d+c bwd": "exchange/bwd", "a2a fwd": "a2a/fwd",
         "a2a bwd": "a2a/bwd"}
TOL = 1e-4  # |a - unsharded|max / |unsharded|max, output and input gradients: float32, other summation orders
# qwen3-30b: Qwen3-30B-A3B's expert sizes and top-8, 64 of its 128 experts (1.1 GiB, far above the L3)
CONFIGS = {"dim1024": dict(experts=8, top_k=2, hidden=1024, intermediate=2048, tokens=1024),
           "qwen3-30b": dict(experts=64, top_k=8, hidden=2048, intermediate=768, tokens=512)}


def experts_module(a, num_experts):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    return Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=a.hidden, moe_intermediate_size=a.intermediate,
                                          num_experts=num_experts, num_experts_per_tok=a.top_k,
                                          experts_implementation="grouped_mm"))


def build(impl, ref, mesh, a):
    """impl's forward: (x, top_k_index, top_k_weights) -> [T, H]."""
    p, r, E = mesh.size(), mesh.get_local_rank(), a.experts
    holder = torch.nn.ModuleDict({"experts": copy.deepcopy(ref)})
    if impl == "unsharded":
        return holder.experts
    if impl == "torch_tp":
        return torch_tp.parallelize_module(holder, mesh, {"experts": torch_tp.ExpertParallel()}).experts
    if impl == "hf ep":
        from transformers.distributed.expert_parallel import apply_expert_parallelism
        tp_mesh = init_device_mesh("cpu", (p, 1), mesh_dim_names=("ep", "tp"))["tp"]  # no TP: size 1
        plan = {"experts.gate_up_proj": "grouped_gemm", "experts.down_proj": "grouped_gemm",
                "experts": "ep_dispatch_experts"}  # Qwen3MoeConfig.base_model_ep_plan's entries
        return apply_expert_parallelism(holder, mesh, tp_mesh, plan, ep_implementation="all_to_all").experts
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
    set_spmd_backend("partial_dtensor")  # see the notes: "spmd_types" (the default) fails on gloo
    m = RoutedExperts.Config(
        inner_experts=GroupedExperts.Config(dim=a.hidden, hidden_dim=a.intermediate, num_experts=E // p),
        token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=E, top_k=a.top_k)).build()
    m.token_dispatcher.wire_meshes(ep_mesh=mesh)
    g, mine = m.inner_experts, slice(r * E // p, (r + 1) * E // p)
    g.w1_EFD, g.w3_EFD, g.w2_EDF = (torch.nn.Parameter(t.contiguous()) for t in (
        *ref.gate_up_proj.detach()[mine].chunk(2, dim=1), ref.down_proj.detach()[mine]))

    def f32_forward(x, num_tokens_per_expert):  # GroupedExperts.forward without its bfloat16 casts
        offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        mm = lambda a, w: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)  # noqa: E731
        return mm(F.silu(mm(x, g.w1_EFD)) * mm(x, g.w3_EFD), g.w2_EDF)
    g.forward = f32_forward
    fn = lambda x, idx, w: m(x[None], w[None], idx[None], torch.bincount(idx.flatten(), minlength=E))[0]  # noqa
    fn.parameters = m.parameters
    return fn


def step(fn, x, idx, w, dy, laps=False):
    def run():  # laps: the forward's end
        out = fn(x, idx, w)
        t_fwd = time.perf_counter()
        out.backward(dy)
        return {"fwd": t_fwd} if laps else out
    return run


def measure(args):
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("ep",))
    vs_tp, goal = [(i, "torch_tp") for i in IMPLS[1:]], [("d+c fwd", "a2a fwd"), ("d+c bwd", "a2a bwd")]
    table = harness.Table("ms", IMPLS, ratios=vs_tp, paired=vs_tp, title="Step (forward + backward)")
    parts = harness.Table("ms", list(PARTS), ratios=goal, paired=goal, title="torch_tp's step in parts")
    notes = [measure_case(types.SimpleNamespace(**CONFIGS[name]), mesh, table, parts, args) for name in args.configs]
    backend = "" if args.backend == "gloo" else f" backend={args.backend}"
    return {
        "tag": "bench_moe" + backend, "stem": "moe" + backend.replace(" backend=", "_"),
        "title": "MoE experts under expert parallelism, forward + backward: torch_tp vs torchtitan vs transformers"
        + (f", on the {args.backend} backend" if backend else ""),
        "about": __doc__.split("\n\n", 1)[1].strip() + f" Outputs and input gradients agree with the unsharded "
        f"layer's within {TOL:g} (max abs error / max abs value) before timing; steps in shuffled orders.",
        "tables": [table, parts], "notes": notes}


def measure_case(a, mesh, table, parts, args):
    """One shape's rows of both tables; returns its goal line."""
    p, r, E, T, H, g = mesh.size(), mesh.get_local_rank(), a.experts, a.tokens, a.hidden, mesh.get_group()
    torch.manual_seed(0)
    ref = experts_module(a, E)
    with torch.no_grad():
        ref.gate_up_proj.normal_(0, H ** -0.5), ref.down_proj.normal_(0, a.intermediate ** -0.5)
    gen = torch.Generator().manual_seed(1 + r)  # each rank its own tokens, routing and output gradient
    x = torch.randn(T, H, generator=gen).requires_grad_()
    scores, idx = torch.randn(T, E, generator=gen).softmax(-1).topk(a.top_k, dim=-1)
    w = (scores / scores.sum(-1, keepdim=True)).requires_grad_()
    dy = torch.randn(T, H, generator=gen)
    fns = {impl: build(impl, ref, mesh, a) for impl in IMPLS}
    steps = {impl: step(fn, x, idx, w, dy) for impl, fn in fns.items()}
    leaves = [x, w] + [t for fn in fns.values() for t in fn.parameters()]
    want = [steps["unsharded"]().detach(), x.grad.clone(), w.grad.clone()]  # checked before timing
    for impl in IMPLS[:1] + IMPLS[2:]:
        x.grad = w.grad = None
        err = max(((o - t).abs().max() / t.abs().max()).item()
                  for o, t in zip([steps[impl]().detach(), x.grad, w.grad], want))
        assert err <= TOL, f"{impl} differs from the unsharded layer by {err:.3g} (rank {r})"
    # torch_tp's parts, on the rows this rank receives and the split sizes of its routing
    dispatch, combine = torch.ops.torch_tp.moe_token_dispatch, torch.ops.torch_tp.moe_token_combine
    rows, _, _, tpe, recv = dispatch(x.detach(), idx, E, g.group_name)
    mine = slice(r * E // p, (r + 1) * E // p)
    weights = [t.detach()[mine].clone().requires_grad_() for t in (ref.gate_up_proj, ref.down_proj)]
    rows = rows.clone().requires_grad_()
    leaves += weights
    steps["gemm"] = step(lambda *_: torch.ops.torch_tp.moe_gated_experts(rows, recv, *weights), 0, 0, 0,
                         torch.randn(rows.shape))

    def exchange(xx, ii, ww):  # identity experts
        d = dispatch(xx, ii, E, g.group_name)
        return combine(d[0], ww, *d[2:], g.group_name)
    steps["exchange"] = step(exchange, x, idx, w, dy, laps=True)
    sizes = [tpe.view(p, -1).sum(1).tolist(), recv.sum(1).tolist()]  # rows sent to, received from each rank
    sorted_x = x.detach()[torch.argsort(idx.flatten(), stable=True) // a.top_k]

    def a2a(t, back):  # dispatch's all-to-all, or (back) combine's
        send, got = sizes[::-1] if back else sizes
        out = t.new_empty(sum(got), H)
        torch.distributed.all_to_all_single(out, t, got, send, group=g)
        return out

    def all_to_alls():  # forward: dispatch, combine; backward: combine's, dispatch's
        a2a(a2a(sorted_x, False), True)
        t_fwd = time.perf_counter()
        a2a(a2a(sorted_x, False), True)
        return {"fwd": t_fwd}
    steps["a2a"] = all_to_alls

    reset = lambda: [setattr(t, "grad", None) for t in leaves + [rows]]  # noqa: E731
    samples = harness.time_interleaved(steps, args.repeats, order=harness.permutations(list(steps)),
                                       reset={k: reset for k in steps}, warmup=2)
    for k in ("exchange", "a2a"):
        samples.per_rank[f"{k}/bwd"] = samples.per_rank[k] - samples.per_rank[f"{k}/fwd"]
    case = {"shape": f"E {E}, top-{a.top_k}, H {H}, I {a.intermediate}, {T} tokens/rank, EP {p}"}
    table.add(case, samples, extra={"experts' weights MiB": 3 * E * H * a.intermediate * 4 / 2 ** 20,
                                    "rows/rank": rows.size(0)})
    parts.add(case, samples, keys=PARTS)
    med = lambda k: samples.median(k, "ms")  # noqa: E731
    fwd, bwd = med("exchange/fwd") / med("a2a/fwd"), med("exchange/bwd") / med("a2a/bwd")
    ahead = {i: med(i) / med("torch_tp") for i in ("torchtitan", "hf ep")}
    return (f"Goal (issue 51, 7), {case['shape']}: dispatch + combine within 1.3x of the two all-to-alls: forward "
            f"{fwd:.2f}x, backward {bwd:.2f}x: {'met' if max(fwd, bwd) <= 1.3 else 'NOT met'}. Ahead of both peers ("
            + ", ".join(f"{i} / torch_tp {v:.2f}" for i, v in ahead.items())
            + ("): met." if min(ahead.values()) > 1 else "): NOT met."))


if __name__ == "__main__":
    p = harness.parser(__doc__, backend="gloo", configs=list(CONFIGS))
    p.add_argument("--repeats", type=int, default=25, help="steps of each implementation (default: %(default)s)")
    sys.exit(harness.run(p.parse_args(), measure))
