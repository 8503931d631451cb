"""Mixture-of-experts models under their own Hugging Face plans, against the unsharded model: the
experts split by ``ExpertsTensorParallel`` (the ``tp_plan``'s ``moe_tp_experts``), and whole experts
per rank by ``ExpertParallel`` (the ``ep_plan``'s ``ep_dispatch_experts``, each rank its own batch of
its own size, tokens exchanged by torch_tp's dispatch and combine ops).

Mixtral and Qwen3-MoE are built from config (4 experts, top-2, no downloads) in float64 with the
eager experts kernel (HF's default ``grouped_mm`` has no float64 CPU kernel); the same model then
runs with ``grouped_mm`` in float32 and bfloat16. Some of the models' tokens are routed
deliberately to one expert (a skewed router), so experts see different token counts, one none.
Compared: logits, the loss, the auxiliary load-balancing loss, every gradient (the router's
included), the parameters after an AdamW step, the state dict (the full ``[E, ...]`` tensors,
natural order), a DCP checkpoint loaded into the unsharded model, and greedy ``generate()``.

Tolerances: float64, 1e-10 of each tensor's largest magnitude (sharded GEMMs and the all-reduce
sum in other orders, ~1e-15; a sharding mistake costs O(1)); Mixtral's router takes the softmax
in float32 (``router_logits.float()``), so its routing weights, and every gradient through them,
carry float32 roundoff that the summation order changes: 1e-6 there. AdamW (lr 1e-3, eps 1e-4)
amplifies a gradient's roundoff by at most lr / eps = 10. float32 ``grouped_mm``: 1e-5 (float32
roundoff of H=32 and I=32-long dot products); bfloat16: 3e-2 (three bf16 roundings of 8 bits).
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import transformers  # noqa: F401  (a test dependency, pinned in scripts/run_tests.sh; the ranks import from it)

import torch_tp
from _compare import assert_close, assert_error_names

TOL = {"qwen3_moe": 1e-10, "mixtral": 1e-6}
PARAM_FLOOR = 0.1
GRAD_FLOOR = 1e-12


def _model(kind: str, world_size: int, dtype=torch.float64, experts="eager", intermediate: int = 32):
    """A small *ForCausalLM MoE (4 experts, top-2, two layers) with the same weights on every rank;
    layer 0's router sends every token's first choice to expert 1 (a skewed router)."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    sizes = dict(hidden_size=32, num_hidden_layers=2, vocab_size=64, num_attention_heads=2 * world_size,
                 num_key_value_heads=world_size, num_experts_per_tok=2, output_router_logits=True)
    torch.manual_seed(0)
    if kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(num_local_experts=4, intermediate_size=intermediate, **sizes))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=4, moe_intermediate_size=intermediate, head_dim=8,
                                                   intermediate_size=64, **sizes))
    model.set_experts_implementation(experts)
    with torch.no_grad():
        model.model.layers[0].mlp.gate.weight[1] += 3.0  # expert 1 first for every token: skewed counts
    return model.to(dtype)


def _full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _natural_grad(model, name: str, grad):
    """A packed parameter's gradient in the natural order (its rows are rank-major; NOTE [packed parameters])."""
    module_name, _, param_name = name.rpartition(".")
    layouts = getattr(getattr(model.get_submodule(module_name), "_tp_state", None), "layouts", {})
    if param_name in layouts:
        return layouts[param_name].to_natural(grad)
    return grad


def _check_plan(kind: str):
    world_size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    tol = TOL[kind]
    unsharded = _model(kind, world_size)
    ours = torch_tp.parallelize_module(copy.deepcopy(unsharded), mesh, unsharded.tp_plan)
    experts = ours.model.layers[0].mlp.experts
    assert type(experts).__name__.startswith("ExpertsTensorParallel"), type(experts)
    assert experts.gate_up_proj.placements == (Shard(1),) and experts.down_proj.placements == (Shard(2),)
    assert experts.gate_up_proj.to_local().shape == (4, 64 // world_size, 32)
    assert not isinstance(ours.model.layers[0].mlp.gate.weight, DTensor), "the router must stay replicated"

    torch.manual_seed(1)
    ids = torch.randint(0, 64, (2, 12))
    expected, got = unsharded(input_ids=ids, labels=ids), ours(input_ids=ids, labels=ids)
    what = f"{kind} at {world_size} ranks"
    assert_close(got.logits, expected.logits, f"{what}: logits", tol)
    assert_close(got.loss, expected.loss, f"{what}: loss", tol)
    assert_close(got.aux_loss, expected.aux_loss, f"{what}: aux_loss", tol)
    expected.loss.backward()
    got.loss.backward()
    for (name, param), reference in zip(ours.named_parameters(), unsharded.parameters()):
        grad = _natural_grad(ours, name, param.grad) if isinstance(param.grad, DTensor) else param.grad
        assert_close(_full(grad), reference.grad, f"{what}: {name}.grad", tol, floor=GRAD_FLOOR)

    for model in (unsharded, ours):
        torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4).step()
    state = ours.state_dict()
    for name, reference in unsharded.state_dict().items():
        assert_close(_full(state[name]), reference, f"{what}: state_dict['{name}'] after AdamW", 10 * tol,
                     floor=PARAM_FLOOR)
    assert tuple(state["model.layers.0.mlp.experts.gate_up_proj"].shape) == (4, 64, 32)


@pytest.mark.parametrize("kind, world_size", [("mixtral", 2), ("qwen3_moe", 2), ("mixtral", 4), ("qwen3_moe", 4)])
def test_hf_moe_plan(ranks, kind, world_size):
    ranks(world_size).run(_check_plan, kind, timeout=300)


def _check_grouped_mm(dtype):
    world_size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    unsharded = _model("qwen3_moe", world_size, dtype=dtype, experts="grouped_mm")
    ours = torch_tp.parallelize_module(copy.deepcopy(unsharded), mesh, unsharded.tp_plan)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (2, 12))
    expected, got = unsharded(input_ids=ids, labels=ids), ours(input_ids=ids, labels=ids)
    assert_close(got.logits, expected.logits, f"grouped_mm {dtype}: logits", tol)
    expected.loss.backward()
    got.loss.backward()
    for name in ("model.layers.0.mlp.experts.down_proj", "model.layers.1.mlp.gate.weight"):
        ref = unsharded.get_parameter(name).grad
        assert_close(_full(ours.get_parameter(name).grad), ref, f"grouped_mm {dtype}: {name}.grad", tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_experts(ranks, dtype):
    ranks(2).run(_check_grouped_mm, dtype, timeout=300)


def _check_dcp_and_generate(path: str):
    world_size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    unsharded = _model("qwen3_moe", world_size)
    ours = torch_tp.parallelize_module(copy.deepcopy(unsharded), mesh, unsharded.tp_plan)
    prompt = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(2))
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(ours.generate(prompt, **settings), unsharded.generate(prompt, **settings))

    with torch.no_grad():
        for param in ours.parameters():
            param.mul_(1.5)  # a state the fresh model does not have
    dcp.save(ours.state_dict(), checkpoint_id=path)
    saved = {name: _full(value) for name, value in ours.state_dict().items()}  # collectives: every rank
    dist.barrier()
    if dist.get_rank() == 0:  # DCP into the unsharded model, one process: every [E, ...] tensor whole
        fresh = _model("qwen3_moe", world_size)
        state = fresh.state_dict()
        dcp.load(state, checkpoint_id=path, no_dist=True)
        fresh.load_state_dict(state)
        for name, value in fresh.state_dict().items():
            assert torch.equal(value, saved[name]), name
            assert torch.equal(value, 1.5 * unsharded.state_dict()[name]), name
    dist.barrier()


def test_dcp_to_unsharded_and_generate(ranks, tmp_path):
    ranks(2).run(_check_dcp_and_generate, str(tmp_path / "ckpt"), timeout=300)


def _check_expert_parallel(kind: str):
    """HF's ep_plan on its own: every rank its own batch (data parallel), its own experts. Each rank's
    logits must be the unsharded model's on that batch; an expert's gradient sums over every rank's
    tokens (the all-reduce of the unsharded gradients), every other gradient is this rank's batch's."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world_size,))
    tol = TOL[kind]
    unsharded = _model(kind, world_size)
    ours = torch_tp.parallelize_module(copy.deepcopy(unsharded), mesh, unsharded.ep_plan)
    experts = ours.model.layers[0].mlp.experts
    assert experts.gate_up_proj.placements == (Shard(0),) and experts.gate_up_proj.to_local().shape[0] == 4 // world_size

    ids = torch.randint(0, 64, (1 + rank, 7), generator=torch.Generator().manual_seed(rank))  # ranks differ in size
    expected, got = unsharded(input_ids=ids, labels=ids), ours(input_ids=ids, labels=ids)
    what = f"{kind} expert parallel at {world_size} ranks, rank {rank}"
    assert_close(got.logits, expected.logits, f"{what}: logits", tol)
    assert_close(got.aux_loss, expected.aux_loss, f"{what}: aux_loss", tol)
    expected.loss.backward()
    got.loss.backward()
    for (name, param), reference in zip(ours.named_parameters(), unsharded.parameters()):
        if isinstance(param, DTensor):  # this rank's experts, their gradients summed over every rank's tokens
            summed = reference.grad.clone()
            dist.all_reduce(summed)
            local = param.to_local().shape[0]
            assert_close(param.grad.to_local(), summed[rank * local:(rank + 1) * local], f"{what}: {name}.grad", tol,
                         floor=GRAD_FLOOR)
        else:
            assert_close(param.grad, reference.grad, f"{what}: {name}.grad", tol, floor=GRAD_FLOOR)


@pytest.mark.parametrize("kind, world_size", [("mixtral", 2), ("qwen3_moe", 4)])
def test_hf_ep_plan(ranks, kind, world_size):
    ranks(world_size).run(_check_expert_parallel, kind, timeout=300)


def _check_bad_input():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    world_size = dist.get_world_size()
    odd = _model("mixtral", world_size, intermediate=6)  # 6 does not split over 4 ranks
    assert_error_names(lambda: torch_tp.parallelize_module(odd, mesh, odd.tp_plan),
                       ["'model.layers.0.mlp.experts'", "intermediate size 6", f"{world_size} ranks"], ValueError)
    model = _model("mixtral", world_size)
    assert_error_names(lambda: torch_tp.parallelize_module(model, mesh, {"model.layers.*.mlp": "moe_tp_experts"}),
                       ["'model.layers.0.mlp'", "experts module"], NotImplementedError)
    plan = {k: v for k, v in model.tp_plan.items() if v != "moe_tp_experts"}
    assert_error_names(lambda: torch_tp.parallelize_module(model, mesh, plan),
                       ["'model.layers.0.mlp.experts.gate_up_proj'", "'moe_tp_experts'"], ValueError)


def test_bad_input(ranks):
    ranks(4).run(_check_bad_input)
