"""Every family against transformers as the oracle, beyond logits (tests/test_hf.py has
those): greedy generation token for token, tokenization by each tokenizer's own rules,
sliding windows that really bite, and the bitwise round trip HF -> meshlm -> HF."""

import os

import jax
import numpy as np
import pytest
import torch
import transformers

from tiny_hf import FAMILIES, WINDOW, hf_tensors, make_hf_dir, torch_logits
from trainer import hf, loading
from trainer.generate import generate
from trainer.model import build_model
from trainer.tokenizer import load_tokenizer

PROMPTS = ["The with statement", "def f(x):\n    return x", "Hi",
           "A longer prompt about the Python data model and its special methods, "
           "with enough words to span many tokens."]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: (str(root / f), make_hf_dir(str(root / f), f, seed=10 + i))
            for i, f in enumerate(FAMILIES)}


def hf_greedy(model, tok, texts):
    """transformers' own batched greedy generation, left-padded, cut at EOS."""
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    rows = out[:, enc["input_ids"].shape[1]:].tolist()
    return [r[:r.index(tok.eos_token_id)] if tok.eos_token_id in r else r for r in rows], enc


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_equals_transformers(family, family_dirs):
    """Batched, ragged prompts encoded by the tokenizer's own rules (BOS only where it adds
    one), 32 new tokens: meshlm's KV-cache decoding gives transformers' tokens exactly."""
    path, torch_model = family_dirs[family]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    expected, enc = hf_greedy(torch_model, tok, PROMPTS)

    model, params, ours = loading.load_model(path)
    prompts = ours.encode_texts(PROMPTS)
    for row, prompt in zip(enc["input_ids"].tolist(), prompts):  # the same prompt ids
        assert row[len(row) - len(prompt):] == prompt
    assert len({len(p) for p in prompts}) == len(PROMPTS)  # ragged
    adds_bos = tok("x")["input_ids"][0] == tok.bos_token_id
    assert all((p[0] == ours.bos_id) == adds_bos for p in prompts)
    got = generate(model, params, prompts, ours.eos_id, ours.pad_id,
                   max_new_tokens=NEW_TOKENS, temperature=0)
    assert got == expected
    assert sum(map(len, got)) >= NEW_TOKENS  # it generated something worth comparing


def test_both_kinds_of_tokenizer_are_covered():
    kinds = {kind for _, _, kind in FAMILIES.values()}
    assert {"bos", "plain", "bytes"} <= kinds


@pytest.mark.parametrize("kind_family", ["llama_gqa", "qwen2", "llama3_tied"])
def test_text_document_and_chat_encode_as_transformers(kind_family, family_dirs):
    """A prompt is `tokenizer(text)`; a training document is that plus EOS; a chat is
    `apply_chat_template`, for a tokenizer that adds BOS, one that adds nothing, and the
    byte tokenizer's exported form."""
    path, _ = family_dirs[kind_family]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ours = load_tokenizer(path)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ü"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "More?"}]
    for text in PROMPTS:
        assert ours.encode_text(text) == tok(text)["input_ids"]
        assert ours.encode_documents([text]) == [tok(text)["input_ids"] + [tok.eos_token_id]]
    want = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert ours.apply_chat_template(chat) == list(want)
    if kind_family == "llama3_tied":  # meshlm's own bytes tokenizer encodes alike
        byte = load_tokenizer("bytes")
        assert [byte.encode_text(t) for t in PROMPTS] == [tok(t)["input_ids"] for t in PROMPTS]


@pytest.mark.parametrize("family", ["mistral_window", "qwen3_window", "gemma3"])
def test_the_sliding_window_changes_the_logits(family, family_dirs):
    """Parity with transformers is no accident of a window that never applies: the same
    weights without the window give other logits at sequences longer than it."""
    import dataclasses
    path, torch_model = family_dirs[family]
    cfg = hf.model_config_from_hf(path)
    assert "sliding_attention" in cfg.layer_types and cfg.sliding_window == WINDOW
    tokens = np.random.default_rng(1).integers(0, 300, (1, 5 * WINDOW), dtype=np.int32)
    model, params, _ = loading.load_model(path)
    windowed = np.asarray(model.apply({"params": params}, tokens))
    full_cfg = dataclasses.replace(cfg, sliding_window=10**6)  # a window nothing falls out of
    full = np.asarray(build_model(full_cfg).apply({"params": params}, tokens))
    expected = torch_logits(torch_model, tokens)
    assert np.abs(windowed - expected).max() < 1e-5
    np.testing.assert_array_equal(full[:, :WINDOW], windowed[:, :WINDOW])  # within the window
    assert np.abs(full[:, WINDOW:] - expected[:, WINDOW:]).max() > 1e-3


@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_is_bitwise(family, family_dirs, tmp_path):
    """HF -> meshlm params -> HF reproduces every tensor bit for bit, and the config."""
    path, _ = family_dirs[family]
    model_cfg = hf.model_config_from_hf(path)
    model = build_model(model_cfg)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = hf.load_params(path, model_cfg, loading.abstract_params(model, device))
    out = str(tmp_path / "back")
    hf.export(params, model_cfg, path, out)
    original, returned = hf_tensors(path), hf_tensors(out)
    assert sorted(original) == sorted(returned)
    for name in original:
        assert original[name].dtype == returned[name].dtype, name
        assert np.array_equal(original[name], returned[name]), name
    assert hf.model_config_from_hf(out) == model_cfg
    assert os.path.exists(os.path.join(out, "tokenizer.json"))


def test_a_checkpoint_meta_of_the_previous_layout_reads_as_the_same_model():
    """Run dirs written before the family registry (head_dim 0, a qkv_bias field, every
    RoPE field stored whatever the type) resume as the same model config."""
    from trainer.families import PRESETS, ModelConfig
    old = PRESETS["tiny"].to_dict()
    for name in ("layer_types", "sliding_window", "sliding_rope_theta", "sliding_rope_scaling",
                 "query_pre_attn_scalar", "final_logit_softcapping"):
        old.pop(name)
    old.update(head_dim=0, qkv_bias=False, rope_scaling=dict(
        rope_type="default", factor=1.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192))
    assert ModelConfig.from_dict(old) == PRESETS["tiny"]
