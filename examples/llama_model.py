"""A small Llama-style decoder and torchtitan's tensor-parallel plan for it.

The module tree and parameter names are torchtitan's Llama (``torchtitan/models/llama``),
so its tensor-parallel plan applies unchanged:

    tok_embeddings                      nn.Embedding(vocab_size, dim)
    layers.N.attention_norm             nn.RMSNorm(dim)
    layers.N.attention.{wq,wk,wv,wo}    nn.Linear, no bias; rotary position embedding
    layers.N.ffn_norm                   nn.RMSNorm(dim)
    layers.N.feed_forward.{w1,w2,w3}    SwiGLU: w2(silu(w1(x)) * w3(x))
      or, with LlamaConfig(n_experts=E, top_k=K), a mixture of experts (MoEFeedForward):
    layers.N.feed_forward.router        nn.Linear(dim, E, no bias): softmax, top-K, renormalized
    layers.N.feed_forward.experts       Experts: gate_up_proj [E, 2I, H], down_proj [E, H, I]
                                        (transformers' layout, torch_tp's MoE styles apply to it)
    norm                                nn.RMSNorm(dim)
    output                              nn.Linear(dim, vocab_size, no bias)

The attention never assumes it holds all heads: it reads the head count from the
size of ``wq``'s output (``view(bs, seqlen, -1, head_dim)``), so under tensor
parallelism each rank computes its ``n_heads // tp`` local heads, as torchtitan does.
The rotary table is a real tensor ``[max_seq_len, head_dim // 2, 2]`` (cos, sin)
rather than torchtitan's complex ``freqs_cis``: same maths, no complex dtype.
``forward(tokens, cache)`` with a :class:`KVCache` decodes incrementally: each
layer keeps the keys and values of the tokens seen so far (under TP, of its own
KV heads), and a step computes only the new tokens.

Shapes under the plan of :func:`tp_plan` (b batch, s sequence, d dim, p ranks,
h heads, v vocab; ``[.]`` a DTensor, otherwise a plain local tensor):

    tokens [b, s] -> tok_embeddings (vocab-parallel, reduce-scatter) -> x [b, s/p, d]
    per layer:
      attention_norm (SequenceParallel) -> [b, s/p, d] Shard(1)
      -> PrepareModuleInput: all-gather -> [b, s, d] Replicate
      -> wq/wk/wv (column-parallel) -> [b, s, h/p * head_dim]     local heads
      -> attention over h/p heads -> wo (row-parallel, reduce-scatter) -> [b, s/p, d]
      ffn_norm, feed_forward likewise (w1/w3 column-, w2 row-parallel)
    norm (SequenceParallel) -> output (column-parallel, all-gather of the sequence)
    -> logits [b, s, v/p] Shard(-1), consumed by loss_parallel() (vocab-parallel cross entropy)

``from llama_model import Llama, LlamaConfig, tp_plan`` with examples/ on sys.path.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = [
    "Experts",
    "KVCache",
    "Llama",
    "LlamaConfig",
    "MoEFeedForward",
    "ReplicateParameters",
    "tp_plan",
    "load_tp_api",
    "TP_API_NAMES",
    "cross_entropy_loss",
    "to_full",
    "check_tp_against_reference",
    "make_optimizer",
]


# ----------------------------------------------------------------------------- model


@dataclass
class LlamaConfig:
    """Model hyper-parameters (torchtitan's ``ModelArgs``, trimmed)."""

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: Optional[int] = None  # None: n_heads (no grouped-query attention)
    multiple_of: int = 32  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 512
    depth_init: bool = True  # torchtitan: output projections' init std shrinks with depth
    # Mixture of experts: None keeps the dense SwiGLU feed-forward. With n_experts, every layer's
    # feed_forward is a MoEFeedForward of n_experts SwiGLU experts of ffn_hidden_dim, top_k per token.
    n_experts: Optional[int] = None
    top_k: int = 2

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.n_experts is not None and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head_dim={self.dim // self.n_heads} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        # torchtitan / Meta Llama: 2/3 of 4 * dim, scaled, rounded up to multiple_of.
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def to_dict(self) -> Dict[str, Any]:
        """The fields, without the MoE ones for a dense model (the dense model's dict, and so its
        checkpoints' train_state.json, is what it was before mixtures of experts existed)."""
        fields = asdict(self)
        if self.n_experts is None:
            del fields["n_experts"], fields["top_k"]
        return fields


def precompute_rope(head_dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """Rotary table ``[end, head_dim // 2, 2]``: (cos, sin) of position * frequency, the real and
    imaginary parts of the unit complex numbers that rotate each pair of features."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32)[: head_dim // 2] / head_dim))
    angles = torch.outer(torch.arange(end, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, rope: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate pairs (x[2i], x[2i+1]) of q and k ``[b, s, heads, head_dim]`` by the positions' angles:
    each pair read as a complex number and multiplied by (cos + i sin), torchtitan's formulation.

    The table stays real (a plain float buffer for ``Module.to``, DCP and the TP plans) and is read
    as complex here, a view. One complex multiply per tensor does what the pairs' separate real
    products, sums and re-interleaving did, with the same values, and in far fewer ops: faster on
    the CPU forward and backward at the example's training shape, and for a decode token."""
    seqlen = xq.size(1)
    # A float16/bfloat16 table (a model cast whole) is widened: complex needs float32 or float64.
    rope = rope[:seqlen].to(torch.promote_types(rope.dtype, torch.float32))
    rotation = torch.view_as_complex(rope).view(1, seqlen, 1, -1)  # [1, s, 1, head_dim // 2]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # [b, s, heads, head_dim // 2]
        return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)

    return rotate(xq), rotate(xk)


class KVCache:
    """The keys and values a generation has seen, for incremental decoding: ``model(tokens, cache)``
    runs the new ``tokens`` at positions ``cache.pos ..``, attending to the cached ones, and moves
    ``cache.pos`` on. Each layer's buffers ``[b, max_seq_len, kv heads, head_dim]`` are made at its
    first step from the keys' shape, so under TP they hold the rank's own KV heads."""

    def __init__(self, max_seq_len: int):
        self.max_seq_len = max_seq_len
        self.pos = 0  # tokens cached so far
        self.layers: Dict[str, LayerKV] = {}

    def layer(self, name: str) -> "LayerKV":
        if name not in self.layers:
            self.layers[name] = LayerKV(self)
        return self.layers[name]


class LayerKV:
    """One layer's part of a :class:`KVCache`."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None

    def update(self, xk: torch.Tensor, xv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys/values ``[b, s, kv heads, head_dim]`` at ``cache.pos``; return all of them so far."""
        start, end = self.cache.pos, self.cache.pos + xk.size(1)
        if self.keys is None:
            shape = (xk.size(0), self.cache.max_seq_len, *xk.shape[2:])
            self.keys, self.values = xk.new_empty(shape), xv.new_empty(shape)
        self.keys[:, start:end] = xk
        self.values[:, start:end] = xv
        return self.keys[:, :end], self.values[:, :end]


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[b, s, kv_heads, d] -> [b, s, kv_heads * n_rep, d]`` (grouped-query attention)."""
    if n_rep == 1:
        return x
    bs, slen, n_kv, head_dim = x.shape
    return x[:, :, :, None, :].expand(bs, slen, n_kv, n_rep, head_dim).reshape(bs, slen, n_kv * n_rep, head_dim)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def init_weights(self, init_std: float):
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: Optional[LayerKV] = None) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        # -1, not n_heads: under TP the column-parallel wq/wk/wv hold n_heads // tp heads.
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, rope)
        # Local query heads per local KV head: n_heads // n_kv_heads, except where a TP plan keeps
        # one KV head per rank for fewer KV heads than ranks (torch_tp's KVHeadColwiseParallel).
        n_rep = xq.size(2) // xk.size(2)
        mask, is_causal = None, True
        if cache is not None:
            past = cache.cache.pos
            xk, xv = cache.update(xk, xv)  # [b, past + s, local kv heads, head_dim]
            # A prompt (no past) is causal; one new token sees every cached one; new tokens
            # after a past see it and each other causally (token i: the past and new tokens 0..i).
            # Branches, not a comparison passed on: under torch.compile with dynamic shapes a
            # comparison of sizes is a SymBool, which SDPA's is_causal refuses.
            if seqlen == 1:
                is_causal = False
            elif past:
                mask, is_causal = torch.ones(seqlen, past + seqlen, dtype=torch.bool, device=x.device).tril(past), False
        keys = repeat_kv(xk, n_rep)
        values = repeat_kv(xv, n_rep)
        out = F.scaled_dot_product_attention(
            xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, is_causal=is_causal,
        )  # [b, local heads, s, head_dim]
        out = out.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, init_std: float):
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """``num_experts`` SwiGLU experts stacked in transformers' experts layout (Mixtral's, Qwen3-MoE's),
    so torch_tp's ExpertsTensorParallel, ExpertParallel and ExpertTensorParallel apply unchanged::

        gate_up_proj [E, 2I, H]   rows [gate | up] of each expert (w1 | w3 of the dense FeedForward)
        down_proj    [E, H, I]    (w2)

    ``forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``:
    ``sum_k w_k * down_e(silu(gate_e x) * up_e x)`` over each token's K experts e, one expert at a
    time over the tokens routed to it (transformers' eager experts). It reads ``num_experts`` and the
    leading dim of the parameters, never E from elsewhere: under expert parallelism the styles run it
    on this rank's experts with local expert ids."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def init_weights(self, init_std: float):
        # As the dense FeedForward: gate (w1) std 0.02, up (w3) and down (w2) the depth-scaled std.
        hidden = self.down_proj.shape[-1]
        nn.init.trunc_normal_(self.gate_up_proj[:, :hidden], mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.gate_up_proj[:, hidden:], mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.down_proj, mean=0.0, std=init_std)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            # [E, K, T]: which (slot, token) pairs each expert gets; only the experts that get any run.
            mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
            hit = (mask.sum(dim=(1, 2)) > 0).nonzero().flatten().tolist()
        for e in hit:
            slot, token = torch.where(mask[e])
            gate, up = F.linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out


class MoEFeedForward(nn.Module):
    """A mixture-of-experts feed-forward (Mixtral's, Qwen3-MoE's routing): a linear router
    ``dim -> E``, softmax, the top-k experts of each token with their probabilities renormalized to
    sum to 1, and :class:`Experts`. ``forward(x [..., dim]) -> [..., dim]``; no load-balancing loss."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = Experts(n_experts, dim, hidden_dim)

    def init_weights(self, init_std: float):
        nn.init.trunc_normal_(self.router.weight, mean=0.0, std=0.02)
        self.experts.init_weights(init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.size(-1))  # [T, dim]
        # The router's weight may be a Replicate() DTensor (ReplicateParameters): its local tensor.
        probs = F.softmax(F.linear(tokens, to_local(self.router.weight)), dim=-1, dtype=torch.float32)  # [T, E]
        weights, index = torch.topk(probs, self.top_k, dim=-1)  # [T, K]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(tokens, index, weights.to(tokens.dtype)).view(x.shape)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, config: LlamaConfig):
        super().__init__()
        self.attention = Attention(config)
        if config.n_experts is None:
            self.feed_forward = FeedForward(config.dim, config.ffn_hidden_dim)
        else:
            self.feed_forward = MoEFeedForward(config.dim, config.ffn_hidden_dim, config.n_experts, config.top_k)
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        if config.depth_init:
            self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5
        else:
            self.weight_init_std = 0.02 / (2 * config.n_layers) ** 0.5

    def init_weights(self):
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: Optional[LayerKV] = None) -> torch.Tensor:
        # The cache goes as a keyword: PrepareModuleInput's layouts cover the positional (x, rope).
        h = x + self.attention(self.attention_norm(x), rope, cache=cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Decoder-only transformer; ``forward(tokens [b, s]) -> logits [b, s, vocab]`` (at least float32).

    The weights are initialised in the constructor (torchtitan's scheme) from the
    current torch RNG, so the same ``torch.manual_seed`` gives the same model on every rank.
    Built on the meta device, the model is materialized with ``to_empty`` and then
    :meth:`init_weights`, which also recomputes the rotary table.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        # Not persistent: recomputed from the config, never checkpointed, never sharded.
        self.register_buffer("rope", precompute_rope(config.head_dim, config.max_seq_len, config.rope_theta),
                             persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, config) for i in range(config.n_layers)})
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        if not self.rope.is_meta:  # after to_empty(): the buffer holds garbage
            self.rope.copy_(precompute_rope(self.config.head_dim, self.config.max_seq_len, self.config.rope_theta))
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        std, cutoff = self.config.dim ** -0.5, 3.0
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-cutoff * std, b=cutoff * std)

    def forward(self, tokens: torch.Tensor, cache: Optional[KVCache] = None) -> torch.Tensor:
        start = 0 if cache is None else cache.pos
        if start + tokens.size(1) > self.config.max_seq_len:
            raise ValueError(f"positions up to {start + tokens.size(1)} exceed max_seq_len={self.config.max_seq_len}")
        # A pipeline stage's model (train_llama.py --pp) holds only its part: the parts it lacks are None
        # and their steps are skipped, so a middle stage maps hidden states [b, s, d] to hidden states.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope = self.rope[start:start + tokens.size(1)] if start else self.rope
        for name, layer in self.layers.items():
            h = layer(h, rope) if cache is None else layer(h, rope, cache.layer(name))
        if cache is not None:
            cache.pos += tokens.size(1)
        if self.norm is None:
            return h
        h = self.norm(h)
        logits = self.output(h)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits: the loss in float32


# ----------------------------------------------------------------------------- TP API and plan

TP_API_NAMES = (
    "parallelize_module",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "loss_parallel",
)


def load_tp_api(impl: Any = "torch") -> Any:
    """The tensor-parallel API to use: ``"torch"`` (torch.distributed.tensor.parallel),
    ``"torch_tp"`` (the drop-in replacement), or any object that has the names in
    :data:`TP_API_NAMES`, returned as it is.

    Raises ImportError, naming what is missing, when ``torch_tp`` does not export them.
    """
    if not isinstance(impl, str):
        return impl
    if impl == "torch":
        return importlib.import_module("torch.distributed.tensor.parallel")
    if impl == "torch_tp":
        module = importlib.import_module("torch_tp")
        missing = [name for name in TP_API_NAMES if not hasattr(module, name)]
        if missing:
            raise ImportError(
                f"torch_tp {getattr(module, '__version__', '?')} ({module.__file__}) does not export "
                f"{', '.join(missing)} yet; use --impl torch (torch.distributed.tensor.parallel) meanwhile"
            )
        return module
    raise ValueError(f"unknown TP implementation {impl!r}: expected 'torch' or 'torch_tp'")


def tp_plan(api: Any = "torch", *, loss_parallel: bool = True, sequence_parallel: bool = True,
            n_kv_heads: Optional[int] = None, moe: bool = False, experts_tp: bool = True) -> Dict[str, Any]:
    """torchtitan's Llama plan as one ``parallelize_module`` plan.

    Keys use ``*`` for the layer index (each dotted part is matched with fnmatch).
    With ``loss_parallel=True`` the logits stay vocab-sharded DTensors
    (``Shard(-1)``) for :func:`cross_entropy_loss`; with False they are
    all-gathered to a replicated plain tensor. With ``sequence_parallel=False``
    the norms stay unsharded modules and activations between the layers are
    replicated (torchtitan's plan without sequence parallelism). With
    ``n_kv_heads`` and an API that has ``KVHeadColwiseParallel`` (torch_tp),
    ``wk``/``wv`` take it, so fewer KV heads than ranks work (each KV head on
    the ranks whose query heads read it); otherwise they are ColwiseParallel.

    With ``moe=True`` (a model of :class:`MoEFeedForward` layers; torch_tp only)
    the feed-forward entries are the MoE layer's: the router stays replicated,
    and ``experts`` gets ``ExpertsTensorParallel`` (each expert's intermediate
    dim split over the ranks), unless ``experts_tp=False`` leaves the experts
    to a style applied before (``ExpertParallel`` on an ep mesh, whose ranks
    hold different tokens, or ``ExpertTensorParallel`` on an (ep, tp) mesh,
    which this plan's ``ExpertsTensorParallel`` then leaves as it is). Under
    sequence parallelism the layer takes the all-gathered sequence as a plain
    tensor and hands back this rank's sequence shard of its replicated output
    (no communication; the backward all-gathers its gradient).

    Args:
        api: ``"torch"``, ``"torch_tp"`` or a module with the style classes (see :func:`load_tp_api`).
    """
    from torch.distributed.tensor import Replicate, Shard

    tp = load_tp_api(api)
    between = Shard(1) if sequence_parallel else Replicate()  # the layout between the layers
    if n_kv_heads is not None and hasattr(tp, "KVHeadColwiseParallel"):
        def kv_style():
            return tp.KVHeadColwiseParallel(n_kv_heads)
    else:
        kv_style = tp.ColwiseParallel
    plan = {
        "tok_embeddings": tp.RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "output": tp.ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
        "layers.*.attention.wq": tp.ColwiseParallel(),
        "layers.*.attention.wk": kv_style(),
        "layers.*.attention.wv": kv_style(),
        "layers.*.attention.wo": tp.RowwiseParallel(output_layouts=between),
    }
    if not moe:
        plan.update({
            "layers.*.feed_forward.w1": tp.ColwiseParallel(),
            "layers.*.feed_forward.w2": tp.RowwiseParallel(output_layouts=between),
            "layers.*.feed_forward.w3": tp.ColwiseParallel(),
        })
    else:
        plan["layers.*.feed_forward.router"] = ReplicateParameters()
        if experts_tp:
            plan["layers.*.feed_forward.experts"] = tp.ExpertsTensorParallel()
    if sequence_parallel:
        plan.update({
            "norm": tp.SequenceParallel(),
            "layers.*.attention_norm": tp.SequenceParallel(),
            "layers.*.attention": tp.PrepareModuleInput(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
            ),
            "layers.*.ffn_norm": tp.SequenceParallel(),
            "layers.*.feed_forward": tp.PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ) if not moe else tp.PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True,
            ),
        })
    return plan


class ReplicateParameters(ParallelStyle):
    """torchtitan's ``NoParallel`` for a MoE router: its parameters become ``Replicate()`` DTensors
    on the mesh, so the optimizer (fused AdamW refuses a mix of DTensors and plain tensors), DCP
    and FSDP2 see the same kind of parameter as everywhere else. Every TP rank routes the same
    (all-gathered) tokens, so its gradient is already whole on each rank and is not reduced; the
    forward (:class:`MoEFeedForward`) runs on the local tensor."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.tensor import distribute_module

        return distribute_module(module, device_mesh)


def make_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1) -> torch.optim.Optimizer:
    """The example's optimizer: AdamW with torchtitan's betas, fused as torchtitan's default.
    One fused kernel updates every parameter; with DTensor parameters that is one DTensor
    dispatch per step instead of one per parameter and elementwise op (the for-loop AdamW)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, fused=True)


def check_tp_degree(config: LlamaConfig, tp: int, api: Any = "torch") -> None:
    """Heads are split whole over the ranks; everything else may be uneven (torch.chunk). With
    torch_tp's KVHeadColwiseParallel the TP degree may also be a multiple of n_kv_heads."""
    replicates_kv = hasattr(load_tp_api(api), "KVHeadColwiseParallel")
    kv_heads_fit = config.n_kv_heads % tp == 0 or (replicates_kv and tp % config.n_kv_heads == 0)
    if config.n_heads % tp or not kv_heads_fit:
        rule = "divide it or be divisible by it" if replicates_kv else "be divisible by it"
        raise ValueError(f"n_heads={config.n_heads} must be divisible by the TP degree {tp}, and "
                         f"n_kv_heads={config.n_kv_heads} must {rule}")


# ----------------------------------------------------------------------------- loss and helpers


def loss_context(api: Any, parallel: bool = True):
    """``api.loss_parallel()`` when the logits are vocab-sharded, else a no-op context.
    Enter it around the loss *and* its backward."""
    return load_tp_api(api).loss_parallel() if parallel else contextlib.nullcontext()


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; ``logits [b, s, v]`` (a DTensor under loss_parallel), ``targets [b, s]``."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def to_full(t: Any) -> torch.Tensor:
    """A plain, full tensor from a DTensor (or anything with ``full_tensor()``) or a tensor."""
    if hasattr(t, "full_tensor"):
        return t.full_tensor()
    return t


def to_local(t: Any) -> torch.Tensor:
    """This rank's plain tensor of a DTensor (or anything with ``to_local()``) or a tensor."""
    if hasattr(t, "to_local"):
        return t.to_local()
    return t


# ----------------------------------------------------------------------------- reference check


def _default_mesh(device_type: str):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("tp",))


def check_tp_against_reference(
    mesh=None,
    api: Any = "torch",
    config: Optional[LlamaConfig] = None,
    *,
    steps: int = 3,
    batch: int = 2,
    seq: int = 32,
    seed: int = 0,
    lr: float = 1e-2,
    rtol: float = 1e-5,
    loss_parallel: bool = True,
    device: str = "cpu",
) -> List[Tuple[float, float]]:
    """Train the TP model and the unsharded model side by side; the losses must agree.

    Call on every rank of an initialised process group (``mesh`` None: a 1-D mesh
    over the world). Each rank builds the unsharded :class:`Llama` from ``seed``
    and trains it alone; the TP model is built from the same seed, parallelized
    with :func:`tp_plan`, and trained with the same AdamW and the same random
    batches. Step 0's loss checks the forward (embedding, attention over local
    heads, sequence parallelism, vocab-parallel loss); later steps check the
    gradients, including the partial sums of the norm weights under
    SequenceParallel, which must be all-reduced.

    ``rtol``: the sharded fp32 GEMMs and reductions add up in another order
    than the reference's, which moves the loss by ~1e-7 relative (fp32
    epsilon); 1e-5 leaves room for that and still catches the subtlest bug:
    norm weights updated from their partial (sequence-shard) gradients, not
    all-reduced, move the loss by ~5e-4 at step 1 and ~1.5e-3 at step 2 with
    the default lr=1e-2 (a larger lr than training's, to make such bugs show).

    Returns ``[(tp_loss, reference_loss), ...]``, one per step; raises
    AssertionError on a mismatch.
    """
    if config is None:
        config = LlamaConfig(vocab_size=67, dim=64, n_layers=2, n_heads=4, max_seq_len=seq)
    tp = load_tp_api(api)
    mesh = mesh if mesh is not None else _default_mesh(device)
    check_tp_degree(config, mesh.size(), tp)

    torch.manual_seed(seed)
    reference = Llama(config).to(device)
    torch.manual_seed(seed)
    model = Llama(config).to(device)
    tp.parallelize_module(model, mesh, tp_plan(tp, loss_parallel=loss_parallel, n_kv_heads=config.n_kv_heads))

    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed + 1)
    results = []
    for step in range(steps):
        tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=gen).to(device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]

        ref_loss = cross_entropy_loss(reference(inputs), targets)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()

        with loss_context(tp, loss_parallel):
            loss = cross_entropy_loss(model(inputs), targets)
            loss.backward()
        opt.step()
        opt.zero_grad()

        got, want = to_full(loss).item(), ref_loss.item()
        results.append((got, want))
        rel = abs(got - want) / abs(want)
        assert rel <= rtol, (
            f"step {step}: TP loss {got:.8f} vs unsharded {want:.8f} (rel. diff {rel:.2e} > rtol {rtol:.0e}); "
            f"all steps so far: {results}"
        )
    return results
