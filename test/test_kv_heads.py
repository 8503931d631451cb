"""Attention with fewer KV heads than ranks: KVHeadColwiseParallel (NOTE [fewer KV heads than ranks]
in torch_tp/parallel/kv_heads.py), against the unsharded model.

- Hugging Face models built from config, parallelized with their own ``tp_plan`` (torch_tp applies
  KVHeadColwiseParallel to k_proj/v_proj where ``colwise`` would split KV heads): Llama with one KV
  head at 2 ranks (MQA) and with 2 KV heads at 4 ranks (GQA, two ranks per head), Qwen2 (q/k/v
  biases) with one KV head at 2 ranks. Logits, loss, gradients, torch's ``clip_grad_norm_`` and an
  AdamW step; greedy ``generate()`` with a KV cache on a left-padded batch (the attention takes a
  mask, so HF's eager and SDPA paths repeat KV heads by ``num_key_value_groups``).
- The example's Llama under torchtitan's sequence-parallel + loss_parallel plan, 1 KV head at 2
  ranks and 2 at 4: ``check_tp_against_reference`` trains it beside the unsharded model.
- DCP: saved at 4 ranks (KV weights Replicate()), loaded at 2 ranks (KV weights Shard(0)) and into
  the unsharded model, model and optimizer state.
- Errors: heads and ranks that cannot be matched, name the module and the sizes.

Tolerances: the HF models run in float64 and are held to TOL = 1e-10 of each tensor's largest
magnitude: the copies add up in other orders (sharded GEMMs, sums over ranks, each KV head's
gradient summed over the ranks sharing it), which costs ~1e-15; a KV head computed from the wrong
rows or a gradient summed over the wrong ranks costs O(1). AdamW (lr 1e-3, eps 1e-4) amplifies a
gradient's roundoff by at most lr / eps = 10. Greedy tokens are compared exactly. The example runs
in float32 under check_tp_against_reference's own rtol (1e-5, explained there). The checkpoint
holds the 4-rank model after a step, within TOL of the unsharded model's step (loading only moves
data).
"""

import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import transformers  # noqa: F401  (a test dependency, pinned in scripts/run_tests.sh; the ranks import from it)

import torch_tp
from _compare import assert_close, assert_error_names
from test_hf_plans import forward_backward_match

TOL = 1e-10
PARAM_FLOOR = 0.1  # parameters after a step are judged against at least this magnitude
GRAD_FLOOR = 1e-12
NEW_TOKENS = 5

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import llama_model  # noqa: E402


def _hf_model(kind: str, kv_heads: int, attention: str = "sdpa", seed: int = 0, heads: int = 0):
    """A float64 *ForCausalLM with ``kv_heads`` KV heads and ``heads`` query heads (0: 2 per rank)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = (LlamaConfig, LlamaForCausalLM) if kind == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    config = config_class(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=128,
                          num_attention_heads=heads or 2 * dist.get_world_size(), num_key_value_heads=kv_heads)
    config._attn_implementation = attention
    torch.manual_seed(seed)  # the same weights on every rank and in every copy
    return model_class(config).double()


def _full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _check_hf_model(kind: str, kv_heads: int, attention: str):
    world_size = dist.get_world_size()
    what = f"{kind}, {kv_heads} KV heads at {world_size} ranks, {attention}"
    mesh = init_device_mesh("cpu", (world_size,))
    unsharded = _hf_model(kind, kv_heads, attention)
    ours = torch_tp.parallelize_module(copy.deepcopy(unsharded), mesh, unsharded.tp_plan)

    for layer in ours.model.layers:
        attn = layer.self_attn
        for proj in (attn.k_proj, attn.v_proj):
            assert type(proj).__name__ == "KVHeadColwiseParallelLinear", what
            assert all(p.placements == (Replicate(),) for p in proj.parameters()), what
        assert attn.q_proj.weight.placements == (Shard(0),), what
        assert attn.num_key_value_groups == 2, f"{what}: num_key_value_groups {attn.num_key_value_groups}"

    torch.manual_seed(1)
    forward_backward_match(ours, unsharded, torch.randint(0, 128, (2, 12)), what)
    for (name, param), reference in zip(ours.named_parameters(), unsharded.parameters()):
        if "k_proj" in name or "v_proj" in name:
            assert param.grad.placements == (Replicate(),), f"{what}: {name}.grad is {param.grad.placements}"
        assert_close(_full(param.grad), reference.grad, f"{what}: {name}.grad", TOL, floor=GRAD_FLOOR)

    # The global gradient norm counts every KV head once. (torch's clip_grad_norm_ refuses this
    # plan's mix of DTensor and plain parameters, the norms HF's plan leaves alone, under torch's
    # TP too; the example's test below runs it on an all-DTensor model.)
    want = torch.nn.utils.clip_grad_norm_(unsharded.parameters(), 1e-3)
    total = torch_tp.clip_grad_norm_(ours.parameters(), 1e-3)
    assert_close(_full(total), want, f"{what}: clip_grad_norm_'s total norm", TOL)

    for model in (unsharded, ours):
        torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4).step()
    for (name, param), reference in zip(ours.named_parameters(), unsharded.parameters()):
        assert_close(_full(param.detach()), reference.detach(), f"{what}: {name} after AdamW", TOL,
                     floor=PARAM_FLOOR)

    # Eager attention repeats KV heads by num_key_value_groups; SDPA does too when it gets a mask,
    # which a left-padded batch gives it. (Not eager with padding: HF's eager attention turns a
    # fully masked padding row into NaNs, unsharded too.) The cache holds this rank's KV heads.
    prompt = torch.randint(1, 128, (2, 7))
    mask = torch.ones_like(prompt)
    if attention == "sdpa":
        mask[1, :3] = 0
    with torch.no_grad():
        runs = [model.generate(prompt, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                               return_dict_in_generate=True, output_scores=True, pad_token_id=0)
                for model in (unsharded, ours)]
    assert torch.equal(runs[1].sequences, runs[0].sequences), f"{what}: generated tokens"
    for step, (a, b) in enumerate(zip(runs[1].scores, runs[0].scores)):
        assert_close(a, b, f"{what}: scores of new token {step}", TOL)


@pytest.mark.parametrize("kind, kv_heads, world_size, attention", [
    ("llama", 1, 2, "sdpa"), ("llama", 1, 2, "eager"), ("llama", 2, 4, "sdpa"), ("qwen2", 1, 2, "eager")])
def test_hf_model_plan(ranks, kind, kv_heads, world_size, attention):
    ranks(world_size).run(_check_hf_model, kind, kv_heads, attention, timeout=300)


def _check_example_model(kv_heads: int):
    config = llama_model.LlamaConfig(vocab_size=67, dim=64, n_layers=2, n_heads=4, n_kv_heads=kv_heads,
                                     max_seq_len=32)
    losses = llama_model.check_tp_against_reference(api="torch_tp", config=config, steps=3)
    assert len(losses) == 3

    # torch's clip_grad_norm_ on the DTensor gradients: one mesh, every KV head counted once.
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    reference = llama_model.Llama(config)
    ours = torch_tp.parallelize_module(copy.deepcopy(reference), mesh,
                                       llama_model.tp_plan(torch_tp, n_kv_heads=kv_heads))
    tokens = torch.randint(0, config.vocab_size, (2, 33))
    llama_model.cross_entropy_loss(reference(tokens[:, :-1]), tokens[:, 1:]).backward()
    with torch_tp.loss_parallel():
        llama_model.cross_entropy_loss(ours(tokens[:, :-1]), tokens[:, 1:]).backward()
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3)
    total = torch.nn.utils.clip_grad_norm_(ours.parameters(), 1e-3)
    assert abs(_full(total).item() - want.item()) <= 1e-5 * want.item(), (total, want)


@pytest.mark.parametrize("kv_heads, world_size", [(1, 2), (2, 4)])
def test_example_model_under_sequence_parallel_plan(ranks, kv_heads, world_size):
    ranks(world_size).run(_check_example_model, kv_heads, timeout=300)


def _trained(model):
    """``model`` after one AdamW step on a fixed batch, with its optimizer."""
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    optimizer.step()
    optimizer.zero_grad()
    return optimizer


def _dcp_save(path: str):
    """2 KV heads at 4 ranks (each head on two ranks, Replicate() KV weights), trained a step, saved."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _hf_model("llama", 2, heads=8)
    model = torch_tp.parallelize_module(model, mesh, model.tp_plan)
    assert model.model.layers[0].self_attn.k_proj.weight.placements == (Replicate(),)
    optimizer = _trained(model)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def _dcp_load(path: str, parallel: bool):
    """Load into other weights: at this world size (2 KV heads: Shard(0) at 2 ranks), or unsharded.
    The model and the optimizer state must be the unsharded model's after the same step."""
    reference = _hf_model("llama", 2, heads=8)
    reference_opt = _trained(reference)
    model = _hf_model("llama", 2, seed=1, heads=8)
    if parallel:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model = torch_tp.parallelize_module(model, mesh, model.tp_plan)
        assert model.model.layers[0].self_attn.k_proj.weight.placements == (Shard(0),)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    for (name, param), want in zip(model.named_parameters(), reference.parameters()):
        assert_close(_full(param.detach()), want.detach(), f"{name} loaded", TOL, floor=PARAM_FLOOR)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(_full(optimizer.state[param][key]), reference_opt.state[want][key], f"{name}: {key} loaded",
                         TOL, floor=GRAD_FLOOR)


def test_dcp_reshards_replicated_kv_heads(ranks, tmp_path):
    path = str(tmp_path / "kv")
    ranks(4).run(_dcp_save, path, timeout=300)
    ranks(2).run(_dcp_load, path, True, timeout=300)
    ranks(1).run(_dcp_load, path, False, timeout=300)


def _check_errors():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # 4 ranks
    model = nn.Module()
    model.k = nn.Linear(8, 3 * 4)
    assert_error_names(lambda: torch_tp.parallelize_module(model, mesh, {"k": torch_tp.KVHeadColwiseParallel(3)}),
                       ["KVHeadColwiseParallel", "'k'", "3 KV heads", "4 ranks"], ValueError)
    model.k = nn.Linear(8, 10)
    assert_error_names(lambda: torch_tp.parallelize_module(model, mesh, {"k": torch_tp.KVHeadColwiseParallel(4)}),
                       ["KVHeadColwiseParallel", "'k'", "out_features=10", "num_kv_heads=4"], ValueError)
    assert_error_names(lambda: torch_tp.KVHeadColwiseParallel(0), ["KVHeadColwiseParallel", "num_kv_heads", "0"],
                       ValueError)

    from transformers import LlamaConfig, LlamaForCausalLM

    def hf_model(queries, kv_heads):
        return LlamaForCausalLM(LlamaConfig(hidden_size=48, intermediate_size=64, num_hidden_layers=1, vocab_size=32,
                                            num_attention_heads=queries, num_key_value_heads=kv_heads))

    odd_queries = hf_model(6, 2)
    assert_error_names(lambda: torch_tp.parallelize_module(odd_queries, mesh, odd_queries.tp_plan),
                       ["model.layers.0.self_attn.q_proj", "num_attention_heads=6", "4 ranks"], ValueError)
    odd_kv = hf_model(12, 3)
    assert_error_names(lambda: torch_tp.parallelize_module(odd_kv, mesh, odd_kv.tp_plan),
                       ["model.layers.0.self_attn.k_proj", "3 KV heads", "4 ranks"], ValueError)


def test_errors(ranks):
    ranks(4).run(_check_errors, timeout=300)


def _check_compiled():
    """torchtitan's recipe, every block compiled (inductor, fullgraph), with one KV head over 2 ranks:
    the same loss and KV gradients as the unsharded model. (Every rank's compiled backward must issue
    its collectives in one order; a KV projection that backpropagated into the gathered input through
    rank-dependent code once made them differ, and the ranks waited on each other forever.)"""
    config = llama_model.LlamaConfig(vocab_size=67, dim=64, n_layers=2, n_heads=4, n_kv_heads=1, max_seq_len=32)
    torch.manual_seed(0)
    reference = llama_model.Llama(config)
    ours = torch_tp.parallelize_module(copy.deepcopy(reference), init_device_mesh("cpu", (dist.get_world_size(),)),
                                       llama_model.tp_plan(torch_tp, n_kv_heads=1))
    for block in ours.layers.values():
        block.compile(fullgraph=True)
    tokens = torch.randint(0, config.vocab_size, (2, 33))
    with torch_tp.loss_parallel():
        loss = llama_model.cross_entropy_loss(ours(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
    want = llama_model.cross_entropy_loss(reference(tokens[:, :-1]), tokens[:, 1:])
    want.backward()
    # float32: the sharded GEMMs and sums add up in other orders (~1e-7 relative, see llama_model's rtol).
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item()), (loss.item(), want.item())
    for name in ("wk", "wv"):
        got = getattr(ours.layers["0"].attention, name).weight.grad
        expected = getattr(reference.layers["0"].attention, name).weight.grad
        assert_close(_full(got), expected, f"compiled: layers.0.attention.{name}.weight.grad", 1e-4)


def test_compiled_blocks(ranks):
    ranks(2).run(_check_compiled, timeout=300)
