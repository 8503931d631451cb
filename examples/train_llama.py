"""Train a small Llama on a character-level corpus with tensor + sequence parallelism.

Launch (2 ranks on CPU, about a minute):

    torchrun --nproc-per-node 2 examples/train_llama.py                 # torch_tp
    torchrun --nproc-per-node 2 examples/train_llama.py --impl torch    # torch.distributed.tensor.parallel
    torchrun --nproc-per-node 2 examples/train_llama.py --resume        # continue from --out-dir's checkpoint
    torchrun --nproc-per-node 4 examples/train_llama.py --resume        # ... at another TP degree
    torchrun --nproc-per-node 4 examples/train_llama.py --dp 2          # FSDP2 over 2 x TP over 2
    torchrun --nproc-per-node 2 examples/train_llama.py --check         # TP vs unsharded losses, then exit

The model and torchtitan's TP plan (sequence parallel, loss_parallel) are in
llama_model.py; --impl picks whose parallelize_module and styles apply it:
``torch_tp`` (the drop-in replacement) or ``torch`` (DTensor). The ranks form a
("dp", "tp") mesh of --dp x (world size / --dp): tensor parallelism over "tp"
(the whole world by default), and with --dp > 1 torchtitan's 2-D recipe,
FSDP2's ``fully_shard`` of every block and of the model over "dp", each dp rank
taking its slice of the batch. All ranks start from the same seed. Tokens are
bytes (vocab 256) or, with --tokenizer char, the corpus's distinct characters
(a vocabulary the TP degree need not divide). On CPU the ranks talk through
torch_tp's shared-memory backend (``--backend gloo``: torch's).

Rank 0 shows a progress bar (loss, tokens/s) on stderr, and writes to --out-dir:
loss_curve.png, metrics.json, and checkpoint/ (every --ckpt-every steps and at
the end): a torch.distributed.checkpoint (DCP) of the model and optimizer
state, and train_state.json (step, losses). --resume restores them at any
--dp and TP degree, and with either --impl (the parameters are DTensors, which
DCP reshards), and the resumed run sees the batches the uninterrupted one
would have.
"""

from __future__ import annotations

import argparse
import contextlib
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
    g.add_argument("--ckpt-every", type=int, default=50, help="checkpoint every K steps, 0: only at the end")
    g.add_argument("--stop-after", type=int, default=None, metavar="K",
                   help="end this run after step K (checkpointed), keeping --steps' schedule: an interruption "
                        "that --resume continues exactly")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--check", action="store_true",
                   help="only compare a few steps of the TP model with the unsharded one, then exit")
    g.add_argument("--sample", type=int, default=120, help="characters to generate at the end (0: none)")
    g.add_argument("--amp", action="store_true", help="bf16 autocast (cuda)")
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
    g.add_argument("--kv-heads", type=int, default=None)
    g.add_argument("--no-loss-parallel", action="store_true",
                   help="all-gather the logits and use the plain cross entropy")
    g = p.add_argument_group("optimizer")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--warmup", type=int, default=10)
    g.add_argument("--weight-decay", type=float, default=0.1)
    return p.parse_args(argv)


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


def save_checkpoint(out_dir: str, model, optimizer, step: int, meta: Dict[str, Any]) -> str:
    """Write the model and optimizer state with torch.distributed.checkpoint into
    ``checkpoint/``, and the rest (step, losses, configuration) into its
    ``train_state.json``.

    Every parameter is a DTensor (torch_tp's and torch's TP, FSDP2), so DCP
    records each one's global shape and which piece every rank holds, and a
    checkpoint loads at another TP or data-parallel degree. It goes to
    ``checkpoint.tmp/`` first and replaces ``checkpoint/`` once complete: a crash
    mid-write leaves the previous checkpoint intact.
    """
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    ckpt_dir = os.path.join(out_dir, CKPT_SUBDIR)
    tmp_dir = ckpt_dir + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp_dir)
    if dist.get_rank() == 0:
        with open(os.path.join(tmp_dir, TRAIN_STATE), "w") as f:
            json.dump({**meta, "step": step}, f)
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        os.replace(tmp_dir, ckpt_dir)
    dist.barrier()
    return ckpt_dir


def load_checkpoint(out_dir: str, model, optimizer, expect: Dict[str, Any]) -> Dict[str, Any]:
    """Restore what :func:`save_checkpoint` wrote into ``model`` and ``optimizer``, resharded
    to this run's layout; return train_state.json. Refuses a checkpoint of another model
    configuration or tokenizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ckpt_dir = os.path.join(out_dir, CKPT_SUBDIR)
    path = os.path.join(ckpt_dir, TRAIN_STATE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"--resume: no checkpoint in {ckpt_dir} ({TRAIN_STATE} is missing)")
    with open(path) as f:
        state = json.load(f)
    for key, want in expect.items():
        if state.get(key) != want:
            raise RuntimeError(f"--resume: {ckpt_dir} has {key}={state.get(key)!r}, this run {want!r}")
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=ckpt_dir)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    return state


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


def dp_mean(value: float, dp_mesh, device) -> float:
    """The mean of a per-rank loss over the data-parallel ranks (the global batch's loss)."""
    if dp_mesh.size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=dp_mesh.get_group())
    return t.item() / dp_mesh.size()


@torch.no_grad()
def evaluate(model, corpus: Corpus, args, device, tp, batches: int = 4) -> float:
    total = 0.0
    for i in range(batches):
        inputs, targets = corpus.batch("val", i, args.batch, args.seq, args.seed)
        with loss_context(tp, not args.no_loss_parallel), autocast(args, device):
            total += scalar(cross_entropy_loss(model(inputs.to(device)), targets.to(device)))
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
    try:  # before any process group: every rank exits at once, with one message
        tp = load_tp_api(args.impl)
    except ImportError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"train_llama.py: {e}", file=sys.stderr)
        sys.exit(2)
    device, backend = setup(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0

    from torch.distributed.device_mesh import init_device_mesh

    if args.dp < 1 or world % args.dp or args.batch % args.dp:
        if is_main:
            print(f"train_llama.py: --dp {args.dp} must divide the world size ({world}) and --batch ({args.batch})",
                  file=sys.stderr)
        dist.destroy_process_group()
        sys.exit(2)
    mesh_2d = init_device_mesh(device.type, (args.dp, world // args.dp), mesh_dim_names=("dp", "tp"))
    mesh, dp_mesh = mesh_2d["tp"], mesh_2d["dp"]

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
                         n_kv_heads=args.kv_heads, max_seq_len=args.seq)
    check_tp_degree(config, mesh.size())

    torch.manual_seed(args.seed)  # the same init on every rank; parallelize_module keeps rank 0's
    model = Llama(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    tp.parallelize_module(model, mesh, tp_plan(tp, loss_parallel=not args.no_loss_parallel))
    if args.dp > 1:
        # torchtitan's 2-D recipe: FSDP2 over "dp" of every block, then of the root,
        # on top of the TP DTensor parameters.
        from torch.distributed.fsdp import fully_shard

        for block in model.layers.values():
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    optimizer = make_optimizer(model, args.lr, args.weight_decay)

    # What a resumed run must share with the checkpoint; --impl, --dp and the TP degree may differ.
    meta = {"config": config.to_dict(), "tokenizer": args.tokenizer}
    start, losses, tok_rates = 0, [], []
    if args.resume:
        state = load_checkpoint(args.out_dir, model, optimizer, meta)
        start, losses, tok_rates = state["step"], list(state["losses"]), list(state.get("tok_rates", []))
    if is_main:
        os.makedirs(args.out_dir, exist_ok=True)
        layout = f"TP {mesh.size()}" + (f" x FSDP2 {args.dp}" if args.dp > 1 else "")
        print(f"train_llama: --impl {args.impl}, {world} ranks ({layout}) on {device.type} ({backend}), "
              f"torch {torch.__version__}; "
              f"model {n_params / 1e6:.2f}M params (dim {config.dim}, {config.n_layers} layers, {config.n_heads} heads, "
              f"vocab {config.vocab_size}), batch {args.batch} x seq {args.seq}, corpus {corpus.train.numel():,} "
              f"train tokens" + (f"; resumed at step {start}" if args.resume else ""), flush=True)

    tokens_per_step = args.batch * args.seq  # the global batch; each dp rank takes args.batch // args.dp rows
    rows = args.batch // args.dp
    dp_rows = slice(dp_mesh.get_local_rank() * rows, (dp_mesh.get_local_rank() + 1) * rows)
    end = args.steps if args.stop_after is None else max(start, min(args.steps, args.stop_after))
    progress = Progress(args.steps, start, is_main)
    for step in range(start, end):
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        inputs, targets = corpus.batch("train", step, args.batch, args.seq, args.seed)
        inputs, targets = inputs[dp_rows].to(device), targets[dp_rows].to(device)
        with loss_context(tp, not args.no_loss_parallel):
            with autocast(args, device):
                loss = cross_entropy_loss(model(inputs), targets)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = dp_mean(scalar(loss), dp_mesh, device)  # syncs the device, so the step time is real
        dt = time.perf_counter() - t0
        if not math.isfinite(value):
            raise FloatingPointError(f"step {step + 1}: loss is {value}")
        losses.append(value)
        tok_rates.append(tokens_per_step / dt)
        progress.update(step + 1, value, tok_rates[-1])
        done = step + 1
        if args.ckpt_every and done % args.ckpt_every == 0 and done < end:
            save_checkpoint(args.out_dir, model, optimizer, done,
                            {**meta, "impl": args.impl, "losses": losses, "tok_rates": tok_rates})
    progress.close()

    ckpt_dir = save_checkpoint(args.out_dir, model, optimizer, end,
                               {**meta, "impl": args.impl, "losses": losses, "tok_rates": tok_rates})
    val = evaluate(model, corpus, args, device, tp)
    text = sample(model, corpus, args, device, args.sample) if args.sample > 0 else None

    if is_main:
        # Step 1 pays one-time costs (allocations, first collectives): leave it out of the mean,
        # which is all tokens over all time (not the mean of per-step rates).
        rates = tok_rates[1:] if len(tok_rates) > 1 else tok_rates
        mean_rate = len(rates) * tokens_per_step / sum(tokens_per_step / r for r in rates) if rates else float("nan")
        title = (f"Llama {n_params / 1e6:.2f}M, --impl {args.impl}, {layout} on {device.type}, "
                 f"{mean_rate:,.0f} tokens/s")
        plotted = plot_losses(os.path.join(args.out_dir, "loss_curve.png"), losses, val, title)
        with open(os.path.join(args.out_dir, "metrics.json"), "w") as f:
            json.dump({"impl": args.impl, "world_size": world, "dp": args.dp, "tp": mesh.size(),
                       "device": device.type, "backend": backend,
                       "torch": torch.__version__, "config": config.to_dict(), "batch": args.batch,
                       "seq": args.seq, "steps": end, "losses": losses, "tokens_per_s": tok_rates,
                       "mean_tokens_per_s": mean_rate, "val_loss": val}, f, indent=1)
        if text is not None:
            print("sample: " + repr(text[:400]))
        elif args.sample > 0:
            print("sample: skipped (the model's logits are not gatherable to the full vocabulary)")
        written = ([f"{args.out_dir}/loss_curve.png"] if plotted else []) + [f"{args.out_dir}/metrics.json",
                                                                          f"{ckpt_dir}/ (DCP)"]
        print("wrote " + ", ".join(written))
        first = losses[0] if losses else float("nan")
        print(f"final: step {end}  loss {losses[-1] if losses else float('nan'):.4f} (step 1: {first:.4f})  "
              f"val loss {val:.4f}  mean {mean_rate:,.0f} tokens/s  (--impl {args.impl}, {layout}, {device.type})",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
