"""Hugging Face transformers models parallelized with their own plans: ``parallelize_module(model, mesh,
model.tp_plan)``.

Small Llama (GQA) and Qwen3 (per-head q_norm/k_norm: replicated_with_grad_allreduce; also with
tied embeddings) models are built from config (no downloads) in float64. Three copies start from
the same weights: the unsharded model, torch_tp's, and HF's own tensor parallelism
(transformers' ``apply_tensor_parallelism`` with the same plan: its DTensor styles, which run on
CPU with gloo; not for the tied model, which it cannot take).
All three take the same batch with labels; the logits, the loss, the gradients (gathered) and
the parameters after one AdamW step must agree. The strings the models' plans do not use are
compared with HF's style objects on single modules, and the strings torch_tp refuses must name
the module and the string.

Tolerance: float64, 1e-10 relative to each tensor's largest magnitude. The copies sum in
different orders (sharded GEMMs, reductions over ranks), which costs ~1e-15; a sharding mistake
costs O(1). AdamW (lr 1e-3, eps 1e-4) moves a weight by about lr * g / (|g| + eps), amplifying
a gradient's roundoff by at most lr / eps = 10.
"""

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import transformers  # noqa: F401  (a test dependency, pinned in scripts/run_tests.sh; the ranks import from it)

import torch_tp
from _compare import assert_close, assert_error_names

TOL = 1e-10
# Parameters after a step are judged against at least this magnitude (an RMSNorm weight is 1,
# a projection's entries ~0.02); gradients against this (only an all-zero one needs it).
PARAM_FLOOR = 0.1
GRAD_FLOOR = 1e-12


def _model(kind: str, world_size: int, layers: int = 2):
    """A small float64 *ForCausalLM with two query heads and one KV head per rank; ``qwen3_tied``
    shares the input embedding with lm_head; ``apertus`` has an activation with parameters."""
    from transformers import (ApertusConfig, ApertusForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, vocab_size=128,
                 num_attention_heads=2 * world_size, num_key_value_heads=world_size)
    torch.manual_seed(0)  # the same weights on every rank and in every copy
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**sizes))
    elif kind == "apertus":  # its MLP's xIELU activation has two parameters, alpha_p and alpha_n
        model = ApertusForCausalLM(ApertusConfig(head_dim=16, **sizes))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, tie_word_embeddings=kind == "qwen3_tied", **sizes))
    return model.double()


def _hf_parallelize(model, mesh):
    """HF's own tensor parallelism with the model's plan: what ``from_pretrained(tp_plan="auto")``
    applies, with the plan's wildcards resolved to module and parameter names as it resolves them."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    return apply_tensor_parallelism(model, mesh, model._expand_parallel_plan(model.tp_plan))


def _full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


# The placements HF's plans give (torch_tp's must be the same), by the module's name; and act_fn's,
# which HF's plans leave out (NOTE [an MLP activation's parameters] in hf_plan.py).
_PLACEMENTS = {"q_proj": Shard(0), "k_proj": Shard(0), "v_proj": Shard(0), "gate_proj": Shard(0), "up_proj": Shard(0),
               "lm_head": Shard(0), "embed_tokens": Shard(0), "o_proj": Shard(1), "down_proj": Shard(1),
               "q_norm": Replicate(), "k_norm": Replicate(), "act_fn": Replicate()}


def forward_backward_match(ours, unsharded, ids, what: str) -> None:
    """Both models on the batch ``ids`` with labels: the same logits and loss; then both backward."""
    expected, got = unsharded(input_ids=ids, labels=ids), ours(input_ids=ids, labels=ids)
    assert_close(got.logits, expected.logits, f"{what}: logits", TOL)
    assert_close(got.loss, expected.loss, f"{what}: loss", TOL)
    expected.loss.backward()
    got.loss.backward()


def _check_model(kind: str):
    world_size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    unsharded = _model(kind, world_size)
    ours = torch_tp.parallelize_module(copy.deepcopy(unsharded), mesh, unsharded.tp_plan)
    copies = {"unsharded": unsharded, "torch_tp": ours}
    if unsharded.config.tie_word_embeddings:
        # Still tied (NOTE [tied weights under a Hugging Face plan] in api.py). HF's
        # apply_tensor_parallelism looks the planned parameters up by name and fails on the tied
        # lm_head.weight, which named_parameters() does not list: no HF copy here.
        assert ours.lm_head.weight is ours.model.embed_tokens.weight, f"{kind}: the tie was not kept"
    elif kind != "apertus":  # HF's own TP leaves xIELU's gradients this rank's part only
        copies["hf"] = _hf_parallelize(copy.deepcopy(unsharded), mesh)
    sharded = [name for name in copies if name != "unsharded"]

    for name, param in ours.named_parameters():
        module_name = name.rsplit(".", 2)[-2]
        wanted = _PLACEMENTS.get(module_name)
        placements = param.placements if isinstance(param, DTensor) else None
        assert placements == (None if wanted is None else (wanted,)), f"{kind}: {name} is {placements}"

    torch.manual_seed(1)
    ids = torch.randint(0, unsharded.config.vocab_size, (2, 12))
    outputs = {}
    for name, model in copies.items():
        outputs[name] = model(input_ids=ids, labels=ids)
        outputs[name].loss.backward()
    for name in sharded:
        what = f"{kind} at {world_size} ranks, {name}"
        assert_close(outputs[name].logits, outputs["unsharded"].logits, f"{what}: logits", TOL)
        assert_close(outputs[name].loss, outputs["unsharded"].loss, f"{what}: loss", TOL)
        for (param_name, param), expected in zip(copies[name].named_parameters(), unsharded.parameters()):
            assert_close(_full(param.grad), expected.grad, f"{what}: {param_name}.grad", TOL, floor=GRAD_FLOOR)

    # replicated_with_grad_allreduce: complete (all-reduced) gradients, left Replicate.
    for name, param in ours.named_parameters():
        if (name.endswith("_norm.weight") and "self_attn" in name) or ".act_fn." in name:
            assert param.grad.placements == (Replicate(),), f"{kind}: {name}.grad is {param.grad.placements}"

    for model in copies.values():
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
        optimizer.step()
    for name in sharded:
        for (param_name, param), expected in zip(copies[name].named_parameters(), unsharded.parameters()):
            assert_close(_full(param.detach()), expected.detach(), f"{kind} at {world_size} ranks, {name}: "
                         f"{param_name} after AdamW", TOL, floor=PARAM_FLOOR)


@pytest.mark.parametrize("kind, world_size", [("llama", 2), ("qwen3", 2), ("qwen3_tied", 2), ("qwen3", 4),
                                              ("apertus", 2)])
def test_model_plan(ranks, kind, world_size):
    ranks(world_size).run(_check_model, kind, timeout=300)


def _natural(module: nn.Module, name: str, rank_major: torch.Tensor) -> torch.Tensor:
    """A packed parameter's full_tensor() (its rows in rank-major order) in the fused weight's own order."""
    layout = module._tp_state.layouts[name]
    return rank_major.index_select(layout.dim, layout.rank_major_index(rank_major.device).argsort())


def _against_hf_style(string: str, module: nn.Module, x: torch.Tensor):
    """``module`` under the plan string ``string``, torch_tp's and HF's style object for it: the
    same output, input gradient and parameter gradients (gathered). ``x`` is this rank's input."""
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ours = torch_tp.parallelize_module(copy.deepcopy(module), mesh, string)
    theirs = copy.deepcopy(module)
    style = ALL_PARALLEL_STYLES[string]
    for name, _ in list(theirs.named_parameters()):
        style.shard_param(theirs, name, mesh)
    style.install_forward(theirs, mesh)
    results = []
    for model in (ours, theirs):
        x_ = x.detach().clone().requires_grad_(x.is_floating_point())
        out = model(x_)
        # A weight per output entry, so that each entry's gradient differs.
        out.mul(torch.arange(out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads = [_full(p.grad) for p in model.parameters()]
        if model is ours and string.startswith("packed_"):  # the fused weight's own order, as HF's holds it
            modules = dict(ours.named_modules())
            grads = [_natural(modules[""], name, grad) for (name, _), grad in zip(ours.named_parameters(), grads)]
        results.append((out, x_.grad, grads))
    (out, x_grad, grads), (out_hf, x_grad_hf, grads_hf) = results
    assert_close(out, out_hf, f"{string}: output", TOL)
    if x.is_floating_point():
        assert_close(x_grad, x_grad_hf, f"{string}: input gradient", TOL)
    for (name, _), grad, grad_hf in zip(module.named_parameters(), grads, grads_hf):
        assert_close(grad, grad_hf, f"{string}: {name}.grad", TOL, floor=GRAD_FLOOR)


def _check_single_modules():
    rank = dist.get_rank()
    torch.manual_seed(0)
    linear = nn.Linear(12, 8).double()
    x = torch.randn(3, 5, 12, dtype=torch.float64)
    for string in ("colwise", "colwise_gather_output", "rowwise_split_input"):
        _against_hf_style(string, linear, x)
    # HF's packed_colwise shards the bias of a fused [gate | up] Linear as one block (Shard(-1)) while
    # its weight is sharded per block (_StridedShard), so its output is only right without a bias.
    _against_hf_style("packed_colwise", nn.Linear(12, 8, bias=False).double(), x)
    # rowwise takes this rank's slice of the input features; all_reduce sums per-rank outputs.
    _against_hf_style("rowwise", linear, x.chunk(dist.get_world_size(), -1)[rank])
    _against_hf_style("all_reduce", linear, x + rank)
    embedding = nn.Embedding(20, 8).double()
    ids = torch.randint(0, 20, (3, 5))
    for string in ("embedding_rowwise", "embedding_colwise"):
        _against_hf_style(string, embedding, ids)
    # sequence_parallel: this rank's shard of the sequence through a norm with a weight.
    norm = nn.LayerNorm(12).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    _against_hf_style("sequence_parallel", norm, x.chunk(dist.get_world_size(), 1)[rank])
    # replicate: nothing changes.
    kept = torch_tp.parallelize_module(copy.deepcopy(linear), init_device_mesh("cpu", (dist.get_world_size(),)),
                                       "replicate")
    assert type(kept) is nn.Linear and not isinstance(kept.weight, DTensor)


def test_single_module_strings(ranks):
    ranks(2).run(_check_single_modules, timeout=300)


def _check_refused():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def parallelize(plan):
        return lambda: torch_tp.parallelize_module(_model("llama", dist.get_world_size(), layers=1), mesh, plan)

    # Unknown and unimplemented strings are refused with their plan key before anything is parallelized.
    assert_error_names(parallelize({"model.layers.*.mlp.up_proj": "colwsie"}),
                       ["'model.layers.*.mlp.up_proj'", "'colwsie'"], ValueError)
    assert_error_names(parallelize({"model.layers.*.mlp": "moe_identity_expert"}),
                       ["'model.layers.*.mlp'", "'moe_identity_expert'", "does not implement"], NotImplementedError)
    assert_error_names(parallelize({"model.layers.*.self_attn": "mla_kv_a_proj"}),
                       ["'model.layers.*.self_attn'", "'mla_kv_a_proj'"], NotImplementedError)
    model = _model("llama", dist.get_world_size(), layers=1)
    plan = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers": {"*.mlp": "ep_router_dispatch"}}
    assert_error_names(lambda: torch_tp.parallelize_module(model, mesh, plan),
                       ["'model.layers.*.mlp'", "'ep_router_dispatch'"], ValueError)
    assert not any(isinstance(p, DTensor) for p in model.parameters()), "a refused plan changed the model"
    assert_error_names(parallelize({"model.embed_tokens": "packed_colwise"}),
                       ["'model.embed_tokens'", "'packed_colwise'", "Linear"], ValueError)
    # A linear style on an embedding; a key naming a parameter, not a module.
    assert_error_names(parallelize({"model.embed_tokens": "colwise"}),
                       ["'model.embed_tokens'", "'colwise'", "Linear"], ValueError)
    assert_error_names(parallelize({"model.layers.*.mlp.up_proj.weight": "colwise"}),
                       ["'model.layers.0.mlp.up_proj.weight'", "'colwise'"], NotImplementedError)


def test_refused_strings(ranks):
    ranks(2).run(_check_refused)


def _check_ties():
    """A tie is kept where an HF plan gives both modules one layout, warned about where it does not;
    torch's styles shard the two modules separately, as torch's parallelize_module does."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    hf_rows = {"model.embed_tokens": "embedding_rowwise", "lm_head": "colwise_gather_output"}
    hf_columns = {"model.embed_tokens": "embedding_colwise", "lm_head": "colwise_gather_output"}
    torch_styles = {"model.embed_tokens": torch_tp.RowwiseParallel(input_layouts=Replicate()),
                    "lm_head": torch_tp.ColwiseParallel(output_layouts=Replicate())}
    for plan, tied in ((hf_rows, True), (hf_columns, False), (torch_styles, False)):
        model = _model("qwen3_tied", dist.get_world_size(), layers=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch_tp.parallelize_module(model, mesh, plan)
        embedding, head = model.model.embed_tokens.weight, model.lm_head.weight
        assert (embedding is head) == tied, f"{plan}: tied {embedding is head}"
        messages = [str(w.message) for w in caught if "tied weights" in str(w.message)]
        if plan is hf_columns:  # Shard(1) against Shard(0)
            assert len(messages) == 1 and "'model.embed_tokens.weight' ((Shard(dim=1),))" in messages[0] \
                and "'lm_head.weight' ((Shard(dim=0),))" in messages[0], messages
        else:
            assert messages == [], messages


def test_tied_weights(ranks):
    ranks(2).run(_check_ties)


# ---------------------------------------------------------------- Phi3's fused projections, block by block


def _phi3(seed: int = 0, kv_heads: int = 4):
    """A float64 Phi3 (fused qkv_proj [q | k | v] with 8 query and ``kv_heads`` KV heads of 8, fused
    gate_up_proj)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    config = Phi3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=128,
                        num_attention_heads=8, num_key_value_heads=kv_heads, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2)
    return Phi3ForCausalLM(config).double()


def _rank_major(module: nn.Module, name: str, natural: torch.Tensor) -> torch.Tensor:
    """An unsharded tensor in the row order of a packed parameter's full_tensor()."""
    layout = module._tp_state.layouts[name]
    return natural.index_select(layout.dim, layout.rank_major_index(natural.device))


def _check_phi3_packed(kv_heads):
    """With fewer KV heads than ranks, each rank computes the one its query heads read (NOTE [a packed
    qkv with fewer KV heads than ranks]); it stores its chunk of every block all the same."""
    world_size = dist.get_world_size()
    what = f"phi3 block-wise with {kv_heads} KV heads at {world_size} ranks"
    mesh = init_device_mesh("cpu", (world_size,))
    unsharded = _phi3(kv_heads=kv_heads)
    plan = torch_tp.parallel.packed_tp_plan(unsharded)
    ours = torch_tp.parallelize_module(copy.deepcopy(unsharded), mesh, plan)
    attention = ours.model.layers[0].self_attn
    # Each rank holds its chunk of every block: (8 + 2 kv_heads) heads x 8 rows / world_size.
    assert attention.qkv_proj.weight.to_local().shape == ((8 + 2 * kv_heads) * 8 // world_size, 64), what
    assert attention.o_proj.weight.placements == (Shard(1),), what
    local_kv_heads = max(kv_heads // world_size, 1)
    assert attention.config.num_attention_heads == 8 // world_size, what
    assert attention.num_key_value_heads == local_kv_heads, what
    assert attention.num_key_value_groups == 8 // world_size // local_kv_heads, what

    torch.manual_seed(1)
    forward_backward_match(ours, unsharded, torch.randint(3, 128, (2, 12)), what)
    modules = dict(ours.named_modules())
    for (name, param), reference in zip(ours.named_parameters(), unsharded.parameters()):
        module_name, _, param_name = name.rpartition(".")
        want = reference.grad
        if name.endswith(("qkv_proj.weight", "gate_up_proj.weight")):
            want = _rank_major(modules[module_name], param_name, want)
        assert_close(_full(param.grad), want, f"{what}: {name}.grad", TOL, floor=GRAD_FLOOR)

    for model in (unsharded, ours):
        torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4).step()
    # The state dict holds the fused weights in their own order, as the unsharded model's.
    full = torch_tp.get_full_state_dict(ours)
    for key, want in unsharded.state_dict().items():
        assert_close(full[key], want, f"{what}: state dict {key} after AdamW", TOL, floor=PARAM_FLOOR)

    prompt = torch.randint(3, 128, (1, 6))
    with torch.no_grad():
        runs = [model.generate(prompt, max_new_tokens=5, do_sample=False) for model in (unsharded, ours)]
    assert torch.equal(runs[1], runs[0]), f"{what}: generated tokens"


@pytest.mark.parametrize("world_size, kv_heads", [(2, 4), (4, 4), (2, 1), (4, 2)])
def test_phi3_fused_projections_block_wise(ranks, world_size, kv_heads):
    ranks(world_size).run(_check_phi3_packed, kv_heads, timeout=300)


def _phi3_parallel(impl: str, seed: int, kv_heads: int = 4):
    """Phi3 parallelized by torch_tp's block-wise plan, or by torch's TP with HF's plan's meaning
    (fused outputs gathered: Shard(0) fused weights in their own order)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _phi3(seed, kv_heads)
    if impl == "torch_tp":
        return torch_tp.parallelize_module(model, mesh, torch_tp.parallel.packed_tp_plan(model))
    gathered, split = ColwiseParallel(output_layouts=Replicate()), RowwiseParallel(input_layouts=Replicate())
    return parallelize_module(model, mesh, {"model.layers.*.self_attn.qkv_proj": gathered,
                                            "model.layers.*.self_attn.o_proj": split,
                                            "model.layers.*.mlp.gate_up_proj": gathered,
                                            "model.layers.*.mlp.down_proj": split})


def _phi3_dcp_save(path: str, kv_heads: int):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = _phi3_parallel("torch_tp", 0, kv_heads)
    torch.manual_seed(1)
    ids = torch.randint(3, 128, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4).step()
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    full = torch_tp.get_full_state_dict(model, rank0_only=True)
    if dist.get_rank() == 0:
        torch.save(full, path + ".full.pt")


def _phi3_dcp_load(path: str, impl: str, kv_heads: int):
    """Load into a model of other weights: torch_tp's or torch's TP at this world size, or unsharded."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = _phi3(1, kv_heads) if impl == "unsharded" else _phi3_parallel(impl, 1, kv_heads)
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state)
    saved = torch.load(path + ".full.pt")
    full = torch_tp.get_full_state_dict(model)
    assert list(full) == list(saved)
    for key, want in saved.items():
        assert torch.equal(full[key], want), f"{impl} at {dist.get_world_size()} ranks: {key}"


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_phi3_dcp_reshards_fused_weights(ranks, tmp_path, kv_heads):
    """Saved block-wise at 2 ranks; loaded block-wise at 4, by torch's TP at 4, and unsharded. With 1 KV
    head, 2 and then 4 ranks share it."""
    path = str(tmp_path / "phi3")
    ranks(2).run(_phi3_dcp_save, path, kv_heads, timeout=300)
    ranks(4).run(_phi3_dcp_load, path, "torch_tp", kv_heads, timeout=300)
    ranks(4).run(_phi3_dcp_load, path, "torch", kv_heads, timeout=300)
    ranks(1).run(_phi3_dcp_load, path, "unsharded", kv_heads, timeout=300)
