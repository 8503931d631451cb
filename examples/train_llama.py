"""Train a small Llama on a character-level corpus with tensor + sequence parallelism.

Launch (2 ranks on CPU, about a minute):

    torchrun --nproc-per-node 2 examples/train_llama.py                 # torch_tp
    torchrun --nproc-per-node 2 examples/train_llama.py --impl torch    # torch.distributed.tensor.parallel
    torchrun --nproc-per-node 2 examples/train_llama.py --resume        # continue from --out-dir's checkpoint
    torchrun --nproc-per-node 4 examples/train_llama.py --resume        # ... at another TP degree
    torchrun --nproc-per-node 4 examples/train_llama.py --dp 2          # FSDP2 over 2 x TP over 2
    torchrun --nproc-per-node 2 examples/train_llama.py --check         # TP vs unsharded losses, then exit
    torchrun --nproc-per-node 4 examples/train_llama.py --pp 2          # 2 pipeline stages x TP over 2
    torchrun --nproc-per-node 4 examples/train_llama.py --kv-heads 1    # MQA: one KV head over 4 TP ranks
    torchrun --nproc-per-node 2 examples/train_llama.py --save-hf hf    # ... and a Hugging Face directory
    torchrun --nproc-per-node 4 examples/train_llama.py --experts 8 --top-k 2 --dp 2 --ep 2
                                            # mixture of experts: EP 2 x TP 2, the rest FSDP2 2 x TP 2

The model and torchtitan's TP plan (sequence parallel, loss_parallel) are in
llama_model.py; --impl picks whose parallelize_module and styles apply it:
``torch_tp`` (the drop-in replacement) or ``torch`` (DTensor). The ranks form a
("dp", "tp") mesh of --dp x (world size / --dp): tensor parallelism over "tp"
(the whole world by default), and with --dp > 1 torchtitan's 2-D recipe,
FSDP2's ``fully_shard`` of every block and of the model over "dp", each dp rank
taking its slice of the batch. All ranks start from the same seed. Tokens are
bytes (vocab 256) or, with --tokenizer char, the corpus's distinct characters
(a vocabulary the TP degree need not divide).

--pp N adds pipeline parallelism (torch.distributed.pipelining) on a
("pp", "dp", "tp") mesh: the model is cut into stages, the embedding in the
first, the norm and output in the last, the blocks spread evenly between (the
embedding and the norm + output weigh one block each, as in torchtitan); each
stage's model keeps the full model's parameter names and gets the TP plan and
FSDP2 as above. --pp-schedule picks GPipe, 1F1B (one stage per rank),
Interleaved1F1B or ZBVZeroBubble (2 stages per rank unless
--pp-stages-per-rank says otherwise); the batch runs as --microbatches
micro-batches. The validation loss comes from the last stage (skipped under
ZBVZeroBubble: torch 2.14's schedule runs backward actions in its eval()); the
sample at the end (--sample) is skipped under --pp > 1. On CPU the ranks talk through
torch_tp's shared-memory backend (``--backend gloo``: torch's).

Rank 0 shows a progress bar (loss, tokens/s) on stderr, and writes to --out-dir:
loss_curve.png, metrics.json, and checkpoint/ (every --ckpt-every steps and at
the end): a torch.distributed.checkpoint (DCP) of the model and optimizer
state, and train_state.json (step, losses). --resume restores them at any
--pp, --dp and TP degree, and with either --impl (the parameters are DTensors, which
DCP reshards), and the resumed run sees the batches the uninterrupted one
would have.

--experts N makes every layer's feed-forward a mixture of N SwiGLU experts
(llama_model.MoEFeedForward: a linear router, softmax, the --top-k experts
of each token, their probabilities renormalized; transformers' experts
layout, no load-balancing loss). Under TP the router stays replicated and
the experts get torch_tp.ExpertsTensorParallel (each expert's intermediate
dim split over "tp"). --ep N splits the experts whole over N of the --dp
ranks (torchtitan's carving: a ("pp", "dp_mod_ep", "ep", "tp") mesh whose
two middle dims flattened are "dp"): torch_tp.ExpertParallel on "ep", or
ExpertTensorParallel on ("ep", "tp") with TP, applied before the TP plan;
FSDP2 shards the experts over "dp_mod_ep" (the ranks holding the same
experts) with their gradients divided by --dp, the rest over "dp". --ep must
divide --dp and --experts; --experts is refused with --pp, --impl torch,
--save-hf and --check. Its checkpoints resume at any --dp, --ep and TP
degree. --log-grad-norm records each step's gradient norm in metrics.json
(the experts' alone too).

--save-hf DIR writes the trained model, at the end, as a Hugging Face
LlamaForCausalLM directory (config.json, safetensors files, their index when
there are several: --save-hf-shard-size) that transformers' from_pretrained and
``examples/generate.py --hf DIR`` load. The model is copied one tensor at a time
into a LlamaForCausalLM built on the meta device and parallelized with its own
tp_plan on the same TP mesh (wq and wk rows reordered per head: this model
rotates interleaved pairs, HF rotate_half's halves), then written by
torch_tp.parallel.save_pretrained, which gathers one tensor at a time. It works
at any TP degree, --dp, --kv-heads, --tokenizer and either --impl; not under --pp
(each pipeline rank holds only its stages), refused before training starts.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_model import (  # noqa: E402
    Llama,
    LlamaConfig,
    check_tp_against_reference,
    check_tp_degree,
    cross_entropy_loss,
    load_tp_api,
    loss_context,
    make_optimizer,
    to_full,
    tp_plan,
)

PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble")
DEFAULT_CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "corpus.txt")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("run")
    g.add_argument("--impl", choices=["torch_tp", "torch"], default="torch_tp",
                   help="tensor-parallel implementation (default torch_tp)")
    g.add_argument("--steps", type=int, default=150, help="total optimizer steps (default 150)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda when there is a GPU per local rank, else cpu")
    g.add_argument("--backend", default=None,
                   help="process-group backend (default: torch_tp's shared-memory backend on cpu, nccl on cuda; "
                   "gloo works too)")
    g.add_argument("--out-dir", default="llama_out", help="plot, metrics and checkpoints (default ./llama_out)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the checkpoint in --out-dir (written at any --dp, TP degree or --impl)")
    g.add_argument("--dp", type=int, default=1,
                   help="data-parallel degree: FSDP2 over dp x tensor parallelism over world/dp ranks (default 1)")
    g.add_argument("--pp", type=int, default=1,
                   help="pipeline-parallel degree: N groups of ranks, each running its stages with FSDP2 over --dp "
                        "x TP over the rest (default 1: no pipelining)")
    g.add_argument("--pp-schedule", choices=PP_SCHEDULES, default="1F1B",
                   help="pipeline schedule under --pp > 1 (default 1F1B)")
    g.add_argument("--pp-stages-per-rank", type=int, default=None,
                   help="stages per pipeline rank (default: 1 for GPipe and 1F1B, 2 for Interleaved1F1B and "
                        "ZBVZeroBubble)")
    g.add_argument("--microbatches", type=int, default=None,
                   help="micro-batches per step under --pp > 1 (default: the number of stages); "
                        "must divide --batch / --dp")
    g.add_argument("--ckpt-every", type=int, default=50, help="checkpoint every K steps, 0: only at the end")
    g.add_argument("--stop-after", type=int, default=None, metavar="K",
                   help="end this run after step K (checkpointed), keeping --steps' schedule: an interruption "
                        "that --resume continues exactly")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--check", action="store_true",
                   help="only compare a few steps of the TP model with the unsharded one, then exit")
    g.add_argument("--sample", type=int, default=120,
                   help="characters to generate at the end (0: none; skipped under --pp > 1, which would have to "
                        "run generation through the pipeline)")
    g.add_argument("--amp", action="store_true", help="bf16 autocast (cuda)")
    g.add_argument("--log-grad-norm", action="store_true",
                   help="record each step's gradient norm (the whole model's, before the optimizer step) in "
                        "metrics.json's grad_norms, and under --experts the experts' alone in expert_grad_norms: "
                        "one collective per parameter and step")
    g.add_argument("--save-hf", metavar="DIR", default=None,
                   help="at the end, write the model as a Hugging Face LlamaForCausalLM directory (config.json, "
                        "safetensors files, an index when --save-hf-shard-size splits them) for from_pretrained "
                        "and generate.py --hf; any TP degree, --dp, --kv-heads and --impl, not --pp")
    g.add_argument("--save-hf-shard-size", default="50GB", metavar="SIZE",
                   help="--save-hf's largest safetensors file, as save_pretrained's max_shard_size (default 50GB)")
    g = p.add_argument_group("data")
    g.add_argument("--corpus", default=DEFAULT_CORPUS)
    g.add_argument("--tokenizer", choices=["byte", "char"], default="byte",
                   help="byte: vocab 256; char: the corpus's distinct characters")
    g.add_argument("--batch", type=int, default=8, help="global batch, split over the --dp ranks (default 8)")
    g.add_argument("--seq", type=int, default=128)
    g = p.add_argument_group("model")
    g.add_argument("--dim", type=int, default=128)
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--kv-heads", type=int, default=None,
                   help="key/value heads (default --heads); under --impl torch_tp fewer than the TP degree "
                        "work too (KVHeadColwiseParallel: each KV head on the ranks whose query heads read it)")
    g.add_argument("--no-loss-parallel", action="store_true",
                   help="all-gather the logits and use the plain cross entropy")
    g.add_argument("--experts", type=int, default=None, metavar="N",
                   help="make every layer's feed-forward a mixture of N SwiGLU experts with a linear router "
                        "(default: the dense feed-forward); --impl torch_tp only, not with --pp")
    g.add_argument("--top-k", type=int, default=2, metavar="K",
                   help="experts per token under --experts, their router probabilities renormalized to sum to 1 "
                        "(default 2)")
    g.add_argument("--ep", type=int, default=1,
                   help="expert-parallel degree under --experts: the experts split whole over N of the --dp "
                        "ranks (N must divide --dp and --experts), data parallel over the other --dp / N; "
                        "the rest of the model stays data parallel over all --dp ranks (default 1)")
    g = p.add_argument_group("optimizer")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--warmup", type=int, default=10)
    g.add_argument("--weight-decay", type=float, default=0.1)
    args = p.parse_args(argv)
    if args.save_hf is not None and args.pp > 1:
        p.error(f"--save-hf with --pp {args.pp}: each pipeline rank holds only its stages, and a Hugging Face "
                "directory is written from the whole model; train without --pp (or --resume its checkpoint "
                "without --pp) to export")
    if args.save_hf is not None and args.check:
        p.error("--save-hf with --check: --check trains no model to write")
    check_moe_args(p, args)
    return args


def check_moe_args(p, args) -> None:
    """The combinations of --experts, --top-k and --ep that run, or parser errors naming the options;
    the ones that need the world size are in main."""
    if args.experts is None:
        if args.ep != 1:
            p.error(f"--ep {args.ep} needs --experts: expert parallelism splits the experts of a mixture of experts")
        return
    if args.experts < 1:
        p.error(f"--experts {args.experts} must be at least 1")
    if not 1 <= args.top_k <= args.experts:
        p.error(f"--top-k {args.top_k} must be between 1 and --experts ({args.experts})")
    if args.ep < 1 or args.experts % args.ep:
        p.error(f"--ep {args.ep} must divide --experts ({args.experts}): each expert-parallel rank holds "
                "--experts / --ep whole experts")
    if args.ep > 1 and args.dp % args.ep:
        p.error(f"--ep {args.ep} must divide --dp ({args.dp}): the expert-parallel ranks are carved out of the "
                "data-parallel ones")
    refused = [
        ("--pp", args.pp > 1, "pipeline stages of the mixture-of-experts model are not supported"),
        ("--impl torch", args.impl == "torch",
         "torch has no styles for experts (ExpertsTensorParallel, ExpertParallel are torch_tp's): use --impl torch_tp"),
        ("--save-hf", args.save_hf is not None, "the Hugging Face export writes a dense LlamaForCausalLM"),
        ("--check", args.check, "--check compares the dense model with its unsharded copy"),
    ]
    for option, hit, why in refused:
        if hit:
            p.error(f"--experts with {option}: {why}")


# ----------------------------------------------------------------------------- data


class Corpus:
    """The corpus as one token tensor, split 90/10 into train and validation;
    batches are a pure function of (seed, split, step), so every rank draws
    the same batch and a resumed run continues the same sequence."""

    def __init__(self, path: str, tokenizer: str):
        with open(path, "rb") as f:
            raw = f.read()
        if tokenizer == "byte":
            self.vocab_size = 256
            self.decode_table = None
            tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        else:
            text = raw.decode("utf-8")
            chars = sorted(set(text))
            self.vocab_size = len(chars)
            self.decode_table = chars
            index = {c: i for i, c in enumerate(chars)}
            tokens = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.tokenizer = tokenizer
        self.stoi = None if tokenizer == "byte" else {c: i for i, c in enumerate(self.decode_table)}
        split = int(0.9 * tokens.numel())
        self.train, self.val = tokens[:split], tokens[split:]

    def encode(self, text: str) -> List[int]:
        if self.stoi is None:
            return list(text.encode("utf-8"))
        return [self.stoi[c] for c in text if c in self.stoi]

    def decode(self, ids: List[int]) -> str:
        if self.decode_table is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return "".join(self.decode_table[i] for i in ids)

    def batch(self, split: str, step: int, batch: int, seq: int, seed: int):
        data = self.train if split == "train" else self.val
        if data.numel() < seq + 2:
            raise ValueError(f"the {split} split has {data.numel()} tokens, too few for --seq {seq}")
        gen = torch.Generator().manual_seed(seed * 1_000_003 + (0 if split == "train" else 7_777_777) + step)
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        rows = torch.stack([data[s: s + seq + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]


# ----------------------------------------------------------------------------- checkpoint

CKPT_SUBDIR = "checkpoint"
TRAIN_STATE = "train_state.json"


def _state_dict_options():
    # Flattened optimizer state: keys per parameter FQN ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr")
    # rather than lists of parameter groups, so the state of pipeline stages, each with its own
    # optimizer, adds up to the same keys as one optimizer of the whole model (any --pp loads it).
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _get_state(parts):
    """Per (model, optimizer) part: its model and optimizer state dicts, keyed by full-model FQNs."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return [get_state_dict(model, optimizer, options=_state_dict_options()) for model, optimizer in parts]


def save_checkpoint(out_dir: str, parts, step: int, meta: Dict[str, Any]) -> str:
    """Write the model and optimizer state with torch.distributed.checkpoint into
    ``checkpoint/``, and the rest (step, losses, configuration) into its
    ``train_state.json``.

    Every parameter is a DTensor (torch_tp's and torch's TP, FSDP2), so DCP
    records each one's global shape and which piece every rank holds, and a
    checkpoint loads at another TP or data-parallel degree. ``parts`` are this rank's
    (model, optimizer) pairs, one per pipeline stage; their state dicts use the full
    model's FQNs, so the merged dicts are the same keys at any --pp. It goes to
    ``checkpoint.tmp/`` first and replaces ``checkpoint/`` once complete: a crash
    mid-write leaves the previous checkpoint intact.
    """
    import shutil

    import torch.distributed.checkpoint as dcp

    ckpt_dir = os.path.join(out_dir, CKPT_SUBDIR)
    tmp_dir = ckpt_dir + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    dist.barrier()
    model_state, optim_state = {}, {}
    for part_model, part_optim in _get_state(parts):
        model_state.update(part_model)
        optim_state.update(part_optim)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp_dir)
    if dist.get_rank() == 0:
        with open(os.path.join(tmp_dir, TRAIN_STATE), "w") as f:
            json.dump({**meta, "step": step}, f)
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        os.replace(tmp_dir, ckpt_dir)
    dist.barrier()
    return ckpt_dir


def load_checkpoint(out_dir: str, parts, expect: Dict[str, Any]) -> Dict[str, Any]:
    """Restore what :func:`save_checkpoint` wrote into the (model, optimizer) ``parts``, resharded
    to this run's layout; return train_state.json. Refuses a checkpoint of another model
    configuration or tokenizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    ckpt_dir = os.path.join(out_dir, CKPT_SUBDIR)
    path = os.path.join(ckpt_dir, TRAIN_STATE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"--resume: no checkpoint in {ckpt_dir} ({TRAIN_STATE} is missing)")
    with open(path) as f:
        state = json.load(f)
    for key, want in expect.items():
        if state.get(key) != want:
            raise RuntimeError(f"--resume: {ckpt_dir} has {key}={state.get(key)!r}, this run {want!r}")
    states = _get_state(parts)
    model_state = {k: v for part_model, _ in states for k, v in part_model.items()}
    optim_state = {k: v for _, part_optim in states for k, v in part_optim.items()}
    # dcp.load fills the tensors in place and replaces the other values (the step, the lr) in these dicts.
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=ckpt_dir)
    for (model, optimizer), (part_model, part_optim) in zip(parts, states):
        set_state_dict(model, optimizer, model_state_dict={k: model_state[k] for k in part_model},
                       optim_state_dict={k: optim_state[k] for k in part_optim}, options=_state_dict_options())
    return state


# ----------------------------------------------------------------------------- Hugging Face export


def hf_config(config: LlamaConfig):
    """transformers' LlamaConfig of the example's model: the same sizes, norm epsilon, rotary base and
    untied output; no bos/eos/pad ids (the byte and char tokenizers have none, and an eos id would
    stop HF's generate() at that byte)."""
    from transformers import LlamaConfig as HFLlamaConfig

    return HFLlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.ffn_hidden_dim,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads, head_dim=config.head_dim, hidden_act="silu",
        max_position_embeddings=config.max_seq_len, rms_norm_eps=config.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)


# The example's (torchtitan's) names -> HF Llama's, per layer and at the top.
HF_LAYER_NAMES = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
HF_TOP_NAMES = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}


def hf_name(name: str, config: LlamaConfig):
    """(HF Llama's name of the example's parameter ``name``, the heads whose rows to reorder or None)."""
    module, leaf = name.rsplit(".", 1)
    if module in HF_TOP_NAMES:
        return f"{HF_TOP_NAMES[module]}.{leaf}", None
    _, index, rest = module.split(".", 2)  # layers.<N>.<rest>
    heads = {"attention.wq": config.n_heads, "attention.wk": config.n_kv_heads}.get(rest)
    return f"model.layers.{index}.{HF_LAYER_NAMES[rest]}.{leaf}", heads


def to_rotate_half(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """wq/wk ``[heads * head_dim, dim]`` with each head's output features reordered from this
    model's interleaved rotary pairs (2i, 2i + 1) to HF rotate_half's (i, head_dim / 2 + i).

    Both rotate pair i by position * freq_i (the same frequencies): here features 2i and 2i + 1
    of a head, in HF's rotate_half features i and i + head_dim / 2. So HF's feature
    (half, i) is this model's feature 2i + half: rows viewed [heads, head_dim / 2, 2], the last
    two dims swapped. q and k get the same reordering, so every head's q . k, and so the
    attention, is unchanged; v and wo are not touched."""
    rows, dim = weight.shape
    return weight.view(heads, rows // heads // 2, 2, dim).transpose(1, 2).reshape(rows, dim)


@torch.no_grad()
def save_hf(model: Llama, config: LlamaConfig, mesh, path: str, device, max_shard_size: str) -> None:
    """Write ``model`` (parallelized, possibly under FSDP2) as a Hugging Face LlamaForCausalLM directory.

    A LlamaForCausalLM of :func:`hf_config` is built on the meta device, parallelized by torch_tp
    with its own ``tp_plan`` on the TP ``mesh`` and given storage; then, one parameter at a time,
    every rank gathers the example's full tensor (reordered for HF's rotary layout), keeps its own
    piece of the HF parameter (``load_full_state_dict`` cuts it from the placements, no
    communication) and drops the full tensor. ``torch_tp.parallel.save_pretrained`` then writes the
    directory, gathering one tensor at a time. A collective: every rank calls it."""
    import torch_tp
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config(config), dtype=torch.float32)
    torch_tp.parallelize_module(hf, mesh, hf.tp_plan)
    hf.to_empty(device=device)  # every parameter is filled below; the rotary buffer is not saved
    wanted = {name for name, _ in hf.named_parameters()}
    for name, param in model.named_parameters():
        key, heads = hf_name(name, config)
        wanted.remove(key)  # a KeyError here: a name HF's Llama does not have
        full = to_full(param.detach())
        if heads is not None:
            full = to_rotate_half(full, heads)
        module, leaf = key.rsplit(".", 1)
        torch_tp.load_full_state_dict(hf.get_submodule(module), {leaf: full.to(device)}, strict=False)
        del full
    if wanted:
        raise RuntimeError(f"--save-hf: the example's model has nothing for HF's {sorted(wanted)}")
    torch_tp.parallel.save_pretrained(hf, path, max_shard_size=max_shard_size)


# ----------------------------------------------------------------------------- progress and plot


class Progress:
    """A one-line progress bar on stderr (rank 0). When stderr is not a terminal
    (a log file, CI) it prints a plain line every ~5% instead."""

    def __init__(self, total: int, start: int, enabled: bool, width: int = 24):
        self.total, self.start, self.enabled, self.width = total, start, enabled, width
        self.tty = sys.stderr.isatty()
        self.every = max(1, (total - start) // 20)
        self.t0 = time.perf_counter()

    def update(self, step: int, loss: float, tok_s: float):
        if not self.enabled:
            return
        frac = step / max(1, self.total)
        filled = int(self.width * frac)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self.t0
        done = step - self.start
        eta = elapsed / done * (self.total - step) if done else 0.0
        line = (f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] {100 * frac:3.0f}%  "
                f"loss {loss:.4f}  {tok_s:,.0f} tok/s  eta {int(eta) // 60}:{int(eta) % 60:02d}")
        if self.tty:
            sys.stderr.write("\r" + line)
            sys.stderr.flush()
        elif done % self.every == 0 or step == self.total or done == 1:
            print(line, file=sys.stderr, flush=True)

    def close(self):
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


def plot_losses(path: str, losses: List[float], val: Optional[float], title: str) -> bool:
    """Write the loss curve to ``path`` (PNG); False, with a note, when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print("loss curve: skipped, matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(losses) + 1))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, losses, lw=0.8, alpha=0.45, label="train loss (per step)")
    window = max(1, len(losses) // 20)
    if window > 1:
        smooth = [sum(losses[max(0, i - window + 1): i + 1]) / len(losses[max(0, i - window + 1): i + 1])
                  for i in range(len(losses))]
        ax.plot(steps, smooth, lw=1.8, label=f"train loss ({window}-step mean)")
    if val is not None:
        ax.scatter([len(losses)], [val], color="C3", zorder=3, label=f"validation loss {val:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats / token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- training


def lr_at(step: int, args) -> float:
    """Linear warmup, then cosine decay to 10% at --steps (a function of the step only: resumable)."""
    if step < args.warmup:  # (never true for warmup 0)
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def scalar(loss) -> float:
    return to_full(loss).item()


def grad_norm(parts, pp_mesh, device) -> List[float]:
    """[the L2 norm of the whole model's gradient, that of the experts' parameters alone]
    (--log-grad-norm), the same numbers at every layout: each parameter's sum of squares from its
    DTensor gradient (whatever its mesh and placements: TP shards, FSDP2 shards, experts split over
    ep, partial sums), completed by ``full_tensor()``, and the pipeline stages' sums added over "pp".
    A collective: every rank calls it."""
    sums = torch.zeros(2, dtype=torch.float64)
    for part, _ in parts:
        for name, param in part.named_parameters():
            if param.grad is not None:
                square = to_full(param.grad.detach().double().pow(2).sum()).item()
                sums += torch.tensor([square, square if ".experts." in name else 0.0], dtype=torch.float64)
    if pp_mesh.size() > 1:
        sums = sums.to(device)
        dist.all_reduce(sums, group=pp_mesh.get_group())
    return sums.sqrt().tolist()


def dp_mean(value: float, dp_mesh, device) -> float:
    """The mean of a per-rank loss over the data-parallel ranks (the global batch's loss)."""
    if dp_mesh.size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=dp_mesh.get_group())
    return t.item() / dp_mesh.size()


# ----------------------------------------------------------------------------- pipeline


def pipeline_stage_ids(schedule: str, pp_rank: int, pp: int, per_rank: int) -> List[int]:
    """The stages a pipeline rank runs: ZBV's V (rank and 2 pp - 1 - rank, so rank 0 holds the
    first and the last), the others looped (rank, rank + pp, ...), as torchtitan places them."""
    if schedule == "ZBVZeroBubble":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(per_rank)]


def cut_stage(model: Llama, stage: int, n_stages: int) -> Llama:
    """A copy of ``model`` that holds only stage ``stage`` of ``n_stages``: the units (embedding,
    each block, norm + output, which torchtitan weighs as one block each) split evenly in order;
    the parts it lacks are None (Llama.forward skips them), the blocks it lacks are deleted, and
    the rest keep their names, so state dicts and checkpoints see the full model's FQNs."""
    units = ["tok_embeddings", *(f"layers.{name}" for name in model.layers), "norm+output"]
    mine = units[stage * len(units) // n_stages: (stage + 1) * len(units) // n_stages]
    part = copy.deepcopy(model)
    if "tok_embeddings" not in mine:
        part.tok_embeddings = None
    for name in list(part.layers):
        if f"layers.{name}" not in mine:
            del part.layers[name]
    if "norm+output" not in mine:
        part.norm, part.output = None, None
    return part


def stage_plan(plan: Dict[str, Any], part: Llama) -> Dict[str, Any]:
    """The entries of the TP plan for the modules a stage's model holds (parallelize_module
    warns about a key that matches nothing)."""
    def held(key: str) -> bool:
        top = key.split(".")[0]
        return getattr(part, top) is not None and (top != "layers" or len(part.layers) > 0)

    return {key: style for key, style in plan.items() if held(key)}


def build_schedule(parts, stage_ids: List[int], n_stages: int, args, pp_mesh, device, microbatches: int):
    """torch.distributed.pipelining's stages of this rank's parts and the --pp-schedule that runs them;
    its loss is the example's cross entropy (vocab-parallel under loss_parallel, entered around step)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    stages = [PipelineStage(part, i, n_stages, device, group=pp_mesh.get_group())
              for part, i in zip(parts, stage_ids)]
    single = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}
    multi = {"Interleaved1F1B": ScheduleInterleaved1F1B, "ZBVZeroBubble": ScheduleZBVZeroBubble}
    # The loss is each micro-batch's mean and the schedule divides the summed gradients by the
    # number of micro-batches (scale_grads), so the gradients are the whole batch's mean's.
    if args.pp_schedule in single:
        return single[args.pp_schedule](stages[0], n_microbatches=microbatches, loss_fn=cross_entropy_loss)
    return multi[args.pp_schedule](stages, n_microbatches=microbatches, loss_fn=cross_entropy_loss)


def pipeline_loss(schedule, pipe, inputs, targets, pp_mesh, device, train: bool) -> float:
    """One step (train: forward and backward; else forward only) of the schedule over the batch;
    the batch's loss, the mean of the micro-batches' losses on the last stage, on every rank.
    ``pipe["has_first"]``, ``pipe["has_last"]``: whether this rank runs the first, the last stage."""
    losses: List[torch.Tensor] = []
    run = schedule.step if train else schedule.eval
    if pipe["has_first"]:
        run(inputs, target=targets, losses=losses)
    else:
        run(target=targets, losses=losses)
    value = sum(scalar(loss) for loss in losses) / len(losses) if pipe["has_last"] else 0.0
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=pp_mesh.get_group())  # only the last stage's ranks add a nonzero value
    return t.item()


@torch.no_grad()
def evaluate(model, corpus: Corpus, args, device, tp, schedule, pipe, pp_mesh, batches: int = 4) -> float:
    total = 0.0
    for i in range(batches):
        inputs, targets = corpus.batch("val", i, args.batch, args.seq, args.seed)
        inputs, targets = inputs.to(device), targets.to(device)
        with loss_context(tp, not args.no_loss_parallel), autocast(args, device):
            if schedule is None:
                total += scalar(cross_entropy_loss(model(inputs), targets))
            else:
                total += pipeline_loss(schedule, pipe, inputs, targets, pp_mesh, device, train=False)
    return total / batches


@torch.no_grad()
def sample(model, corpus: Corpus, args, device, n: int) -> Optional[str]:
    """Generate n tokens from a training prompt, sampling at temperature 0.8.
    Every rank runs the same forward (TP); rank 0's choice is broadcast so all agree."""
    window = min(args.seq, 64)  # a sliding window, no KV cache: each token costs one forward of it
    prompt, _ = corpus.batch("train", 10**9, 1, window, args.seed)
    ids = prompt[0].tolist()
    gen = torch.Generator().manual_seed(args.seed)
    for _ in range(n):
        logits = to_full(model(torch.tensor([ids[-window:]], device=device)))[0, -1].float().cpu()
        # An implementation whose logits do not gather to the full vocabulary: give up on every rank at once.
        ok = torch.tensor([int(logits.numel() == corpus.vocab_size)], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not ok.item():
            return None
        token = torch.multinomial(torch.softmax(logits / 0.8, dim=-1), 1, generator=gen)
        token = token.to(device)
        dist.broadcast(token, src=0)
        ids.append(int(token))
    return corpus.decode(ids[window:])


def autocast(args, device):
    if args.amp and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def setup(args):
    if "RANK" not in os.environ:
        sys.exit("train_llama.py: launch it with torchrun, e.g. "
                 "`torchrun --nproc-per-node 2 examples/train_llama.py --impl torch`")
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    kind = args.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= local_world else "cpu"
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = args.backend or ("nccl" if kind == "cuda" else "torch_tp")
    if backend == "torch_tp":
        import torch_tp  # noqa: F401  (registers the backend, whichever --impl runs on it)
    dist.init_process_group(backend, device_id=device if kind == "cuda" else None)
    return device, backend


def main(argv=None):
    args = parse_args(argv)
    try:  # before any process group: every rank says why and exits at once (torchrun stops the others)
        tp = load_tp_api(args.impl)
        if args.save_hf is not None:
            import torch_tp  # noqa: F401  (parallelizes and writes the Hugging Face model, whichever --impl)
            try:
                import transformers  # noqa: F401
            except ImportError as e:
                raise ImportError(f"--save-hf needs transformers (pip install transformers): {e}") from e
    except ImportError as e:
        print(f"train_llama.py: {e}", file=sys.stderr)
        sys.exit(2)
    device, backend = setup(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0

    from torch.distributed.device_mesh import init_device_mesh

    def refuse(message: str):
        if is_main:
            print(f"train_llama.py: {message}", file=sys.stderr)
        dist.destroy_process_group()
        sys.exit(2)

    if args.pp < 1 or world % args.pp:
        refuse(f"--pp {args.pp} must divide the world size ({world})")
    pp_world = world // args.pp  # the ranks of one pipeline stage: dp x tp
    if args.dp < 1 or pp_world % args.dp or args.batch % args.dp:
        size = f"the world size ({world})" if args.pp == 1 else f"the world size / --pp ({pp_world})"
        refuse(f"--dp {args.dp} must divide {size} and --batch ({args.batch})")
    rows = args.batch // args.dp  # each dp rank's share of the batch
    per_rank = args.pp_stages_per_rank or (1 if args.pp_schedule in ("GPipe", "1F1B") else 2)
    n_stages = args.pp * per_rank
    microbatches = args.microbatches or n_stages
    if args.pp > 1:
        fits = {"GPipe": per_rank == 1, "1F1B": per_rank == 1, "Interleaved1F1B": per_rank >= 2,
                "ZBVZeroBubble": per_rank == 2}
        if not fits[args.pp_schedule]:
            refuse(f"--pp-schedule {args.pp_schedule} cannot run {per_rank} stages per rank "
                   "(GPipe, 1F1B: 1; Interleaved1F1B: 2 or more; ZBVZeroBubble: 2)")
        if n_stages > args.layers + 2:
            refuse(f"--pp {args.pp} x {per_rank} stages per rank makes {n_stages} stages, more than the "
                   f"{args.layers} layers + embedding + output that a stage can hold")
        if microbatches < 1 or rows % microbatches:
            refuse(f"--microbatches {microbatches} must divide --batch / --dp ({rows})")
    tp_degree = pp_world // args.dp
    if args.ep == 1:
        mesh_3d = init_device_mesh(device.type, (args.pp, args.dp, tp_degree), mesh_dim_names=("pp", "dp", "tp"))
        mesh, dp_mesh, pp_mesh = mesh_3d["tp"], mesh_3d["dp"], mesh_3d["pp"]
    else:
        # torchtitan's carving: dp = (dp / ep) x ep, the dp rank d being (d // ep, d % ep), so every
        # layout of the same --dp gives rank d the same rows of the batch. "dp" (flattened) for the
        # non-expert parameters and the batch, "ep" for the experts, "dp_mod_ep" for their FSDP2.
        mesh_4d = init_device_mesh(device.type, (args.pp, args.dp // args.ep, args.ep, tp_degree),
                                   mesh_dim_names=("pp", "dp_mod_ep", "ep", "tp"))
        mesh, pp_mesh = mesh_4d["tp"], mesh_4d["pp"]
        dp_mesh = mesh_4d["dp_mod_ep", "ep"]._flatten("dp")

    if args.check:
        results = check_tp_against_reference(mesh, tp, device=device.type, loss_parallel=not args.no_loss_parallel)
        if is_main:
            for i, (got, want) in enumerate(results):
                print(f"check step {i}: TP loss {got:.7f}  unsharded {want:.7f}  rel. diff {abs(got - want) / want:.1e}")
            print(f"check OK: --impl {args.impl}, {world} ranks")
        dist.destroy_process_group()
        return

    corpus = Corpus(args.corpus, args.tokenizer)
    config = LlamaConfig(vocab_size=corpus.vocab_size, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                         n_kv_heads=args.kv_heads, max_seq_len=args.seq, n_experts=args.experts, top_k=args.top_k)
    check_tp_degree(config, mesh.size(), tp)
    if args.experts is not None and config.ffn_hidden_dim % mesh.size():
        refuse(f"--experts with TP degree {mesh.size()}: each expert's intermediate size {config.ffn_hidden_dim} "
               "(from --dim) must be divisible by it")

    torch.manual_seed(args.seed)  # the same init on every rank; parallelize_module keeps rank 0's
    model = Llama(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    # The models this rank trains: the whole model, or under --pp its stages, cut from the same
    # initialised model, so every layout starts from the same weights.
    schedule, pipe = None, {}
    if args.pp > 1:
        stage_ids = pipeline_stage_ids(args.pp_schedule, pp_mesh.get_local_rank(), args.pp, per_rank)
        models = [cut_stage(model, i, n_stages) for i in stage_ids]
        pipe = {"has_first": 0 in stage_ids, "has_last": n_stages - 1 in stage_ids}
    else:
        models = [model]
    moe = args.experts is not None
    plan = tp_plan(tp, loss_parallel=not args.no_loss_parallel, n_kv_heads=config.n_kv_heads, moe=moe,
                   experts_tp=args.ep == 1)
    for part in models:
        if args.ep > 1:  # the experts first, on their own mesh; the TP plan below leaves them as they are
            experts_mesh, style = ((mesh_4d["ep", "tp"], tp.ExpertTensorParallel()) if mesh.size() > 1
                                   else (mesh_4d["ep"], tp.ExpertParallel()))
            tp.parallelize_module(part, experts_mesh, {"layers.*.feed_forward.experts": style})
        tp.parallelize_module(part, mesh, stage_plan(plan, part) if args.pp > 1 else plan)
        if args.dp > 1:
            # torchtitan's 2-D recipe: FSDP2 over "dp" of every block, then of the root,
            # on top of the TP DTensor parameters.
            from torch.distributed.fsdp import fully_shard

            for block in part.layers.values():
                if args.ep > 1:
                    # NOTE [gradients of expert-parallel experts]: each ep rank's experts get the
                    # gradients of every ep rank's tokens (the all-to-all's backward), summed; FSDP2
                    # over the dp / ep ranks holding the same experts adds the rest, and dividing by
                    # --dp, not by dp / ep, makes them the global batch's mean, as every other
                    # gradient (torchtitan's set_gradient_divide_factor). Over 2 or more ranks a sum
                    # reduction and a division after it: a factor other than the group's size is
                    # otherwise NCCL's PREMUL_SUM, which gloo and torch_tp's backend do not have. Not
                    # over one rank (--ep = --dp), where torch 2.15's FSDP2 would divide twice.
                    experts = fully_shard(block.feed_forward.experts, mesh=mesh_4d["dp_mod_ep"])
                    experts.set_gradient_divide_factor(float(args.dp))
                    experts.set_force_sum_reduction_for_comms(args.dp > args.ep)
                fully_shard(block, mesh=dp_mesh)
            fully_shard(part, mesh=dp_mesh)
    parts = [(part, make_optimizer(part, args.lr, args.weight_decay)) for part in models]
    if args.pp > 1:
        schedule = build_schedule(models, stage_ids, n_stages, args, pp_mesh, device, microbatches)

    # What a resumed run must share with the checkpoint; --impl, --dp and the TP degree may differ.
    meta = {"config": config.to_dict(), "tokenizer": args.tokenizer}
    start, losses, tok_rates = 0, [], []
    if args.resume:
        state = load_checkpoint(args.out_dir, parts, meta)
        start, losses, tok_rates = state["step"], list(state["losses"]), list(state.get("tok_rates", []))
    if is_main:
        os.makedirs(args.out_dir, exist_ok=True)
        moe_text = f", {config.n_experts} experts, top-{config.top_k}" if moe else ""
        layout = f"TP {mesh.size()}" + (f" x FSDP2 {args.dp}" if args.dp > 1 else "")
        if args.ep > 1:
            layout += f" (experts: EP {args.ep} x FSDP2 {args.dp // args.ep})"
        if args.pp > 1:
            layout = (f"PP {args.pp} ({args.pp_schedule}, {n_stages} stages, {microbatches} micro-batches) x "
                      + layout)
        print(f"train_llama: --impl {args.impl}, {world} ranks ({layout}) on {device.type} ({backend}), "
              f"torch {torch.__version__}; "
              f"model {n_params / 1e6:.2f}M params (dim {config.dim}, {config.n_layers} layers, {config.n_heads} heads, "
              f"vocab {config.vocab_size}{moe_text}), batch {args.batch} x seq {args.seq}, corpus {corpus.train.numel():,} "
              f"train tokens" + (f"; resumed at step {start}" if args.resume else ""), flush=True)

    tokens_per_step = args.batch * args.seq  # the global batch; each dp rank takes args.batch // args.dp rows
    dp_rows = slice(dp_mesh.get_local_rank() * rows, (dp_mesh.get_local_rank() + 1) * rows)
    end = args.steps if args.stop_after is None else max(start, min(args.steps, args.stop_after))
    progress = Progress(args.steps, start, is_main)
    grad_norms: List[List[float]] = []  # this run's steps, under --log-grad-norm: [whole model, experts]
    for step in range(start, end):
        t0 = time.perf_counter()
        for _, optimizer in parts:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, args)
        inputs, targets = corpus.batch("train", step, args.batch, args.seq, args.seed)
        inputs, targets = inputs[dp_rows].to(device), targets[dp_rows].to(device)
        with loss_context(tp, not args.no_loss_parallel):
            if schedule is None:
                with autocast(args, device):
                    loss = cross_entropy_loss(model(inputs), targets)
                loss.backward()
                value = scalar(loss)
            else:
                with autocast(args, device):
                    value = pipeline_loss(schedule, pipe, inputs, targets, pp_mesh, device, train=True)
        if args.log_grad_norm:
            grad_norms.append(grad_norm(parts, pp_mesh, device))
        for _, optimizer in parts:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        value = dp_mean(value, dp_mesh, device)  # syncs the device, so the step time is real
        dt = time.perf_counter() - t0
        if not math.isfinite(value):
            raise FloatingPointError(f"step {step + 1}: loss is {value}")
        losses.append(value)
        tok_rates.append(tokens_per_step / dt)
        progress.update(step + 1, value, tok_rates[-1])
        done = step + 1
        if args.ckpt_every and done % args.ckpt_every == 0 and done < end:
            save_checkpoint(args.out_dir, parts, done,
                            {**meta, "impl": args.impl, "losses": losses, "tok_rates": tok_rates})
    progress.close()

    ckpt_dir = save_checkpoint(args.out_dir, parts, end,
                               {**meta, "impl": args.impl, "losses": losses, "tok_rates": tok_rates})
    if args.save_hf is not None:  # before any forward: FSDP2 keeps the root's parameters unsharded after one
        save_hf(model, config, mesh, args.save_hf, device, args.save_hf_shard_size)
    # torch 2.14's ZBV schedule runs its backward actions in eval() too (and fails): no validation loss there.
    zbv = args.pp > 1 and args.pp_schedule == "ZBVZeroBubble"
    val = None if zbv else evaluate(model, corpus, args, device, tp, schedule, pipe, pp_mesh)
    text = sample(model, corpus, args, device, args.sample) if args.sample > 0 and args.pp == 1 else None

    if is_main:
        # Step 1 pays one-time costs (allocations, first collectives): leave it out of the mean,
        # which is all tokens over all time (not the mean of per-step rates).
        rates = tok_rates[1:] if len(tok_rates) > 1 else tok_rates
        mean_rate = len(rates) * tokens_per_step / sum(tokens_per_step / r for r in rates) if rates else float("nan")
        title = (f"Llama {n_params / 1e6:.2f}M, --impl {args.impl}, {layout} on {device.type}, "
                 f"{mean_rate:,.0f} tokens/s")
        plotted = plot_losses(os.path.join(args.out_dir, "loss_curve.png"), losses, val, title)
        with open(os.path.join(args.out_dir, "metrics.json"), "w") as f:
            json.dump({"impl": args.impl, "world_size": world, "pp": args.pp,
                       "pp_schedule": args.pp_schedule if args.pp > 1 else None, "dp": args.dp, "tp": mesh.size(),
                       "ep": args.ep,
                       "device": device.type, "backend": backend,
                       "torch": torch.__version__, "config": config.to_dict(), "batch": args.batch,
                       "seq": args.seq, "steps": end, "losses": losses, "tokens_per_s": tok_rates,
                       "mean_tokens_per_s": mean_rate, "val_loss": val,
                       **({"grad_norms": [total for total, _ in grad_norms]} if args.log_grad_norm else {}),
                       **({"expert_grad_norms": [e for _, e in grad_norms]} if args.log_grad_norm and moe else {}),
                       **({"experts": config.n_experts, "top_k": config.top_k} if moe else {})}, f, indent=1)
        if text is not None:
            print("sample: " + repr(text[:400]))
        elif args.sample > 0 and args.pp > 1:
            print("sample: skipped under --pp > 1 (generation would have to run through the pipeline)")
        elif args.sample > 0:
            print("sample: skipped (the model's logits are not gatherable to the full vocabulary)")
        written = ([f"{args.out_dir}/loss_curve.png"] if plotted else []) + [f"{args.out_dir}/metrics.json",
                                                                          f"{ckpt_dir}/ (DCP)"]
        if args.save_hf is not None:
            written.append(f"{args.save_hf}/ (Hugging Face LlamaForCausalLM)")
        print("wrote " + ", ".join(written))
        if zbv:
            print("validation loss: skipped under --pp-schedule ZBVZeroBubble (torch's schedule cannot run "
                  "forward only)")
        first = losses[0] if losses else float("nan")
        val_text = "n/a" if val is None else f"{val:.4f}"
        print(f"final: step {end}  loss {losses[-1] if losses else float('nan'):.4f} (step 1: {first:.4f})  "
              f"val loss {val_text}  mean {mean_rate:,.0f} tokens/s  (--impl {args.impl}, {layout}, {device.type})",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
