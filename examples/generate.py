"""Generate text with tensor parallelism and a KV cache, from the main job's checkpoint or a Hugging Face model.

Launch with torchrun, as the main job (examples/train_llama.py); the TP degree is the number of ranks,
whatever degree, --dp or --pp trained the checkpoint:

    torchrun --nproc-per-node 2 examples/train_llama.py --out-dir runs/x            # train, writes runs/x/checkpoint/
    torchrun --nproc-per-node 4 examples/generate.py --out-dir runs/x                # generate at TP 4
    torchrun --nproc-per-node 1 examples/generate.py --out-dir runs/x --impl torch   # torch's DTensor TP, TP 1
    torchrun --nproc-per-node 2 examples/generate.py --out-dir runs/x --prompt "The lighthouse" \\
        --max-new-tokens 64 --temperature 0.8 --top-k 20 --seed 1                    # sampling
    torchrun --nproc-per-node 2 examples/generate.py --hf path/to/model --prompt-ids 1,2,3  # a Hugging Face model

From the main job's checkpoint (--out-dir): every rank rebuilds the model from
checkpoint/train_state.json, parallelizes it with the example's TP plan for
inference (llama_model.tp_plan without sequence parallelism or loss_parallel:
whole sequences, logits gathered to every rank) and loads only the model's
weights from the DCP checkpoint, resharded to this TP degree (DCP reads the
global layout from the DTensor parameters; the optimizer state is not read).
Generation runs one forward of the prompt (prefill), then one forward per new
token against llama_model.KVCache, which keeps each rank's own KV heads.

With --hf DIR: a causal LM saved with ``save_pretrained`` in DIR (no downloads),
parallelized with torch_tp and the model's own ``tp_plan``, generating with its
own ``generate()`` and KV cache.

Greedy by default (--temperature 0); with a temperature, sampling (--top-k, --seed).
Every rank computes the same replicated logits; rank 0's token is broadcast so all
ranks continue from the same sequence. Rank 0 prints the prompt and the continuation,
then the prefill time, the decode time per token (median, mean) and decode tokens/s;
--json PATH writes them with the token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_model import (  # noqa: E402
    KVCache,
    Llama,
    LlamaConfig,
    check_tp_degree,
    load_tp_api,
    precompute_rope,
    tp_plan,
)
from train_llama import CKPT_SUBDIR, DEFAULT_CORPUS, TRAIN_STATE, Corpus, setup  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--out-dir", default="llama_out",
                   help="the main job's --out-dir: reads its checkpoint/ (default ./llama_out)")
    g.add_argument("--hf", metavar="DIR", default=None,
                   help="a Hugging Face causal LM saved with save_pretrained in DIR, instead of --out-dir's checkpoint")
    g.add_argument("--impl", choices=["torch_tp", "torch"], default="torch_tp",
                   help="tensor-parallel implementation for --out-dir's model (default torch_tp; --hf needs "
                        "torch_tp)")
    g.add_argument("--corpus", default=DEFAULT_CORPUS,
                   help="the corpus the main job trained on: its tokenizer (default the example's corpus)")
    g.add_argument("--dtype", choices=list(DTYPES), default="float32",
                   help="weights' dtype, cast after loading (default float32)")
    g = p.add_argument_group("run")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda when there is a GPU per local rank, else cpu")
    g.add_argument("--backend", default=None,
                   help="process-group backend (default: torch_tp's shared-memory backend on cpu, nccl on cuda; "
                        "gloo works too)")
    g = p.add_argument_group("generation")
    g.add_argument("--prompt", default=None,
                   help="prompt text (default: the corpus's first line, at most half of max_seq_len tokens; "
                        "with --hf, 8 random ids from --seed); with --hf it needs a tokenizer in DIR")
    g.add_argument("--prompt-ids", default=None, metavar="I,J,...",
                   help="prompt as comma-separated token ids, instead of --prompt")
    g.add_argument("--max-new-tokens", type=int, default=100,
                   help="tokens to generate (default 100); the main job's model stops at its max_seq_len")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (default); > 0: sample from softmax(logits / T)")
    g.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens only")
    g.add_argument("--seed", type=int, default=0,
                   help="sampling seed, and the random prompt's under --hf without a prompt (default 0)")
    g.add_argument("--json", metavar="PATH", default=None,
                   help="rank 0 writes the token ids and timings to PATH")
    args = p.parse_args(argv)
    if args.temperature < 0:
        p.error(f"--temperature {args.temperature} must be >= 0")
    if args.top_k is not None and args.top_k < 1:
        p.error(f"--top-k {args.top_k} must be >= 1")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    if args.hf is not None and args.impl != "torch_tp":
        p.error(f"--impl {args.impl} with --hf: a Hugging Face tp_plan (style strings) needs --impl torch_tp")
    if args.prompt is not None and args.prompt_ids is not None:
        p.error("--prompt and --prompt-ids exclude each other")
    if args.prompt_ids is not None:
        try:
            args.prompt_ids = [int(part) for part in args.prompt_ids.split(",")]
        except ValueError:
            p.error(f"--prompt-ids {args.prompt_ids!r}: expected comma-separated integers")
    return args


def check_ids(ids: List[int], vocab_size: int) -> List[int]:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"--prompt-ids: {bad} outside the model's vocabulary [0, {vocab_size})")
    return ids


# ----------------------------------------------------------------------------- the main job's checkpoint


def read_train_state(out_dir: str) -> Dict:
    path = os.path.join(out_dir, CKPT_SUBDIR, TRAIN_STATE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"--out-dir {out_dir}: no checkpoint, {path} is missing "
                                "(train with examples/train_llama.py --out-dir first)")
    with open(path) as f:
        return json.load(f)


def load_model(args, state: Dict, mesh, tp, device) -> Llama:
    """The main job's Llama, parallelized for inference at TP = mesh size, with the checkpoint's weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    config = LlamaConfig(**state["config"])
    check_tp_degree(config, mesh.size(), tp)
    # Built on the meta device: the weights come from the checkpoint, so no rank initialises them.
    with torch.device("meta"):
        model = Llama(config)
    # The inference plan: whole sequences between the layers (a 1-token decode step cannot be
    # split over ranks), logits all-gathered to a plain tensor on every rank. The parameters are
    # the same DTensors as under the training plan, so DCP loads the checkpoint into them.
    tp.parallelize_module(model, mesh, tp_plan(tp, sequence_parallel=False, loss_parallel=False,
                                               n_kv_heads=config.n_kv_heads, moe=config.n_experts is not None))
    model.to_empty(device=device)
    # The rotary table is a non-persistent buffer (not in the checkpoint): compute it here.
    model.rope.copy_(precompute_rope(config.head_dim, config.max_seq_len, config.rope_theta))
    # Only the model's weights ("model.<fqn>" in the checkpoint); its optimizer state is not read.
    model_state = get_model_state_dict(model)
    dcp.load({"model": model_state}, checkpoint_id=os.path.join(args.out_dir, CKPT_SUBDIR))
    set_model_state_dict(model, model_state)
    if args.dtype != "float32":
        rope = model.rope  # the rotary table stays float32, as in training under autocast
        model.to(DTYPES[args.dtype])
        model.rope = rope
    return model.eval()


def default_prompt(corpus_path: str, corpus: Corpus, max_tokens: int) -> List[int]:
    """The corpus's first non-empty line, cut to max_tokens tokens."""
    with open(corpus_path, encoding="utf-8") as f:
        line = next((line.strip() for line in f if line.strip()), "")
    return corpus.encode(line)[:max_tokens]


def pick(logits: torch.Tensor, args, gen: torch.Generator) -> torch.Tensor:
    """The next token ``[1, 1]`` from the last position's logits ``[1, v]`` (greedy or sampled)."""
    if args.temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / args.temperature
    if args.top_k is not None:
        kth = torch.topk(logits, min(args.top_k, logits.size(-1)), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1).cpu(), 1, generator=gen).to(logits.device)


@torch.no_grad()
def generate(model: Llama, prompt: List[int], n: int, args, device):
    """Prefill, then one 1-token forward per new token against the KV cache.
    Returns the new ids, the prefill time and each decode step's time (seconds)."""
    gen = torch.Generator().manual_seed(args.seed)  # the same stream on every rank
    cache = KVCache(model.config.max_seq_len)
    tokens = torch.tensor([prompt], device=device)
    new, decode_s = [], []
    prefill_s = None
    for _ in range(n):
        t0 = time.perf_counter()
        logits = model(tokens, cache)[:, -1]  # [1, v]: replicated on every rank (the plan gathers them)
        token = pick(logits, args, gen)
        # Ranks agree already; the broadcast makes sure, and syncs the step so its time is complete.
        dist.broadcast(token, src=0)
        elapsed = time.perf_counter() - t0
        if prefill_s is None:
            prefill_s = elapsed
        else:
            decode_s.append(elapsed)
        new.append(int(token))
        tokens = token
    return new, prefill_s, decode_s


def run_checkpoint(args, mesh, device) -> Dict:
    tp = load_tp_api(args.impl)
    state = read_train_state(args.out_dir)
    corpus = Corpus(args.corpus, state["tokenizer"])
    config = LlamaConfig(**state["config"])
    if corpus.vocab_size != config.vocab_size:
        raise ValueError(f"--corpus {args.corpus} gives {corpus.vocab_size} {state['tokenizer']} tokens, the "
                         f"checkpoint's model has vocab_size={config.vocab_size}: pass the corpus it trained on")
    if args.prompt_ids is not None:
        prompt = check_ids(args.prompt_ids, config.vocab_size)
    elif args.prompt is not None:
        prompt = corpus.encode(args.prompt)
    else:
        prompt = default_prompt(args.corpus, corpus, config.max_seq_len // 2)
    if not 1 <= len(prompt) < config.max_seq_len:
        raise ValueError(f"the prompt has {len(prompt)} tokens; it needs 1 to max_seq_len - 1 = "
                         f"{config.max_seq_len - 1}")
    n = min(args.max_new_tokens, config.max_seq_len - len(prompt))
    model = load_model(args, state, mesh, tp, device)
    new, prefill_s, decode_s = generate(model, prompt, n, args, device)
    return {"source": os.path.join(args.out_dir, CKPT_SUBDIR), "step": state["step"], "impl": args.impl,
            "prompt_ids": prompt, "new_ids": new, "prefill_s": prefill_s, "decode_s": decode_s,
            "max_seq_len": config.max_seq_len, "stopped_at_max_seq_len": n < args.max_new_tokens,
            "prompt_text": corpus.decode(prompt), "new_text": corpus.decode(new)}


# ----------------------------------------------------------------------------- Hugging Face


def run_hf(args, mesh, device) -> Dict:
    import torch_tp
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not os.path.isfile(os.path.join(args.hf, "config.json")):
        raise FileNotFoundError(f"--hf {args.hf}: no config.json there (a directory written by save_pretrained)")
    # Built without weights, parallelized, then each rank reads only its slices of the files.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.hf), dtype=DTYPES[args.dtype])
    torch_tp.parallelize_module(model, mesh, model.tp_plan)  # keeps a tied lm_head tied, as HF's own TP does
    torch_tp.parallel.load_pretrained(model, args.hf, device=device)
    model.eval()
    tokenizer = None
    if os.path.isfile(os.path.join(args.hf, "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(args.hf)
    vocab = model.config.vocab_size
    if args.prompt_ids is not None:
        prompt = check_ids(args.prompt_ids, vocab)
    elif args.prompt is not None:
        if tokenizer is None:
            raise ValueError(f"--prompt: {args.hf} has no tokenizer; pass --prompt-ids")
        prompt = tokenizer(args.prompt)["input_ids"]
    else:  # no text to start from: 8 random ids, the same on every rank
        prompt = torch.randint(0, vocab, (8,), generator=torch.Generator().manual_seed(args.seed)).tolist()

    ids = torch.tensor([prompt], device=device)
    sampling = {"do_sample": False}
    if args.temperature > 0:
        # HF samples with the global RNG: the same seed on every rank draws the same tokens from
        # the same replicated logits (checked below).
        torch.manual_seed(args.seed)
        sampling = {"do_sample": True, "temperature": args.temperature, "top_k": args.top_k}
    dist.barrier()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                             use_cache=True, **sampling)
    elapsed = time.perf_counter() - t0
    new = out[0, len(prompt):]
    agreed = new.clone()
    dist.broadcast(agreed, src=0)
    if not torch.equal(agreed, new):
        raise RuntimeError(f"rank {dist.get_rank()} generated {new.tolist()}, rank 0 {agreed.tolist()}")
    new = new.tolist()

    def decode(token_ids):
        return tokenizer.decode(token_ids) if tokenizer is not None else None

    # generate() runs prefill and decode in one call: its time over the new tokens is the rate.
    return {"source": args.hf, "impl": "torch_tp", "prompt_ids": prompt, "new_ids": new,
            "generate_s": elapsed, "stopped_at_max_seq_len": False,
            "prompt_text": decode(prompt), "new_text": decode(new)}


# ----------------------------------------------------------------------------- main


def report(result: Dict, args, world: int, device, backend: str) -> Dict:
    """Rank 0's printout and the --json figures."""
    n = len(result["new_ids"])
    figures = {"tp": world, "device": device.type, "backend": backend, "dtype": args.dtype,
               "temperature": args.temperature, "new_tokens": n, **result}
    if "decode_s" in result:
        decode_ms = [1e3 * s for s in result["decode_s"]]
        figures.update(prefill_ms=1e3 * result["prefill_s"],
                       decode_ms_median=statistics.median(decode_ms) if decode_ms else None,
                       decode_ms_mean=statistics.fmean(decode_ms) if decode_ms else None,
                       decode_tokens_per_s=1e3 / statistics.fmean(decode_ms) if decode_ms else None)
        del figures["decode_s"], figures["prefill_s"]
    else:
        figures["generate_ms"] = 1e3 * result["generate_s"]
        figures["decode_tokens_per_s"] = n / result["generate_s"]
        del figures["generate_s"]

    print(f"generate: {result['source']} ({'--hf' if args.hf else 'step ' + str(result['step'])}), "
          f"--impl {result['impl']}, TP {world} on {device.type} ({backend}), {args.dtype}, "
          + ("greedy" if args.temperature == 0 else f"temperature {args.temperature}"
             + (f", top-k {args.top_k}" if args.top_k else "") + f", seed {args.seed}"))
    if result["prompt_text"] is not None:
        print(f"prompt: {result['prompt_text']!r}")
        print(f"continuation: {result['new_text']!r}")
    else:
        print(f"prompt ids: {result['prompt_ids']}")
        print(f"new ids: {result['new_ids']}")
    if result["stopped_at_max_seq_len"]:
        print(f"stopped after {n} new tokens: the model's max_seq_len is {result['max_seq_len']}")
    if "prefill_ms" in figures:
        print(f"prefill: {len(result['prompt_ids'])} tokens in {figures['prefill_ms']:.2f} ms")
        if figures["decode_ms_mean"] is not None:
            print(f"decode: {n - 1} tokens, {figures['decode_ms_median']:.2f} ms/token median, "
                  f"{figures['decode_ms_mean']:.2f} ms/token mean, {figures['decode_tokens_per_s']:,.1f} tokens/s")
    else:
        print(f"generate(): {n} new tokens in {figures['generate_ms']:.1f} ms (prefill included), "
              f"{figures['decode_tokens_per_s']:,.1f} tokens/s")
    return figures


def main(argv=None):
    args = parse_args(argv)
    if "RANK" not in os.environ:
        sys.exit("generate.py: launch it with torchrun, e.g. "
                 "`torchrun --nproc-per-node 2 examples/generate.py --out-dir llama_out`")
    # Before any process group: a missing checkpoint is an error on every rank, each of which says it and
    # exits at once (torchrun stops the other ranks when the first exits, so rank 0 alone might not get to).
    try:
        if args.hf is None:
            read_train_state(args.out_dir)
        elif not os.path.isdir(args.hf):
            raise FileNotFoundError(f"--hf {args.hf}: no such directory")
        load_tp_api(args.impl)
    except (FileNotFoundError, ImportError) as e:
        print(f"generate.py: {e}", file=sys.stderr)
        sys.exit(2)
    device, backend = setup(args)
    world = dist.get_world_size()

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    try:
        result = run_hf(args, mesh, device) if args.hf else run_checkpoint(args, mesh, device)
    except ValueError as e:  # bad arguments for this model (prompt, TP degree, corpus): one message, every rank exits
        if dist.get_rank() == 0:
            print(f"generate.py: {e}", file=sys.stderr)
        dist.destroy_process_group()
        sys.exit(2)
    if dist.get_rank() == 0:
        figures = report(result, args, world, device, backend)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(figures, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
