"""scripts/finetune_chat.sh end to end: a tiny random HF chat model and a chat JSONL in, a
fine-tuned HF dir out that transformers loads with its chat template, with a lower loss on
the assistant turns; running it again resumes, and a missed export is made up."""

import json
import os
import subprocess
import sys

import numpy as np
import torch
import transformers

from conftest import REPO, cli_env
from tiny_hf import make_hf_dir

CONVERSATIONS = [
    [{"role": "system", "content": "You answer with the colour of things."},
     {"role": "user", "content": f"What colour is item {i}?"},
     {"role": "assistant", "content": ["Red.", "Green.", "Blue."][i % 3] + " Always."}]
    for i in range(48)]


def recipe(*args):
    proc = subprocess.run(["bash", "scripts/finetune_chat.sh", *args], cwd=REPO,
                          env=cli_env(1, PYTHON=sys.executable), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def assistant_loss(model_dir, conversations):
    """Mean loss of the last assistant turn, as transformers scores it: the tokens after
    the prompt rendered with its generation header."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    losses = []
    for messages in conversations:
        prompt = tok.apply_chat_template(messages[:-1], add_generation_prompt=True,
                                         tokenize=False)
        full = tok.apply_chat_template(messages, tokenize=False)
        ids = tok(full, add_special_tokens=False)["input_ids"]
        start = len(tok(prompt, add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        token_loss = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]),
                                                       reduction="none")
        losses.append(float(token_loss[start - 1:].mean()))
    return float(np.mean(losses))


def test_finetune_chat_recipe(tmp_path):
    base, out = str(tmp_path / "base"), str(tmp_path / "out")
    make_hf_dir(base, "mistral", seed=1)  # a byte-level tokenizer with a ChatML template
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    fast = ["--seq_len=192", "--batch_size=8", "--optimizer.lr=1e-2", "--optimizer.warmup_steps=2",
            "--save_every=5", "--eval_every=0", "--log_every=5", "--compile_cache="]
    recipe(base, str(data), out, "--steps=10", *fast)
    recipe(base, str(data), out, "--steps=30", *fast)  # the same command, longer: resumes
    log = [json.loads(l) for l in open(f"{out}/run/metrics.jsonl")]
    assert [m["step"] for m in log if "loss" in m] == [5, 10, 15, 20, 25, 30]

    model = f"{out}/model"
    assert (transformers.AutoTokenizer.from_pretrained(model).chat_template
            == transformers.AutoTokenizer.from_pretrained(base).chat_template)
    held_out = CONVERSATIONS[:6]
    before, after = assistant_loss(base, held_out), assistant_loss(model, held_out)
    assert after < before - 1.5, (before, after)  # (measured: 5.8 -> 3.2)

    # Preempted between the last checkpoint and the export: the same command exports.
    import shutil
    shutil.rmtree(model)
    err = recipe(base, str(data), out, "--steps=30", *fast)
    assert "already trained to step 30; exporting it" in err
    assert os.path.exists(f"{model}/config.json")
    assert assistant_loss(model, held_out) == after
