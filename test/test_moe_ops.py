"""The expert-parallel token exchange ops, at 1, 2 and 4 ranks, against single-process references.

``all_to_all_single`` is compared with ``torch.distributed.all_to_all_single`` (uneven and empty
splits), its gradient with the reverse exchange of the upstream gradient. ``moe_token_dispatch`` and
``moe_token_combine`` run a toy expert layer (expert e: ``x @ W_e^T``, every rank holding the whole
``W`` for the reference, its own experts' rows for the op) with a skewed router: every token's first
choice is expert 0, and at 4 ranks rank 1 has no tokens at all. The output, and the gradients of the
hidden states, of the routing weights and of ``W``, must equal the unsharded layer's; ``W``'s
gradient rows of this rank's experts sum over every rank's tokens (the all-reduce of the
references). ``moe_combine(moe_dispatch(x))`` gives ``x`` back exactly (only moves). ``torch.compile(fullgraph=True)``
(aot_eager at 2 and 4 ranks, inductor at 2) of all five ops around a toy expert layer gives the eager outputs
and gradients. A wrong router is refused by name: an expert id out of range (either side), more experts per
token than there are.

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
    rows, ids, order, per_expert, recv_counts = torch_tp.ops.moe_token_dispatch(hidden, index, EXPERTS, group)
    # Rows by source rank, each source's run by local expert (NOTE [token rows by source rank]).
    assert per_expert.tolist() == index.flatten().bincount(minlength=EXPERTS).tolist()
    assert recv_counts.shape == (world_size, local) and recv_counts.sum().item() == rows.size(0)
    by_source = [torch.repeat_interleave(torch.arange(local), counts) for counts in recv_counts]
    assert torch.equal(ids, torch.cat(by_source))
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
    # by_expert=False: the same rows and counts, blocks in (source, expert) order, and back.
    by_source, _, source_counts = torch_tp.ops.moe_dispatch(sorted_rows, per_expert, group, by_expert=False)
    assert torch.equal(source_counts, counts)
    blocks = by_source.split(counts.flatten().tolist())  # block s*L + e: source s, local expert e
    assert torch.equal(torch.cat([blocks[s * local + e] for e in range(local) for s in range(world_size)]),
                       local_rows)
    assert torch.equal(torch_tp.ops.moe_combine(by_source, counts, per_expert, group, by_expert=False), sorted_rows)


def _check_bad_input():
    group = dist.group.WORLD
    hidden = torch.randn(3, HIDDEN)
    index = torch.tensor([[0, 1], [2, EXPERTS], [1, 0]])  # an expert id out of range, on every rank
    assert_error_names(lambda: torch_tp.ops.moe_token_dispatch(hidden, index, EXPERTS, group),
                       ["moe_token_dispatch", f"{EXPERTS}", "num_experts"], IndexError)
    assert_error_names(lambda: torch_tp.ops.moe_token_dispatch(hidden, index.clamp(max=1) - 1, EXPERTS, group),
                       ["moe_token_dispatch", "expert id -1", "num_experts"], IndexError)
    # More experts per token than there are (ids in range, K=5 > E=4): refused before anything is sent.
    wide = torch.arange(3 * (EXPERTS + 1)).remainder(EXPERTS).view(3, EXPERTS + 1)
    assert_error_names(lambda: torch_tp.ops.moe_token_dispatch(hidden, wide, EXPERTS, group),
                       ["moe_token_dispatch", f"K={EXPERTS + 1}", f"num_experts={EXPERTS}"])
    if dist.get_world_size() > 1:
        assert_error_names(lambda: torch_tp.ops.moe_token_dispatch(hidden, index.clamp(max=2), 3, group),
                           ["3", f"{dist.get_world_size()}"], Exception)
    torch.ops.torch_tp.all_reduce(torch.ones(1), "sum", torch_tp.ops.group_name(group))  # every rank still in step


def _expert_of_row(rows, rows_per_expert):
    """The local expert of each row moe_dispatch brought (expert-major)."""
    return torch.searchsorted(rows_per_expert.cumsum(0), torch.arange(rows.size(0)), right=True)


def _local_experts(rows, expert_of_row, weight):
    """This rank's experts on the rows a dispatch brought: row r of local expert e is ``rows[r] @ weight[e]^T``.
    A loop of masked matmuls, one per local expert (no torch._grouped_mm, no split by data-dependent sizes),
    so the function has no host read of the counts."""
    out = torch.zeros(rows.size(0), weight.size(1), dtype=rows.dtype)
    for e in range(weight.size(0)):
        out = out + torch.where((expert_of_row == e).unsqueeze(1), rows @ weight[e].t(), 0.0)
    return out


def _moe_block(hidden, index, scores, weight, tokens, tokens_per_expert, x, output_splits, input_splits, group):
    """Every token exchange op in one function: the HF pair around the experts, the torchtitan pair
    around them, and an uneven all-to-all there and back."""
    rows, expert_ids, order, per_expert, recv_counts = torch_tp.ops.moe_token_dispatch(
        hidden, index, EXPERTS, group)
    out = torch_tp.ops.moe_token_combine(_local_experts(rows, expert_ids, weight), scores, order, per_expert,
                                         recv_counts, group)
    local, local_per_expert, counts = torch_tp.ops.moe_dispatch(tokens, tokens_per_expert, group)
    back = torch_tp.ops.moe_combine(_local_experts(local, _expert_of_row(local, local_per_expert), weight).tanh(),
                                    counts, tokens_per_expert, group)
    y = torch_tp.ops.all_to_all_single(x, output_splits, input_splits, group)
    z = torch_tp.ops.all_to_all_single(y.sin(), input_splits, output_splits, group)
    return out, back, y, z


def _check_compiled(backend):
    """``torch.compile(fullgraph=True)`` of :func:`_moe_block` gives the eager outputs and gradients.

    The routing is skewed as in :func:`_check_token_exchange`, and no token picks the last expert, so the
    last rank receives no rows for it (at 4 ranks: no rows at all), in both pairs. The row counts the
    exchanges return are data-dependent (unbacked sizes of the fake kernels); the splits of
    ``all_to_all_single`` are Python ints, different on each rank, so each rank compiles its own graph.

    ``fullgraph=True`` is what lets dynamo keep the ops with data-dependent output sizes in the graph
    (dynamo allows them under fullgraph, or with ``torch._dynamo.config.capture_dynamic_output_shape_ops``);
    without either, it breaks the graph at ``moe_token_dispatch``/``moe_dispatch`` and at a combine whose
    counts come from outside the graph, and runs those ops eagerly.

    Tolerance: float64, ``TOL`` (1e-12 of each tensor's largest magnitude). The compiled graph runs the same
    float64 kernels on the same rows (the ops only move them); what may differ is the order of sums: the
    gradient contributions of the K slots and of the per-expert loop, and inductor's fused reductions.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    local = EXPERTS // world_size
    gen = torch.Generator().manual_seed(10 + rank)
    tokens = 0 if (world_size == 4 and rank == 1) else 3 + rank
    index = torch.stack([torch.zeros(tokens, dtype=torch.long),
                         torch.randint(1, EXPERTS - 1, (tokens,), generator=gen)], dim=1)  # never the last expert
    per_expert = torch.tensor([2 + rank, 1, rank % 2] + [0] * (EXPERTS - 3))  # again none for the last expert
    input_splits = [(rank + 2 * peer) % 3 for peer in range(world_size)]  # uneven, some zero
    output_splits = [(peer + 2 * rank) % 3 for peer in range(world_size)]
    inputs = [torch.randn(tokens, HIDDEN, dtype=torch.float64, generator=gen), index,
              torch.rand(tokens, TOP_K, dtype=torch.float64, generator=gen),
              torch.randn(local, HIDDEN, HIDDEN, dtype=torch.float64, generator=gen),
              torch.randn(int(per_expert.sum()), HIDDEN, dtype=torch.float64, generator=gen), per_expert,
              torch.randn(sum(input_splits), 2, dtype=torch.float64, generator=gen)]
    differentiable = (0, 2, 3, 4, 6)
    grads_out = None
    results = []
    torch._dynamo.reset()
    # The block's exchanges form independent chains, and the ranks' graphs differ (their sizes do):
    # inductor's peak-memory reordering may then order the chains differently on each rank, which
    # pairs one rank's exchange with another's (docs/ops.md, torch.compile).
    options = {"options": {"reorder_for_peak_memory": False}} if backend == "inductor" else {}
    for fn in (_moe_block, torch.compile(_moe_block, backend=backend, fullgraph=True, **options)):
        args = [t.clone().requires_grad_(i in differentiable) for i, t in enumerate(inputs)]
        outs = fn(*args, output_splits, input_splits, group)
        if grads_out is None:
            grads_out = [torch.randn(o.shape, dtype=torch.float64, generator=gen) for o in outs]
        torch.autograd.backward(outs, grads_out)
        results.append([o.detach() for o in outs] + [args[i].grad for i in differentiable])
    names = ["out", "back", "y", "z"] + [f"grad of input {i}" for i in differentiable]
    for name, got, expected in zip(names, results[1], results[0]):
        assert_close(got, expected, f"rank {rank} of {world_size}, {backend}: {name}", TOL)


def _check_compiled_combine_alone():
    """``moe_token_combine`` compiled on its own, its counts made by an eager ``moe_token_dispatch`` (what a
    graph break between the two gives): the output and the gradients of the rows and of the weights."""
    gen = torch.Generator().manual_seed(20 + dist.get_rank())
    hidden = torch.randn(3, HIDDEN, dtype=torch.float64, generator=gen)
    index = torch.tensor([[0, 1], [2, 1], [0, 3]])
    scores = torch.rand(3, TOP_K, dtype=torch.float64, generator=gen)
    rows, _, order, per_expert, recv_counts = torch_tp.ops.moe_token_dispatch(hidden, index, EXPERTS, None)
    grad = torch.randn(3, HIDDEN, dtype=torch.float64, generator=gen)
    torch._dynamo.reset()
    results = []
    for combine in (torch_tp.ops.moe_token_combine,
                    torch.compile(torch_tp.ops.moe_token_combine, backend="aot_eager", fullgraph=True)):
        r, w = rows.clone().requires_grad_(), scores.clone().requires_grad_()
        out = combine(r, w, order, per_expert, recv_counts)
        out.backward(grad)
        results.append((out.detach(), r.grad, w.grad))
    for name, got, expected in zip(["combine", "rows' grad", "weights' grad"], results[1], results[0]):
        assert_close(got, expected, name, TOL)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_all_to_all_single(ranks, world_size):
    ranks(world_size).run(_check_all_to_all)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_token_dispatch_and_combine(ranks, world_size):
    ranks(world_size).run(_check_token_exchange)


@pytest.mark.parametrize("world_size", [1, 2])
def test_bad_input(ranks, world_size):
    ranks(world_size).run(_check_bad_input)


@pytest.mark.parametrize("world_size, backend", [(2, "aot_eager"), (4, "aot_eager"), (2, "inductor")])
def test_compiled_matches_eager(ranks, world_size, backend):
    ranks(world_size).run(_check_compiled, backend, timeout=300)


@pytest.mark.parametrize("world_size", [1, 2])
def test_compiled_combine_with_counts_from_outside(ranks, world_size):
    ranks(world_size).run(_check_compiled_combine_alone, timeout=300)


# The exchange by pieces (NOTE [slot rows through the backend's buffers], csrc/ops/moe_slot_exchange.cpp):
# through the torch_tp backend's 64 KiB shared buffers, and as gloo messages of 4096 bytes (NOTE [all-to-all
# by pieces in messages], csrc/ops/comm_pieces.cpp), many per piece, so each peer's ring of two message buffers
# wraps. Rows of 100 elements cross block and message boundaries, so the gathers, the gradient's sum and the
# weights' dots each see rows in two parts; 3 experts per token, every first choice expert 0, a rank with no
# tokens. Tolerances, of each tensor's largest
# magnitude against the float64 reference: float64 1e-12 (the order of the K=3 terms and of a split dot's two
# parts); float32 1e-5 (its roundoff over 100-long dots); bfloat16 2e-2 (the experts' output, the sum and the
# gradients each rounded to 8 bits).
PIECES_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _check_exchange_in_pieces(dtype):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    hidden_size, top_k, experts = 100, 3, 2 * world_size
    gen = torch.Generator().manual_seed(30 + rank)
    tokens = 0 if rank == 1 else 150 + 40 * rank  # a rank with no tokens, and uneven counts
    others = torch.rand(tokens, experts - 1, generator=gen).argsort(dim=1)[:, :top_k - 1] + 1  # distinct
    index = torch.cat([torch.zeros(tokens, 1, dtype=torch.long), others], dim=1)  # first choice expert 0: skewed
    x = torch.randn(tokens, hidden_size, dtype=torch.float64, generator=gen).to(dtype)
    w = torch.rand(tokens, top_k, dtype=torch.float64, generator=gen).to(dtype)
    grad = torch.randn(tokens, hidden_size, dtype=torch.float64, generator=gen).to(dtype)
    scale = 1 + index.to(torch.float64)  # expert e multiplies its rows by 1 + e

    # Unsharded, in float64 from the same (rounded) inputs.
    ref_x, ref_w = x.double().requires_grad_(), w.double().requires_grad_()
    expected = ((ref_w * scale)[..., None] * ref_x[:, None]).sum(1)
    expected.backward(grad.double())

    x.requires_grad_(), w.requires_grad_()
    rows, ids, order, per_expert, recv_counts = torch_tp.ops.moe_token_dispatch(x, index, experts, group)
    local_out = rows * (1 + rank * (experts // world_size) + ids).to(dtype)[:, None]
    got = torch_tp.ops.moe_token_combine(local_out, w, order, per_expert, recv_counts, group)
    got.backward(grad)
    what, tol = f"{dtype} rank {rank} of {world_size}", PIECES_TOL[dtype]
    assert got.dtype == dtype and x.grad.dtype == dtype and w.grad.dtype == dtype
    assert_close(got, expected, f"{what}: output", tol)
    assert_close(x.grad, ref_x.grad, f"{what}: hidden grad", tol)
    assert_close(w.grad, ref_w.grad, f"{what}: weights grad", tol)

    # Fixed weights: the combine's backward takes no dots.
    x.grad = None
    rows, ids, order, per_expert, recv_counts = torch_tp.ops.moe_token_dispatch(x, index, experts, group)
    local_out = rows * (1 + rank * (experts // world_size) + ids).to(dtype)[:, None]
    torch_tp.ops.moe_token_combine(local_out, w.detach(), order, per_expert, recv_counts, group).backward(grad)
    assert_close(x.grad, ref_x.grad, f"{what}: hidden grad with fixed weights", tol)


@pytest.mark.parametrize("dtype", list(PIECES_TOL))
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("backend, env", [("torch_tp", {"TORCH_TP_SHM_BUFFER_BYTES": "65536"}),
                                          ("gloo", {"TORCH_TP_GLOO_MESSAGE_BYTES": "4096"})])
def test_exchange_in_pieces_of_small_buffers(ranks, world_size, dtype, backend, env):
    ranks(world_size, backend, env).run(_check_exchange_in_pieces, dtype)


# float32 and bfloat16: the fused CPU kernel sums the K products in float32 in slot order, the reference's
# index_add in its own order after rounding each product to the dtype; a few units of the dtype's epsilon of
# each tensor's largest magnitude cover both. float16 runs ATen's composition itself (the reference's ops).
SLOT_SUM_TOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.float16: 1e-3}


@pytest.mark.parametrize("dtype", list(SLOT_SUM_TOL))
@pytest.mark.parametrize("tokens, top_k", [(7, 2), (5, 1), (0, 3)])
def test_slot_sum_matches_aten(dtype, tokens, top_k):
    """``_moe_slot_sum``, the weighted sum over slots that ends ``moe_token_combine`` where its exchange cannot
    sum on arrival (NOTE [one pass over the slots], csrc/ops/moe_slots.cpp), against
    ``zeros.index_add(rows * w[order])`` for a random permutation ``order``."""
    gen = torch.Generator().manual_seed(tokens * 10 + top_k)
    hidden = 33  # not a multiple of any vector width: the loops' tails run
    rows = torch.randn(tokens * top_k, hidden, generator=gen).to(dtype)
    weights = torch.rand(tokens, top_k, generator=gen).to(dtype)
    order = torch.randperm(tokens * top_k, generator=gen)
    got = torch.ops.torch_tp._moe_slot_sum(rows, order, weights)
    expected = torch.zeros(tokens, hidden, dtype=dtype).index_add(
        0, order // top_k, rows * weights.reshape(-1)[order].unsqueeze(1))
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    assert_close(got, expected, f"{dtype} T={tokens} K={top_k}: output", SLOT_SUM_TOL[dtype])


def test_slot_sum_refuses_an_order_that_is_no_permutation():
    rows, weights = torch.randn(4, 3), torch.rand(2, 2)
    assert_error_names(lambda: torch.ops.torch_tp._moe_slot_sum(rows, torch.tensor([0, 1, 1, 3]), weights),
                       ["moe_token_combine", "order", "permutation", "entry 2", "repeat"], IndexError)
    assert_error_names(lambda: torch.ops.torch_tp._moe_slot_sum(rows, torch.tensor([0, 1, 2, 4]), weights),
                       ["moe_token_combine", "order", "entry 3", "out of range"], IndexError)
    assert_error_names(lambda: torch.ops.torch_tp._moe_slot_sum(rows[:3], torch.tensor([0, 1, 2, 3]), weights),
                       ["moe_token_combine", "3 rows", "4 entries"])


# Against transformers' eager experts module of the same weights: float64 differs by the GEMMs' summation
# order alone; float32 by its roundoff over H=40 and I=24-long dot products; bfloat16 by a few 8-bit roundings
# that the two GEMM orders place differently (the activation is ATen's silu and mul in both).
GATED_EXPERTS_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _hf_experts(num_experts: int, hidden: int, inner: int, dtype):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    module = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inner, num_experts=num_experts,
                                            num_experts_per_tok=1, experts_implementation="eager"))
    gen = torch.Generator().manual_seed(num_experts)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=gen) * hidden ** -0.5)
        module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=gen) * inner ** -0.5)
    return module.to(dtype)


@pytest.mark.parametrize("dtype", list(GATED_EXPERTS_TOL))
@pytest.mark.parametrize("counts", [[[2, 0, 3], [1, 4, 0]], [[5, 0, 2]], [0, 3, 1], [[0, 0, 0], [0, 0, 0]]],
                         ids=["two runs", "one run", "flat", "no rows"])
def test_gated_experts_match_transformers(dtype, counts):
    """``moe_gated_experts`` (NOTE [one GEMM per expert], csrc/ops/moe_experts.cpp) on rows in (run, expert)
    blocks, against transformers' eager Qwen3MoeExperts on the same rows as top-1 routing with unit weights:
    the output and the gradients of the rows and of both weights; an expert without rows gets zero
    gradients, and no rows at all give an empty output."""
    counts = torch.tensor(counts)
    experts = _hf_experts(counts.shape[-1], 40, 24, dtype)
    ids = torch.arange(counts.shape[-1]).repeat(counts.numel() // counts.shape[-1]).repeat_interleave(counts.flatten())
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(ids.numel(), 40, generator=gen).to(dtype).requires_grad_()
    grad = torch.randn(rows.shape, generator=gen).to(dtype)
    expected = experts(rows, ids[:, None], torch.ones(ids.numel(), 1, dtype=dtype))
    if expected.requires_grad:  # not without rows: the module returns zeros_like(rows)
        expected.backward(grad)
    expected_grads = [t.grad for t in (rows, experts.gate_up_proj, experts.down_proj)]
    rows.grad = experts.gate_up_proj.grad = experts.down_proj.grad = None
    got = torch.ops.torch_tp.moe_gated_experts(rows, counts, experts.gate_up_proj, experts.down_proj)
    got.backward(grad)
    tol, what = GATED_EXPERTS_TOL[dtype], f"{dtype}, counts {counts.tolist()}"
    assert got.dtype == dtype and got.shape == rows.shape
    assert_close(got, expected, f"{what}: output", tol)
    for name, t, want in zip(["rows", "gate_up_proj", "down_proj"], (rows, experts.gate_up_proj, experts.down_proj),
                             expected_grads):
        if want is None:  # no rows: transformers' module never touches its weights
            assert t.grad is not None and not t.grad.any(), f"{what}: {name}.grad of experts without rows must be zero"
        else:
            assert_close(t.grad, want, f"{what}: {name}.grad", tol)


def test_gated_experts_opcheck_and_bad_input():
    """The schema, autograd registration and fake (Meta) kernels by torch.library.opcheck; counts that do
    not cover the rows, negative counts and mismatched weights are refused by name."""
    experts = _hf_experts(3, 8, 4, torch.float64)
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    rows = torch.randn(6, 8, dtype=torch.float64)
    counts = torch.tensor([[1, 2, 0], [0, 1, 2]])
    torch.library.opcheck(torch.ops.torch_tp.moe_gated_experts.default,
                          (rows.requires_grad_(), counts, gate_up.requires_grad_(), down.requires_grad_()))
    op = torch.ops.torch_tp.moe_gated_experts
    assert_error_names(lambda: op(rows, torch.tensor([1, 2, 2]), gate_up, down),
                       ["moe_gated_experts", "counts sums to 5", "rows.size(0)=6"])
    assert_error_names(lambda: op(rows, torch.tensor([7, -1, 0]), gate_up, down),
                       ["moe_gated_experts", "negative count -1"])
    assert_error_names(lambda: op(rows, torch.tensor([2, 2, 2, 0]), gate_up, down),
                       ["moe_gated_experts", "counts", "[4]", "[3, 8, 8]"])
    assert_error_names(lambda: op(rows, counts, gate_up, down.float()),
                       ["moe_gated_experts", "one floating dtype", "Double", "Float"])
