"""trainer/data.py and trainer/tokenizer.py: tokenizers, sources, cache, packing, masks and
the batch for step k."""
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

import fsspec
import numpy as np
import pytest

from trainer import data
from trainer.config import DataConfig
from trainer.tokenizer import SentencePieceTokenizer, TokenizerError, load_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHATML = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Add 2 and 3."},
     {"role": "assistant", "content": "2 + 3 = 5"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue, like the sea."}],
    [{"role": "user", "content": "Say ü and 日本"}, {"role": "assistant", "content": "ü 日本 done"}],
]


def cfg(tmp_path, **kw):
    return DataConfig(**({"cache_dir": str(tmp_path / "cache")} | kw))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def digest(batch):
    return hashlib.sha256(b"".join(batch[k].tobytes() for k in sorted(batch))).hexdigest()


# ----------------------------------------------------------------------- tokenizers

@pytest.fixture(scope="module")
def corpus_lines():
    from pydoc_data.topics import topics
    return [line for t in sorted(topics)[:20] for line in topics[t].splitlines() if line.strip()]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory, corpus_lines):
    import sentencepiece as spm
    prefix = str(tmp_path_factory.mktemp("sp") / "tiny")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus_lines), model_prefix=prefix, vocab_size=400,
                                   byte_fallback=True, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, minloglevel=2)
    return prefix + ".model"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, corpus_lines):
    import tokenizers
    import transformers
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus_lines, trainer)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="<|im_end|>",
                                               pad_token="<pad>", additional_special_tokens=["<|im_start|>", "</s>"])
    tok.chat_template = CHATML
    out = tmp_path_factory.mktemp("hf") / "tok"
    tok.save_pretrained(str(out))
    return str(out)


TEXT = "Hello, world!\nThe quick brown fox -- ü, 日本 and 🙂."


def test_bytes_tokenizer_round_trips():
    tok = load_tokenizer("bytes")
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8")) and tok.decode(ids) == TEXT
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id, tok.name) == (259, 256, 257, 258, "bytes")
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == TEXT  # specials are dropped


def test_sentencepiece_tokenizer_round_trips(sp_model):
    tok = load_tokenizer(sp_model)
    assert isinstance(tok, SentencePieceTokenizer) and tok.name == sp_model and tok.vocab_size == 400
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT and max(ids) < tok.vocab_size
    assert tok.eos_id >= 0 and tok.bos_id is not None and tok.eos_id not in ids
    assert tok.encode_batch([TEXT, "abc"]) == [ids, tok.encode("abc")]


def test_hf_tokenizer_round_trips(hf_dir):
    for spec in (hf_dir, os.path.join(hf_dir, "tokenizer.json")):
        tok = load_tokenizer(spec)
        ids = tok.encode(TEXT)
        assert tok.decode(ids) == TEXT and max(ids) < tok.vocab_size
        assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 4, 2) and tok.eos_id not in ids
        assert tok.encode_batch([TEXT, "abc"]) == [ids, tok.encode("abc")]


def test_hf_tokenizer_from_a_remote_url(hf_dir, tmp_path, monkeypatch):
    # Any fsspec URL (gs:// in production) is copied to a local dir first; memory:// stands in here.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    fs = fsspec.filesystem("memory")
    for name in os.listdir(hf_dir):
        fs.pipe(f"/tok/{name}", open(os.path.join(hf_dir, name), "rb").read())
    tok = load_tokenizer("memory://tok")
    assert tok.decode(tok.encode(TEXT)) == TEXT and tok.name == "memory://tok"


def test_unknown_tokenizer_spec(tmp_path):
    for spec in ("foo", str(tmp_path / "missing.model"), str(tmp_path)):
        with pytest.raises(TokenizerError, match=r"--tokenizer: .* is not 'bytes', a Hugging Face"):
            load_tokenizer(spec)


# ------------------------------------------------------------------ batches for step k

@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    c = cfg(tmp_path_factory.mktemp("builtin"))
    return c, data.load_dataset(c, load_tokenizer("bytes"), seq_len=64)


def test_batch_is_a_pure_function_of_seed_and_step(builtin):
    c, (train, _) = builtin
    b = train.batch(3, 8, seed=1)
    assert {k: (v.shape, v.dtype) for k, v in b.items()} == {
        "inputs": ((8, 64), np.int32), "targets": ((8, 64), np.int32), "loss_mask": ((8, 64), np.float32)}
    assert digest(b) == digest(train.batch(3, 8, seed=1))
    fresh, _ = data.load_dataset(c, load_tokenizer("bytes"), seq_len=64)
    assert digest(b) == digest(fresh.batch(3, 8, seed=1))
    # ... and in another process, with its own permutation cache.
    code = (f"import hashlib; from trainer import data, config, tokenizer; c = config.{c!r}; "
            "b = data.load_dataset(c, tokenizer.load_tokenizer('bytes'), 64)[0].batch(3, 8, seed=1); "
            "print(hashlib.sha256(b''.join(b[k].tobytes() for k in sorted(b))).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == digest(b)
    assert digest(b) != digest(train.batch(4, 8, seed=1))
    assert digest(b) != digest(train.batch(3, 8, seed=2))


def test_host_rows_are_slices_of_the_global_batch(builtin):
    _, (train, _) = builtin
    full = train.batch(5, 8, seed=0)
    for rows in (slice(0, 4), slice(4, 8), slice(2, 3)):
        part = train.batch(5, 8, seed=0, rows=rows)
        assert all(np.array_equal(part[k], full[k][rows]) for k in full)


def test_every_row_once_per_epoch(builtin):
    _, (train, _) = builtin
    n, bs = train.num_rows, 7
    ids = np.concatenate([train.row_ids(s, bs, seed=0) for s in range(-(-2 * n // bs))])
    assert sorted(ids[:n]) == list(range(n)) and sorted(ids[n:2 * n]) == list(range(n))
    assert not np.array_equal(ids[:n], ids[n:2 * n])  # each epoch is reshuffled
    b = train.batch(2, bs, seed=0)
    np.testing.assert_array_equal(b["inputs"], train.rows[ids[2 * bs:3 * bs], :-1])


def test_targets_are_inputs_shifted_and_eos_separates_documents(tmp_path):
    docs = [f"document number {i} " + "words " * (i % 5) for i in range(40)]
    c = cfg(tmp_path, path=write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in docs]), val_fraction=0)
    tok = load_tokenizer("bytes")
    train, val = data.load_dataset(c, tok, seq_len=32)
    assert val.num_rows == 0
    stream = np.concatenate([[tok.bos_id, *tok.encode(d), tok.eos_id] for d in docs])
    np.testing.assert_array_equal(train.rows.reshape(-1), stream[:train.num_rows * 33])
    assert train.num_rows == len(stream) // 33  # the tail is dropped
    b = train.batch(0, 4, seed=0)
    np.testing.assert_array_equal(b["targets"][:, :-1], b["inputs"][:, 1:])
    assert b["loss_mask"].min() == 1.0


def test_txt_glob_is_one_document_per_file(tmp_path):
    for i in range(3):
        (tmp_path / f"f{i}.txt").write_text(f"file {i}\n\nsecond paragraph {i}\n")
    c = cfg(tmp_path, path=str(tmp_path / "f*.txt"), val_fraction=0)
    train, _ = data.load_dataset(c, load_tokenizer("bytes"), seq_len=8)
    text = bytes(train.rows.reshape(-1)[train.rows.reshape(-1) < 256].tolist()).decode()
    assert text.startswith("file 0\n\nsecond paragraph 0\nfile 1")
    assert (train.rows == 257).sum() == 2  # EOS after each document (the third falls in the dropped tail)


# -------------------------------------------------------------- cache and validation

def test_second_load_uses_the_cache(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"doc {i} " * 20} for i in range(30)])
    c, tok = cfg(tmp_path, path=path), load_tokenizer("bytes")
    first = data.load_dataset(c, tok, seq_len=16)
    entry, = (tmp_path / "cache").iterdir()  # one shard directory, no temp file left behind
    assert sorted(p.name for p in entry.iterdir()) == ["manifest.json", "plan.json", "shards"]
    assert sorted(p.name for p in (entry / "shards").iterdir()) == ["00000.json", "00000.offsets", "00000.tokens"]

    def boom(*_):
        raise AssertionError("re-tokenized")
    monkeypatch.setattr(tok, "encode", boom)
    monkeypatch.setattr(tok, "encode_batch", boom)
    second = data.load_dataset(c, tok, seq_len=16)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a.rows, b.rows)
        np.testing.assert_array_equal(a.row_mask, b.row_mask)
    with open(path, "a") as f:  # a changed source file is tokenized again
        f.write(json.dumps({"text": "one more document"}) + "\n")
    with pytest.raises(AssertionError, match="re-tokenized"):
        data.load_dataset(c, tok, seq_len=16)


def test_remote_source_and_cache(tmp_path):
    fs = fsspec.filesystem("memory")
    fs.pipe("/corpus/a.jsonl", "".join(json.dumps({"text": f"remote {i} " * 9}) + "\n" for i in range(20)).encode())
    c = cfg(tmp_path, path="memory://corpus/*.jsonl", cache_dir="memory://cache")
    train, val = data.load_dataset(c, load_tokenizer("bytes"), seq_len=16)
    entry, = fs.ls("/cache", detail=False)
    assert fs.exists(f"{entry}/manifest.json") and not [f for f in fs.find(entry) if "tmp" in f]
    again, _ = data.load_dataset(c, load_tokenizer("bytes"), seq_len=16)
    np.testing.assert_array_equal(train.rows, again.rows)


def test_validation_documents_are_held_out(tmp_path):
    docs = [{"text": f"<doc{i:03d}> " + "filler " * 7} for i in range(60)]
    c = cfg(tmp_path, path=write_jsonl(tmp_path / "d.jsonl", docs), val_fraction=0.1)
    tok = load_tokenizer("bytes")
    train, val = data.load_dataset(c, tok, seq_len=16)

    def doc_ids(ds):
        tokens = ds.rows.reshape(-1)[ds.row_mask.reshape(-1) == 1] if ds.num_rows else []
        return set(re.findall(r"<doc(\d+)>", tok.decode(tokens)))
    held, trained = doc_ids(val), doc_ids(train)
    assert len(held) == 6 and not held & trained and len(held | trained) >= 59  # the last may be in the dropped tail
    assert val.num_rows == -(-6 * (len(tok.encode(docs[0]["text"])) + 2) // 17)  # the tail row is padded, not dropped
    batches = list(val.eval_batches(4))
    assert len(batches) == -(-val.num_rows // 4)
    assert sum(b["loss_mask"].sum() for b in batches) == 6 * (len(tok.encode(docs[0]["text"])) + 2) - val.num_rows


# ------------------------------------------------------------------------- chat masks

def assistant_spans(ds):
    """Decode-ready runs of target ids with loss_mask 1, over all rows in order."""
    spans = []
    for b in ds.eval_batches(2):
        for tgt, m in zip(b["targets"], b["loss_mask"]):
            run = []
            for t, keep in zip(tgt.tolist(), m.tolist()):
                if keep:
                    run.append(t)
                elif run:
                    spans.append(run)
                    run = []
            if run:
                spans.append(run)
    return spans


@pytest.mark.parametrize("which", ["bytes", "hf"])
def test_chat_loss_mask_covers_only_assistant_turns(tmp_path, which, hf_dir):
    tok = load_tokenizer("bytes" if which == "bytes" else hf_dir)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
    train, _ = data.load_dataset(cfg(tmp_path, path=path, format="chat", val_fraction=0), tok, seq_len=128)
    want = [m["content"] for conv in CONVERSATIONS for m in conv if m["role"] == "assistant"]
    spans = assistant_spans(train)
    assert [tok.decode(s) for s in spans] == want
    assert all(s[-1] == tok.eos_id for s in spans)  # the turn's end token is learned too
    # Conversations are packed whole: every row starts a conversation (BOS first).
    assert (train.rows[:, 0] == tok.bos_id).all() and train.num_rows < len(CONVERSATIONS)


def test_chat_template_that_cannot_be_split_into_turns(tmp_path, hf_dir):
    tok = load_tokenizer(hf_dir)
    tok.chat_template = "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['content'] }}{% endfor %}"
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
    with pytest.raises(data.DataError, match=r"chat.jsonl:1: cannot apply the chat template: .* assistant turns"):
        data.load_dataset(cfg(tmp_path, path=path, format="chat", val_fraction=0), tok, seq_len=128)


def test_chat_prompt_for_generation(hf_dir):
    tok = load_tokenizer(hf_dir)
    prompt = tok.apply_chat_template(CONVERSATIONS[1][:1])
    assert prompt[0] == tok.bos_id and tok._tok.decode(prompt).endswith("<|im_start|>assistant\n")
    byte_prompt = load_tokenizer("bytes").apply_chat_template(CONVERSATIONS[1][:1])
    assert bytes(byte_prompt[1:]).decode() == "<|user|>\nName a colour.\n<|assistant|>\n"


# ----------------------------------------------------------------------------- errors

def load(tmp_path, seq_len=16, **kw):
    return data.load_dataset(cfg(tmp_path, **kw), load_tokenizer("bytes"), seq_len=seq_len)


def test_error_messages(tmp_path):
    with pytest.raises(data.DataError, match=r"^--data.path: file not found: .*nope.jsonl$"):
        load(tmp_path, path=str(tmp_path / "nope.jsonl"))
    with pytest.raises(data.DataError, match=r"^--data.path: no files match '.*\*.jsonl'$"):
        load(tmp_path, path=str(tmp_path / "none" / "*.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n\n{"text": oops}\n')
    with pytest.raises(data.DataError, match=r"bad.jsonl:3: not valid JSON \(Expecting value\); each line must be"):
        load(tmp_path, path=str(bad))
    with pytest.raises(data.DataError, match=r"f.jsonl:2: no field 'text' \(fields: body\); set --data.text_field"):
        load(tmp_path, path=write_jsonl(tmp_path / "f.jsonl", [{"text": "x"}, {"body": "y"}]))
    with pytest.raises(data.DataError, match=r"has 8 tokens, but one row needs at least seq_len\+1 = 65; "
                                             r"use a smaller --seq_len"):
        load(tmp_path, seq_len=64, val_fraction=0, path=write_jsonl(tmp_path / "s.jsonl", [{"text": "tiny 1"}]))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(data.DataError, match=r"empty.jsonl: the file is empty; remove it"):
        load(tmp_path, path=str(tmp_path / "empty.jsonl"))
    with pytest.raises(data.DataError, match=r"c.jsonl:2: messages\[1\] has role \"bot\"; allowed roles: "
                                             r"system, user, assistant$"):
        load(tmp_path, format="chat", path=write_jsonl(tmp_path / "c.jsonl", [
            {"messages": CONVERSATIONS[1]}, {"messages": [{"role": "user", "content": "x"}, {"role": "bot"}]}]))
    with pytest.raises(data.DataError, match=r"only 1 document\(s\).*--data.val_fraction=0"):
        load(tmp_path, path=write_jsonl(tmp_path / "one.jsonl", [{"text": "x" * 100}]))


# ------------------------------------------------------------------ Hugging Face datasets

def test_hf_dataset_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    texts = [f"saved row {i} " * 5 for i in range(30)]
    datasets.Dataset.from_dict({"content": texts, "n": list(range(30))}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(data.DataError, match=r"--data.text_field: dataset .* no column 'text' \(columns: content, n\)"):
        load(tmp_path, path=str(tmp_path / "ds"))
    train, val = load(tmp_path, path=str(tmp_path / "ds"), text_field="content", val_fraction=0.1)
    tok = load_tokenizer("bytes")
    text = tok.decode(np.concatenate([train.rows.reshape(-1), val.rows.reshape(-1)]))
    assert sum(t in text for t in texts) >= 29 and val.num_rows > 0
