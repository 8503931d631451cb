"""Greedy ``generate()`` with a KV cache under training plans: ``torch_tp.parallel.generation_layouts``.

A small float64 HF Llama (built from config, no downloads) is parallelized at 2 ranks with

* ``sp``: torchtitan's sequence-parallel plan on HF's module names, with ``loss_parallel``
  logits (the lm_head's ``Shard(-1)`` DTensor);
* ``plain``: the model's own HF plan with ``lm_head`` giving ``Shard(-1)`` DTensor logits.

Under each, a training step (loss under ``loss_parallel``, gradients) must give the unsharded
model's numbers, unchanged by generation; and greedy generation inside ``generation_layouts``
must give exactly the unsharded model's tokens and, to float64 roundoff, its scores. The prompts
have 7 tokens (not divisible by 2), 1 token, and 4 tokens; every step after the first is a
1-token decode step against the KV cache. NOTE [generating under a sequence-parallel or
loss_parallel plan] in torch_tp/parallel/generation.py.

Tolerance: 1e-10 relative to each tensor's largest magnitude, as in test_hf_plans.py.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import transformers  # noqa: F401  (a test dependency, pinned in scripts/run_tests.sh; the ranks import from it)

import torch_tp
from _compare import assert_close, assert_error_names
from torch_tp import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

TOL = 1e-10
# Hugging Face's causal-LM loss casts the logits to float32; the vocab split reorders its sums
# (test_loss_parallel.py's float32 tolerance against the unsharded loss).
TOL_FLOAT32_LOSS = 1e-5
NEW_TOKENS = 5


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the same weights on every rank and in both copies
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=128,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).double()


def _sp_plan():
    """torchtitan's Llama plan (sequence parallel, loss_parallel logits) on HF's module names."""
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "model.layers.*.input_layernorm": SequenceParallel(),
        "model.layers.*.post_attention_layernorm": SequenceParallel(),
        "model.layers.*.self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                       desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "model.layers.*.self_attn.[qkv]_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "model.layers.*.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
    }


def _full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _training_step(kind, ours, unsharded, ids):
    """Loss (under loss_parallel for ours) and gradients, compared with the unsharded model's."""
    # HF takes positions from its input embedding, which under the SP plan is this rank's
    # sequence shard: a sequence-parallel forward passes them, as torchtitan's does.
    positions = torch.arange(ids.size(1)).unsqueeze(0)
    logits = ours(input_ids=ids, position_ids=positions).logits
    assert isinstance(logits, DTensor) and logits.placements == (Shard(2),), f"{kind}: logits {type(logits)}"
    with torch_tp.loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
        loss.backward()
    expected_logits = unsharded(input_ids=ids).logits
    expected = F.cross_entropy(expected_logits.flatten(0, 1), ids.flatten())
    expected.backward()
    assert_close(logits.full_tensor(), expected_logits, f"{kind}: logits", TOL)
    assert_close(loss, expected, f"{kind}: loss", TOL)
    for (name, param), reference in zip(ours.named_parameters(), unsharded.parameters()):
        assert_close(_full(param.grad), reference.grad, f"{kind}: {name}.grad", TOL, floor=1e-12)
    for model in (ours, unsharded):
        model.zero_grad()
    # The model's own loss (labels=): Hugging Face's causal-LM loss reshapes the logits
    # (.float(), .view(-1, V)) and calls F.cross_entropy, all on the DTensor logits.
    with torch_tp.loss_parallel():
        loss = ours(input_ids=ids, position_ids=positions, labels=ids).loss
        loss.backward()
    expected = unsharded(input_ids=ids, labels=ids).loss
    expected.backward()
    assert_close(loss, expected, f"{kind}: the model's own loss", TOL_FLOAT32_LOSS)
    for (name, param), reference in zip(ours.named_parameters(), unsharded.parameters()):
        assert_close(_full(param.grad), reference.grad, f"{kind}: {name}.grad (the model's own loss)",
                     TOL_FLOAT32_LOSS, floor=1e-12)
    for model in (ours, unsharded):
        model.zero_grad()


def _check_generation(kind):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    unsharded = _model()
    ours = copy.deepcopy(unsharded)
    plan = _sp_plan() if kind == "sp" else dict(unsharded.tp_plan, lm_head=ColwiseParallel(use_local_output=False))
    torch_tp.parallelize_module(ours, mesh, plan)

    torch.manual_seed(1)
    train_ids = torch.randint(0, 128, (2, 12))
    _training_step(kind, ours, unsharded, train_ids)

    for prompt in (torch.randint(0, 128, (2, 7)), torch.randint(0, 128, (1, 1)), torch.randint(0, 128, (3, 4))):
        what = f"{kind}: prompt {tuple(prompt.shape)}"
        settings = dict(attention_mask=torch.ones_like(prompt), pad_token_id=0, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True,
                        output_scores=True, return_dict_in_generate=True)
        expected = unsharded.generate(prompt, **settings)
        with torch_tp.parallel.generation_layouts(ours) as model:
            got = model.generate(prompt, **settings)
        assert torch.equal(got.sequences, expected.sequences), f"{what}: {got.sequences} != {expected.sequences}"
        assert len(got.scores) == NEW_TOKENS
        for step, (score, reference) in enumerate(zip(got.scores, expected.scores)):
            # min_new_tokens gives the end-of-sequence token a score of -inf until the last step.
            masked = torch.isinf(reference)
            assert torch.equal(torch.isinf(score), masked), f"{what}: -inf scores of step {step}"
            assert_close(score.masked_fill(masked, 0), reference.masked_fill(masked, 0),
                         f"{what}: scores of step {step}", TOL)

    # Outside the block the plan is the training plan again, with the same numbers.
    _training_step(kind, ours, unsharded, train_ids)

    if kind == "sp":
        with torch_tp.parallel.generation_layouts(ours):
            assert_error_names(lambda: ours(input_ids=train_ids), ["generation_layouts()", "torch.no_grad()"])


@pytest.mark.parametrize("kind", ["sp", "plain"])
def test_generate_under_training_plan(ranks, kind):
    ranks(2).run(_check_generation, kind, timeout=300)


def _check_refuses_unparallelized():
    assert_error_names(lambda: torch_tp.parallel.generation_layouts(torch.nn.Linear(2, 2)).__enter__(),
                       ["generation_layouts", "Linear", "parallelize_module"], ValueError)


def test_refuses_unparallelized_model(ranks):
    ranks(2).run(_check_refuses_unparallelized)
