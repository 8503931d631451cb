"""Mixture-of-experts models under their own Hugging Face plans, against the unsharded model: the
experts split by ``ExpertsTensorParallel`` (the ``tp_plan``'s ``moe_tp_experts``), whole experts
per rank by ``ExpertParallel`` (the ``ep_plan``'s ``ep_dispatch_experts``, each rank its own batch of
its own size, tokens exchanged by torch_tp's dispatch and combine ops), both ways at once by
``ExpertTensorParallel`` on an (ep, tp) mesh, and FSDP2 over a dp dim beside them. DCP checkpoints
(model and optimizer) saved at EP 2 x TP 2 load at EP 4, TP 2 and into the unsharded model.

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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import transformers  # noqa: F401  (a test dependency, pinned in scripts/run_tests.sh; the ranks import from it)

import torch_tp
from torch_tp.parallel.moe import _gated_silu_experts
from _compare import assert_close, assert_error_names

TOL = {"qwen3_moe": 1e-10, "mixtral": 1e-6}
PARAM_FLOOR = 0.1
GRAD_FLOOR = 1e-12


def _model(kind: str, world_size: int, dtype=torch.float64, experts="eager", intermediate: int = 32,
           act: str = "silu"):
    """A small *ForCausalLM MoE (4 experts, top-2, two layers) with the same weights on every rank;
    layer 0's router sends every token's first choice to expert 1 (a skewed router)."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    sizes = dict(hidden_size=32, num_hidden_layers=2, vocab_size=64, num_attention_heads=2 * world_size,
                 num_key_value_heads=world_size, num_experts_per_tok=2, output_router_logits=True, hidden_act=act)
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


def _full_natural(model, name: str, value):
    """A (possibly FSDP2-sharded) parameter or gradient as the full tensor in its natural order."""
    full = _full(value)
    module_name, _, param_name = name.rpartition(".")
    layouts = getattr(getattr(model.get_submodule(module_name), "_tp_state", None), "layouts", {})
    if param_name in layouts:
        layout = layouts[param_name]
        full = full.index_select(layout.dim, layout.rank_major_index(full.device).argsort())
    return full


def _forward_both(unsharded, ours, ids, what: str, tol: float):
    """Both models' outputs on ``ids``, after checking that ours has the unsharded logits, loss and
    auxiliary load-balancing loss."""
    expected, got = unsharded(input_ids=ids, labels=ids), ours(input_ids=ids, labels=ids)
    for name in ("logits", "loss", "aux_loss"):
        assert_close(getattr(got, name), getattr(expected, name), f"{what}: {name}", tol)
    return expected, got


def _assert_grads_then_adamw(ours, unsharded, what: str, tol: float):
    """Every gradient of ``ours`` (full, natural order) is the unsharded model's, and so is the state
    dict after an AdamW step of both, with the full ``[E, ...]`` expert tensors."""
    for (name, param), reference in zip(ours.named_parameters(), unsharded.parameters()):
        assert_close(_full_natural(ours, name, param.grad), reference.grad, f"{what}: {name}.grad", tol,
                     floor=GRAD_FLOOR)
    for model in (unsharded, ours):
        torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4).step()
    state = ours.state_dict()
    for name, reference in unsharded.state_dict().items():
        assert_close(_full(state[name]), reference, f"{what}: state_dict['{name}'] after AdamW", 10 * tol,
                     floor=PARAM_FLOOR)
    assert tuple(state["model.layers.0.mlp.experts.gate_up_proj"].shape) == (4, 64, 32)


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
    what = f"{kind} at {world_size} ranks"
    expected, got = _forward_both(unsharded, ours, torch.randint(0, 64, (2, 12)), what, tol)
    expected.loss.backward()
    got.loss.backward()
    _assert_grads_then_adamw(ours, unsharded, what, tol)


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


def _parallelize(model, ep: int, tp: int):
    """``model`` on an (ep, tp) mesh of the world: HF's ep_plan alone (tp 1), its tp_plan alone (ep 1),
    or ExpertTensorParallel on the experts and the tp_plan on mesh["tp"] for the rest."""
    mesh = init_device_mesh("cpu", (ep, tp), mesh_dim_names=("ep", "tp"))
    if tp == 1:
        return torch_tp.parallelize_module(model, mesh["ep"], model.ep_plan), mesh
    if ep > 1:
        torch_tp.parallelize_module(model, mesh, {"model.layers.*.mlp.experts": torch_tp.ExpertTensorParallel()})
    return torch_tp.parallelize_module(model, mesh["tp"], model.tp_plan), mesh


def _batch(group: int, length: int = 7):
    """EP group ``group``'s own batch, of its own size: the ep ranks differ in token counts."""
    return torch.randint(0, 64, (1 + group, length), generator=torch.Generator().manual_seed(group))


def _sum_over_ep(model, mesh):
    """The gradients of every parameter but the experts' summed over the ep groups, as data parallelism
    over them does (without its mean); the experts' are such sums already, their tokens' from every rank."""
    for name, param in model.named_parameters():
        if ".experts." not in name:
            dist.all_reduce(param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad,
                            group=mesh.get_group("ep"))


def _check_expert_layout(kind: str, ep: int, tp: int, act: str = "silu"):
    """The experts over ep (each ep group its own batch, of its own size) and tp. Each rank's logits,
    loss and aux loss must be the unsharded model's on its group's batch. After summing the non-expert
    gradients over the ep groups, every gradient (natural order, full tensor) must be the unsharded
    model's of the summed losses of all groups' batches, and so must the parameters after AdamW;
    greedy generate from each group's own prompt must give the unsharded model's tokens."""
    tol = TOL[kind]
    unsharded = _model(kind, tp, act=act)
    ours, mesh = _parallelize(copy.deepcopy(unsharded), ep, tp)
    group = mesh.get_local_rank("ep")
    experts = ours.model.layers[0].mlp.experts
    wanted = (Shard(0),) if tp == 1 else (Shard(0), Shard(1))
    assert experts.gate_up_proj.placements == wanted, experts.gate_up_proj.placements
    assert experts.gate_up_proj.to_local().shape == (4 // ep, 64 // tp, 32)
    assert not isinstance(ours.model.layers[0].mlp.gate.weight, DTensor), "the router must stay replicated"
    assert _gated_silu_experts(experts) == (act == "silu"), "the experts run as torch_tp::moe_gated_experts iff SiLU"

    what = f"{kind} at ep {ep} x tp {tp}, rank {dist.get_rank()}"
    expected, got = _forward_both(unsharded, ours, _batch(group), what, tol)
    got.loss.backward()
    _sum_over_ep(ours, mesh)
    expected.loss.backward()
    for other in range(ep):  # the reference's gradients: of the sum of every group's loss
        if other != group:
            ids = _batch(other)
            unsharded(input_ids=ids, labels=ids).loss.backward()
    _assert_grads_then_adamw(ours, unsharded, what, tol)

    prompt = _batch(group, length=5)[:1]  # no eos: every rank runs the same number of steps (collectives)
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        assert torch.equal(ours.generate(prompt, **settings), unsharded.generate(prompt, **settings)), what


@pytest.mark.parametrize("kind, ep, tp", [("mixtral", 2, 1), ("qwen3_moe", 4, 1), ("qwen3_moe", 2, 2),
                                          ("mixtral", 2, 2)])
def test_expert_parallel_layouts(ranks, kind, ep, tp):
    ranks(ep * tp).run(_check_expert_layout, kind, ep, tp, timeout=300)


def test_expert_parallel_runs_other_experts_as_they_are(ranks):
    """GELU experts are not torch_tp::moe_gated_experts' (NOTE [transformers' experts as one op]): the
    module's own forward runs on the received rows, with the same checks."""
    ranks(2).run(_check_expert_layout, "qwen3_moe", 2, 1, "gelu", timeout=300)


def _check_fsdp_beside(split: str):
    """FSDP2 over a dp dim of 2 beside the experts' split over 2 ranks (``split``: "ep" by HF's
    ep_plan, or "tp" by its tp_plan), torchtitan's recipe: the experts fully_shard over dp alone, the
    rest over every rank that holds other tokens, all gradients divided by the number of batches (4
    under ep, 2 under tp). Each rank's loss must be the unsharded model's on its batch, every gradient
    the unsharded one of the mean of the batches' losses, and the parameters after AdamW the unsharded
    model's."""
    from torch.distributed.fsdp import fully_shard

    kind, rank, tol = "qwen3_moe", dist.get_rank(), TOL["qwen3_moe"]
    unsharded = _model(kind, 2)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", split))
    ours = copy.deepcopy(unsharded)
    torch_tp.parallelize_module(ours, mesh[split], ours.ep_plan if split == "ep" else ours.tp_plan)
    for layer in ours.model.layers:
        experts = fully_shard(layer.mlp.experts, mesh=mesh["dp"])
        if split == "ep":  # its gradients sum the tokens of both ep ranks: divide by all 4 batches, not dp's 2
            experts.set_gradient_divide_factor(4.0)
    # The ranks with other tokens: every rank under ep (the ep ranks hold their own batches), dp under tp.
    fully_shard(ours, mesh=mesh._flatten("dp_ep") if split == "ep" else mesh["dp"])

    batch = rank if split == "ep" else mesh.get_local_rank("dp")
    ids = _batch(batch)
    got = ours(input_ids=ids, labels=ids)
    assert_close(got.loss, unsharded(input_ids=ids, labels=ids).loss, f"fsdp2 beside {split}: loss", tol)
    got.loss.backward()
    if split == "tp":  # every batch once: the 4 ranks hold 2 batches, twice each
        for group in range(2):
            ids = _batch(group)
            (unsharded(input_ids=ids, labels=ids).loss / 2).backward()
    else:
        for group in range(4):
            ids = _batch(group)
            (unsharded(input_ids=ids, labels=ids).loss / 4).backward()
    for (name, param), reference in zip(ours.named_parameters(), unsharded.parameters()):
        assert_close(_full_natural(ours, name, param.grad), reference.grad, f"fsdp2 beside {split}: {name}.grad",
                     tol, floor=GRAD_FLOOR)
    for model in (unsharded, ours):
        torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4).step()
    for (name, param), reference in zip(ours.named_parameters(), unsharded.parameters()):
        assert_close(_full_natural(ours, name, param.detach()), reference, f"fsdp2 beside {split}: {name} after AdamW",
                     10 * tol, floor=PARAM_FLOOR)


@pytest.mark.parametrize("split", ["ep", "tp"])
def test_fsdp2_beside_experts(ranks, split):
    ranks(4).run(_check_fsdp_beside, split, timeout=300)


def _dcp_step_and_save(path: str, ep: int, tp: int):
    """Qwen3-MoE at (ep, tp): one AdamW step on each group's batch, then model and optimizer saved
    with DCP (FQN-keyed, torch's get_state_dict); their full state dicts go to ``path``.expected.pt."""
    model, mesh = _parallelize(_model("qwen3_moe", 4), ep, tp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    ids = _batch(mesh.get_local_rank("ep"))
    model(input_ids=ids, labels=ids).loss.backward()
    _sum_over_ep(model, mesh)
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    full_model, full_optim = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    assert tuple(full_model["model.layers.0.mlp.experts.gate_up_proj"].shape) == (4, 64, 32)
    if dist.get_rank() == 0:
        torch.save({"model": full_model, "optim": full_optim}, path + ".expected.pt")


def _dcp_load(path: str, ep: int, tp: int):
    """A model of other weights at (ep, tp), or unsharded (1, 1), loads the checkpoint: its full model
    and optimizer states are bitwise the saved ones."""
    model = _model("qwen3_moe", 4)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(0.5)  # not the saved values
    if ep * tp > 1:
        model, _ = _parallelize(model, ep, tp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    expected = torch.load(path + ".expected.pt", weights_only=False)
    full_model, full_optim = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    what = f"loaded at ep {ep} x tp {tp}"
    assert list(full_model) == list(expected["model"]), what
    for key, value in expected["model"].items():
        assert torch.equal(full_model[key], value), f"{what}: {key}"
    for fqn, states in expected["optim"]["state"].items():
        for key, value in states.items():
            assert torch.equal(full_optim["state"][fqn][key], value), f"{what}: optimizer state {fqn}.{key}"


def test_dcp_across_expert_layouts(ranks, tmp_path):
    """Saved at EP 2 x TP 2, loaded at EP 4, at TP 2 and into the unsharded model."""
    path = str(tmp_path / "ckpt")
    ranks(4).run(_dcp_step_and_save, path, 2, 2, timeout=300)
    for ep, tp in ((4, 1), (1, 2), (1, 1)):
        ranks(ep * tp).run(_dcp_load, path, ep, tp, timeout=300)


class _GroupedExperts(torch.nn.Module):
    """torchtitan's GroupedExperts contract in float64 (its own computes in bfloat16): w1, w3 [E, I, H],
    w2 [E, H, I]; forward(x [N, H] sorted by expert, num_tokens_per_expert [E]) -> [N, H]."""

    def __init__(self, experts: int = 4, hidden: int = 16, intermediate: int = 8):
        super().__init__()
        self.num_experts = experts
        make = torch.nn.Parameter
        self.w1 = make(torch.randn(experts, intermediate, hidden, dtype=torch.float64) / 4)
        self.w2 = make(torch.randn(experts, hidden, intermediate, dtype=torch.float64) / 4)
        self.w3 = make(torch.randn(experts, intermediate, hidden, dtype=torch.float64) / 4)

    def forward(self, x, num_tokens_per_expert):
        rows = x.split(num_tokens_per_expert.tolist())
        return torch.cat([(torch.nn.functional.silu(r @ w1.T) * (r @ w3.T)) @ w2.T
                          for r, w1, w2, w3 in zip(rows, self.w1, self.w2, self.w3)])


def _titan_experts():
    """torchtitan's own GroupedExperts (0.3's config API), or None where torchtitan is not installed
    (a benchmark peer, not a test dependency)."""
    try:
        from torchtitan.models.common.moe import GroupedExperts
    except ImportError:
        return None
    module = GroupedExperts(GroupedExperts.Config(dim=16, hidden_dim=8, num_experts=4))
    for param in module.parameters():
        torch.nn.init.normal_(param, std=0.25)
    return module


def _check_grouped_experts():
    """ExpertParallel on torchtitan's grouped-experts form: each rank's rows (sorted by expert, a
    skewed count with an empty expert; a rank of no rows at 4 ranks) must give the unsharded
    module's outputs on them, and the experts' gradients the sum over the ranks' rows. float64:
    1e-12; torchtitan's own module computes in bfloat16 (its grouped GEMMs cast): 2e-2."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    for unsharded, tol in ((_GroupedExperts(), 1e-12), (_titan_experts(), 2e-2)):
        if unsharded is None:
            continue
        ours = torch_tp.parallelize_module(copy.deepcopy(unsharded), mesh, torch_tp.ExpertParallel())
        assert all(p.placements == (Shard(0),) and p.to_local().shape[0] == 4 // world_size
                   for p in ours.parameters())
        counts = torch.tensor([0, 5, 1, 2]) * (rank + 1) * (rank != 3)  # rank 3 (of 4) has no rows
        dtype = next(unsharded.parameters()).dtype
        x = torch.randn(int(counts.sum()), 16, dtype=dtype, generator=torch.Generator().manual_seed(rank))
        what = f"{type(unsharded).__name__} at {world_size} ranks, rank {rank}"
        expected, got = unsharded(x, counts), ours(x, counts)
        assert_close(got, expected, f"{what}: output", tol)
        expected.pow(2).sum().backward()
        got.pow(2).sum().backward()
        for (name, param), reference in zip(ours.named_parameters(), unsharded.parameters()):
            summed = reference.grad.clone()
            dist.all_reduce(summed)
            assert_close(_full(param.grad), summed, f"{what}: {name}.grad", tol, floor=GRAD_FLOOR)


@pytest.mark.parametrize("world_size", [2, 4])
def test_grouped_experts(ranks, world_size):
    ranks(world_size).run(_check_grouped_experts, timeout=300)


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
