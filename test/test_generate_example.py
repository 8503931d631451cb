"""examples/generate.py as a user launches it: torchrun processes, on the main job's checkpoint and on a
Hugging Face model.

The main job (examples/train_llama.py, test_example.py's small model with 2 KV heads) trains 6 steps on
2 ranks and writes its DCP checkpoint. generate.py then decodes greedily with its KV cache at TP 1,
2 (torch's DTensor TP, --impl torch) and 4 (torch_tp with KVHeadColwiseParallel: 2 KV heads over 4
ranks); every run must give the same token ids, and those of a reference computed here: the
unsharded model loaded from the same checkpoint by DCP in this one process, decoding without a
cache (a forward of the whole sequence for each new token). With --hf, a tiny random
LlamaForCausalLM saved with save_pretrained generates at TP 2 under its own generate(), in float32
and with --dtype float16; its ids must be the unsharded model's generate() ids in that dtype.

Tolerance: exact token ids, guarded by MARGIN. The TP ranks, the KV cache and the reference
sum the same float32 products in other orders, which moves a logit by ~1e-6 relative (the logits
here are a few units, so ~1e-5 at most); a greedy choice could flip only where the reference's two
largest logits are that close. The test checks that they are at least MARGIN[dtype] apart at every
step, so a different token is a bug, not a tie: 1e-3 in float32, 100x that roundoff; 2e-2 in
float16, where every layer's output is rounded to 11 significant bits (the Hugging Face model's
logits are below 1, an ulp at most 2^-11 ~ 5e-4) and TP rounds the row-parallel partial sums
before adding them, so the two sides' logits may differ by several ulps (the float16 and float32
runs of that model differ by 3e-4 at most); 2e-2 is 40 such ulps. The model's margins are >= 0.07.

The training job runs on gloo as in test_example.py; generation on the example's default CPU
backend (torch_tp), which also keeps --impl torch off gloo's exit-time abort (README, pytorch#190489).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from multirank import torchrun_command
from test_example import _train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
GENERATE = os.path.join(EXAMPLES, "generate.py")
NEW_TOKENS = 8
MARGIN = {torch.float32: 1e-3, torch.float16: 2e-2}


def _generate(tmp_path, nproc, *args, expect_ok=True):
    """One torchrun job of generate.py; the finished process."""
    cmd = torchrun_command(tmp_path / "torchrun", "--standalone", f"--nproc-per-node={nproc}", GENERATE, *args)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if expect_ok:
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    return done


def _figures(tmp_path, name, nproc, *args):
    """generate.py's --json figures of one run."""
    path = tmp_path / f"{name}.json"
    _generate(tmp_path, nproc, *args, "--json", str(path))
    with open(path) as f:
        return json.load(f)


def _assert_margin(logits, step, what, dtype=torch.float32):
    """The two largest logits at least MARGIN[dtype] apart, dtype the model's (generate()'s scores are float32
    whatever the model's dtype)."""
    top2 = torch.topk(logits.double(), 2).values
    assert top2[0] - top2[1] > MARGIN[dtype], f"{what}: step {step}'s top-2 logits {top2.tolist()} are a near tie"


def _reference_ids(ckpt_dir, prompt, n):
    """Greedy ids of the unsharded model from the checkpoint, without a KV cache."""
    import torch.distributed.checkpoint as dcp

    sys.path.insert(0, EXAMPLES)
    from llama_model import Llama, LlamaConfig

    with open(os.path.join(ckpt_dir, "train_state.json")) as f:
        config = LlamaConfig(**json.load(f)["config"])
    model = Llama(config)
    state = model.state_dict()
    dcp.load({"model": state}, checkpoint_id=ckpt_dir, no_dist=True)  # one process: the full tensors
    model.load_state_dict(state)
    ids = list(prompt)
    with torch.no_grad():
        for step in range(n):
            logits = model(torch.tensor([ids]))[0, -1]
            _assert_margin(logits, step, "reference")
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


# dcp.load in this one process says it assumes a single process: it is meant.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_at_any_tp_degree(tmp_path):
    out = tmp_path / "train"
    _train(out, 2, "--kv-heads", "2")
    runs = {
        "tp1": _figures(tmp_path, "tp1", 1, "--out-dir", str(out), "--max-new-tokens", str(NEW_TOKENS)),
        "tp2_torch": _figures(tmp_path, "tp2_torch", 2, "--out-dir", str(out), "--max-new-tokens", str(NEW_TOKENS),
                              "--impl", "torch"),
        "tp4": _figures(tmp_path, "tp4", 4, "--out-dir", str(out), "--max-new-tokens", str(NEW_TOKENS)),
    }
    prompt = runs["tp1"]["prompt_ids"]
    expected = _reference_ids(str(out / "checkpoint"), prompt, NEW_TOKENS)
    for name, figures in runs.items():
        assert figures["prompt_ids"] == prompt, f"{name}: prompt {figures['prompt_ids']} != {prompt}"
        assert figures["new_ids"] == expected, f"{name}: {figures['new_ids']} != reference {expected}"
        assert figures["prefill_ms"] > 0 and figures["decode_tokens_per_s"] > 0, f"{name}: {figures}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_hugging_face_model(tmp_path, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=128,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "hf")  # float32; generate.py casts it to --dtype as it loads
    model.to(dtype)
    prompt = [5, 17, 42, 99, 3, 64]
    figures = _figures(tmp_path, "hf", 2, "--hf", str(tmp_path / "hf"), "--prompt-ids", ",".join(map(str, prompt)),
                       "--max-new-tokens", str(NEW_TOKENS), "--dtype", str(dtype).removeprefix("torch."))

    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                  do_sample=False, output_scores=True, return_dict_in_generate=True)
    for step, scores in enumerate(expected.scores):
        _assert_margin(scores[0], step, "unsharded generate()", dtype)
    assert figures["new_ids"] == expected.sequences[0, len(prompt):].tolist()
    assert figures["generate_ms"] > 0 and figures["decode_tokens_per_s"] > 0, figures
    assert figures["dtype"] == str(dtype).removeprefix("torch."), figures


def test_missing_checkpoint_is_an_error(tmp_path):
    missing = tmp_path / "never_trained"
    done = _generate(tmp_path, 2, "--out-dir", str(missing), expect_ok=False)
    assert done.returncode != 0
    assert f"{missing}/checkpoint/train_state.json is missing" in done.stderr, done.stderr[-2000:]


def test_plain_python_is_refused():
    done = subprocess.run([sys.executable, GENERATE], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "launch it with torchrun" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("flag", ["--prompt-ids", "--temperature"])
def test_bad_arguments_name_themselves(tmp_path, flag):
    value = {"--prompt-ids": "1,x", "--temperature": "-1"}[flag]
    done = subprocess.run([sys.executable, GENERATE, flag, value], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert flag in done.stderr and value in done.stderr, done.stderr[-2000:]
