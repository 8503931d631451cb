"""examples/train_llama.py --save-hf DIR: the trained model as a Hugging Face LlamaForCausalLM directory.

The example trains test_example.py's small model for 6 steps at TP 2 (2 KV heads: wk sharded, 2
query heads per KV head) and, as the other layout, at TP 1 under torch's own TP with one KV head
and the corpus's characters as vocabulary (97, not a multiple of anything), each writing its DCP
checkpoint and, with --save-hf, a directory split into several safetensors files with an index.
Then:

1. transformers' ``from_pretrained(DIR)`` in float32 gives the logits of the example's model loaded
   from the same run's DCP checkpoint, here in one process, on the same tokens.
2. ``examples/generate.py --hf DIR`` at TP 2 (torch_tp's load_pretrained, HF's generate() with its
   KV cache) gives the greedy ids of the unsharded HF model's generate() and of the example's own
   model decoding without a cache (test_generate_example's reference, which also checks that no
   step is a near tie).

Tolerance LOGIT_ATOL = 1e-4 absolute, on logits of a few units. Both models compute the same
float32 products, summed in other orders (HF's rotate_half against the example's complex multiply,
eager attention against SDPA, sharded GEMMs for the export), which moves a logit by ~1e-6. A
wrong export is far off: without the per-head reordering of wq and wk (interleaved rotary pairs
against rotate_half's halves) the logits move by ~0.2. That needs attention that is not uniform:
the runs train at --lr 3e-2 without warmup; at the default schedule 6 steps leave the q . k scores
so small that the rotary layout moves a logit by only ~3e-4.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from test_example import EXAMPLE, _train
from test_generate_example import EXAMPLES, NEW_TOKENS, _figures, _reference_ids

LOGIT_ATOL = 1e-4
SAVE = ["--lr", "3e-2", "--warmup", "0", "--save-hf-shard-size", "20KB"]


def _example_model(ckpt_dir):
    """The example's unsharded Llama with the weights of the DCP checkpoint in ``ckpt_dir``."""
    import torch.distributed.checkpoint as dcp

    sys.path.insert(0, EXAMPLES)
    from llama_model import Llama, LlamaConfig

    with open(os.path.join(ckpt_dir, "train_state.json")) as f:
        model = Llama(LlamaConfig(**json.load(f)["config"]))
    state = model.state_dict()
    dcp.load({"model": state}, checkpoint_id=ckpt_dir, no_dist=True)  # one process: the full tensors
    model.load_state_dict(state)
    return model.eval()


def _assert_same_logits(out, hf_dir):
    """from_pretrained(hf_dir)'s logits against the example model's, on 2 x 16 random tokens."""
    from transformers import AutoModelForCausalLM

    files = os.listdir(hf_dir)
    assert "config.json" in files and "model.safetensors.index.json" in files, files
    assert sum(name.endswith(".safetensors") for name in files) > 1, files
    example = _example_model(str(out / "checkpoint"))
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM", type(hf)
    vocab = example.config.vocab_size
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = example(tokens), hf(tokens).logits
    assert got.shape == want.shape == (2, 16, vocab), (got.shape, want.shape)
    diff = (got - want).abs().max().item()
    assert diff <= LOGIT_ATOL, f"{hf_dir}: HF logits differ from the example's by {diff:.2e} > {LOGIT_ATOL:.0e}"
    return hf


# dcp.load in this one process says it assumes a single process: it is meant.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_save_hf_loads_in_transformers_and_generate(tmp_path):
    out, hf_dir = tmp_path / "tp2", tmp_path / "tp2_hf"
    _train(out, 2, "--kv-heads", "2", "--save-hf", str(hf_dir), *SAVE)
    hf = _assert_same_logits(out, str(hf_dir))

    prompt = [72, 101, 108, 108, 111, 32]  # "Hello "
    figures = _figures(tmp_path, "generate_hf", 2, "--hf", str(hf_dir), "--prompt-ids", ",".join(map(str, prompt)),
                       "--max-new-tokens", str(NEW_TOKENS))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = expected[0, len(prompt):].tolist()
    assert figures["new_ids"] == expected, f"generate.py --hf: {figures['new_ids']} != HF generate() {expected}"
    reference = _reference_ids(str(out / "checkpoint"), prompt, NEW_TOKENS)
    assert expected == reference, f"HF generate() {expected} != the example's own model {reference}"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_save_hf_at_tp1_torch_mqa_char_vocab(tmp_path):
    out, hf_dir = tmp_path / "tp1", tmp_path / "tp1_hf"
    _train(out, 1, "--impl", "torch", "--kv-heads", "1", "--tokenizer", "char", "--save-hf", str(hf_dir), *SAVE)
    _assert_same_logits(out, str(hf_dir))


def test_save_hf_under_pp_is_refused_before_training(tmp_path):
    done = subprocess.run([sys.executable, EXAMPLE, "--pp", "2", "--save-hf", str(tmp_path / "hf")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--save-hf with --pp 2" in done.stderr, done.stderr[-2000:]
