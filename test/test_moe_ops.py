"""The expert-parallel token exchange ops, at 1, 2 and 4 ranks, against single-process references.

``all_to_all_single`` is compared with ``torch.distributed.all_to_all_single`` (uneven and empty
splits), its gradient with the reverse exchange of the upstream gradient. ``moe_token_dispatch`` and
``moe_token_combine`` run a toy expert layer (expert e: ``x @ W_e^T``, every rank holding the whole
``W`` for the reference, its own experts' rows for the op) with a skewed router: every token's first
choice is expert 0, and at 4 ranks rank 1 has no tokens at all. The output, and the gradients of the
hidden states, of the routing weights and of ``W``, must equal the unsharded layer's; ``W``'s
gradient rows of this rank's experts sum over every rank's tokens (the all-reduce of the
references). ``moe_combine(moe_dispatch(x))`` gives ``x`` back exactly (only moves).

Tolerance: float64, 1e-12 of each tensor's largest magnitude: the exchange only moves rows, so the
only differences are the order of the K-term weighted sums and of the gradient sums over ranks.
"""

import pytest
import torch
import torch.distributed as dist

import torch_tp
from _compare import assert_close, assert_error_names

TOL = 1e-12
EXPERTS, HIDDEN, TOP_K = 4, 6, 2


def _check_all_to_all():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    input_splits = [(rank + peer) % 3 for peer in range(world_size)]  # some zero
    output_splits = [(peer + rank) % 3 for peer in range(world_size)]
    x = torch.randn(sum(input_splits), 3, dtype=torch.float64, requires_grad=True)
    out = torch_tp.ops.all_to_all_single(x, output_splits, input_splits, group)
    expected = torch.empty(sum(output_splits), 3, dtype=torch.float64)
    dist.all_to_all_single(expected, x.detach(), output_splits, input_splits)
    assert torch.equal(out, expected), f"rank {rank}: all_to_all_single"
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    expected_grad = torch.empty_like(x)
    dist.all_to_all_single(expected_grad, grad_out, input_splits, output_splits)
    assert torch.equal(x.grad, expected_grad), f"rank {rank}: all_to_all_single backward"


def _check_token_exchange():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    local = EXPERTS // world_size
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(EXPERTS, HIDDEN, HIDDEN, dtype=torch.float64, generator=gen)  # the same on every rank
    gen.manual_seed(1 + rank)
    tokens = 0 if (world_size == 4 and rank == 1) else 3 + 2 * rank
    hidden = torch.randn(tokens, HIDDEN, dtype=torch.float64, generator=gen)
    index = torch.stack([torch.zeros(tokens, dtype=torch.long),
                         torch.randint(1, EXPERTS, (tokens,), generator=gen)], dim=1)  # first choice: expert 0
    scores = torch.rand(tokens, TOP_K, dtype=torch.float64, generator=gen)

    ref_hidden, ref_scores, ref_weight = (t.clone().requires_grad_() for t in (hidden, scores, weight))
    expected = (torch.einsum("th,tkoh->tko", ref_hidden, ref_weight[index]) * ref_scores[..., None]).sum(1)

    hidden.requires_grad_(), scores.requires_grad_()
    mine = weight[rank * local:(rank + 1) * local].clone().requires_grad_()
    rows, rows_per_expert, order, per_expert, recv_counts = torch_tp.ops.moe_token_dispatch(
        hidden, index, EXPERTS, group)
    assert rows_per_expert.tolist() == recv_counts.sum(0).tolist()
    ids = torch.repeat_interleave(torch.arange(local), rows_per_expert)
    out_rows = torch.einsum("rh,roh->ro", rows, mine[ids])
    got = torch_tp.ops.moe_token_combine(out_rows, scores, order, per_expert, recv_counts, group)
    what = f"rank {rank} of {world_size}"
    assert_close(got, expected, f"{what}: output", TOL)

    grad = torch.randn(tokens, HIDDEN, dtype=torch.float64, generator=gen)
    expected.backward(grad)
    got.backward(grad)
    assert_close(hidden.grad, ref_hidden.grad, f"{what}: hidden grad", TOL)
    assert_close(scores.grad, ref_scores.grad, f"{what}: weights grad", TOL)
    summed = ref_weight.grad.clone()
    dist.all_reduce(summed)
    assert_close(mine.grad, summed[rank * local:(rank + 1) * local], f"{what}: experts' grad", TOL)

    # Only moves: combine(dispatch(x)) is x, row for row.
    sorted_rows = hidden.detach()[order // TOP_K]
    local_rows, _, counts = torch_tp.ops.moe_dispatch(sorted_rows, per_expert, group)
    assert torch.equal(torch_tp.ops.moe_combine(local_rows, counts, per_expert, group), sorted_rows)


def _check_bad_input():
    group = dist.group.WORLD
    hidden = torch.randn(3, HIDDEN)
    index = torch.tensor([[0, 1], [2, EXPERTS], [1, 0]])  # an expert id out of range, on every rank
    assert_error_names(lambda: torch_tp.ops.moe_token_dispatch(hidden, index, EXPERTS, group),
                       ["moe_token_dispatch", f"{EXPERTS}", "num_experts"], IndexError)
    if dist.get_world_size() > 1:
        assert_error_names(lambda: torch_tp.ops.moe_token_dispatch(hidden, index.clamp(max=2), 3, group),
                           ["3", f"{dist.get_world_size()}"], Exception)
    torch.ops.torch_tp.all_reduce(torch.ones(1), "sum", torch_tp.ops.group_name(group))  # every rank still in step


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_all_to_all_single(ranks, world_size):
    ranks(world_size).run(_check_all_to_all)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_token_dispatch_and_combine(ranks, world_size):
    ranks(world_size).run(_check_token_exchange)


@pytest.mark.parametrize("world_size", [1, 2])
def test_bad_input(ranks, world_size):
    ranks(world_size).run(_check_bad_input)
