"""Fine-tuning data (trainer/data.py, trainer/tokenizer.py): chat masks against transformers,
--data.fields templates, isolated packing, long conversations, bad rows, preference pairs."""
import hashlib
import json
import logging
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from trainer import data
from trainer.config import DataConfig, TrainConfig
from trainer.flags import ConfigError, parse
from trainer.tokenizer import ByteTokenizer, load_tokenizer, parse_fields

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Chat templates as an oracle sees them: {% generation %} around each assistant turn's content
# and its end token, the part meshlm masks. meshlm gets the same template without the tags.
CHATML = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
          "{% if m['role'] == 'assistant' and (all_turns or loop.last) %}"
          "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
          "{% else %}{{ m['content'] }}<|im_end|>{% endif %}{{ '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{% if m['role'] == 'assistant' and (all_turns or loop.last) %}"
          "{% generation %}{{ m['content'] | trim }}<|eot_id|>{% endgeneration %}"
          "{% else %}{{ m['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Add 2 and 3."},
     {"role": "assistant", "content": "2 + 3 = 5"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue, like the sea."}],
    [{"role": "user", "content": "Say ü and 日本"}, {"role": "assistant", "content": "ü 日本 done\n"},
     {"role": "user", "content": "Thanks"}],
]


def cfg(tmp_path, **kw):
    return DataConfig(**({"cache_dir": str(tmp_path / "cache"), "val_fraction": 0.0} | kw))


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def without_generation_tags(template):
    return re.sub(r"{%-? *(end)?generation *-?%}", "", template)


def hf_tokenizer(kind):
    """A transformers tokenizer with SPECIALS: the bytes one (one id per byte), or a small
    trained byte-level BPE that merges characters into words."""
    if kind == "bytes":
        tok = ByteTokenizer().to_hf()
    else:
        import tokenizers
        import transformers
        from pydoc_data.topics import topics
        bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
        bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = tokenizers.decoders.ByteLevel()
        trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"],
                                                 initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
        bpe.train_from_iterator([topics[t] for t in sorted(topics)[:20]], trainer)
        bpe.post_processor = tokenizers.processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
        tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>",
                                                   pad_token="<pad>")
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    return tok


@pytest.fixture(scope="module", params=["bytes", "bpe"])
def hf_pair(request, tmp_path_factory):
    """(transformers tokenizer, the same saved and loaded by meshlm) without a chat template."""
    tok = hf_tokenizer(request.param)
    out = str(tmp_path_factory.mktemp("tok") / request.param)
    tok.save_pretrained(out)
    return tok, load_tokenizer(out)


# ------------------------------------------------------------------ chat masks vs transformers

@pytest.mark.parametrize("template", [CHATML, LLAMA3], ids=["chatml", "llama3"])
@pytest.mark.parametrize("last_only", [False, True], ids=["all_turns", "last_turn"])
def test_chat_mask_matches_transformers(hf_pair, template, last_only):
    hf_tok, tok = hf_pair
    oracle = template.replace("all_turns", "false" if last_only else "true")
    tok.chat_template = without_generation_tags(oracle)
    for conv in CONVERSATIONS:
        if last_only and conv[-1]["role"] != "assistant":
            continue  # last_only is for a preference pair, which ends with its reply
        want = hf_tok.apply_chat_template(conv, chat_template=oracle, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
        ids, mask = tok.encode_chat(conv, last_only=last_only)
        assert ids == want["input_ids"]
        assert mask == want["assistant_masks"], hf_tok.convert_ids_to_tokens(ids)
        end = hf_tok.convert_tokens_to_ids("<|im_end|>" if template is CHATML else "<|eot_id|>")
        turns = 1 if last_only else sum(m["role"] == "assistant" for m in conv)
        assert [i for i, m in zip(ids, mask) if m].count(end) == turns  # each turn's end token is learned


# ------------------------------------------------------------------------- fields templates

ALPACA = [{"instruction": "Give a tip.", "input": "", "output": "Sleep."},
          {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5, said the function."}]


def test_fields_template_grammar():
    assert parse_fields("[instruction+input],output") == (
        (False, (("field", "instruction"), ("field", "input"))), (True, (("field", "output"),)))
    assert parse_fields(r'[<|im_start|>+"user\n" + q], "A:"+a+<|im_end|>') == (
        (False, (("special", "<|im_start|>"), ("text", "user\n"), ("field", "q"))),
        (True, (("text", "A:"), ("field", "a"), ("special", "<|im_end|>"))))
    for bad, why in [("[a,b", "unbalanced [ ]"), ("a],b", "unbalanced [ ]"), ('"abc', 'a "literal" is not closed'),
                     ("a,,b", "an empty part"), ("[]", "an empty part"),
                     ("a b", "'b' follows a piece: join pieces with +"),
                     ("a+", "a + with nothing after it"), ("[a]", "every part is a [prompt] part"),
                     (r'"\q"', 'the literal "\\q" is not a JSON string')]:
        with pytest.raises(ConfigError) as e:
            parse_fields(bad)
        assert str(e.value).startswith(f"--data.fields={bad!r}: {why}")
        assert str(e.value).endswith("; e.g. '[instruction+input],output'")


def fields_oracle(tok_kind, hf_tok, prefix, full):
    """ids of the full text as a document (the tokenizer's own specials, then EOS), and how
    many of them the prompt-only prefix text makes: tokenized separately by the tokenizer."""
    if tok_kind == "bytes":
        return [256, *full.encode(), 257], 1 + len(prefix.encode())
    ids = hf_tok(full)["input_ids"] + [hf_tok.eos_token_id]
    head = hf_tok(prefix)["input_ids"]
    assert ids[:len(head)] == head  # the prompt tokenizes the same alone and in the whole text
    return ids, len(head)


@pytest.mark.parametrize("kind", ["bytes", "hf"])
def test_fields_mask_is_the_prompt_prefix(tmp_path, kind):
    hf_tok = hf_tokenizer("bpe")
    if kind == "hf":
        hf_tok.save_pretrained(str(tmp_path / "tok"))
    tok = load_tokenizer("bytes" if kind == "bytes" else str(tmp_path / "tok"))
    template = '["### Instruction:"+instruction+input], ["### Response:"], output'
    path = write_jsonl(tmp_path / "alpaca.jsonl", ALPACA)
    train, _ = data.load_dataset(cfg(tmp_path, path=path, format="fields", fields=template), tok, seq_len=256)
    texts = [("### Instruction:\nGive a tip.\n### Response:\n", "Sleep."),  # the empty input adds nothing
             ("### Instruction:\nAdd the numbers.\n2 and 3\n### Response:\n", "5, said the function.")]
    assert train.num_rows == 1 and list(train.segments[0, :train.segments[0].argmin()][[0, -1]]) == [1, 2]
    for s, (prefix, reply) in enumerate(texts, 1):
        want, n_prompt = fields_oracle(kind, hf_tok, prefix, prefix + reply)
        doc = train.segments[0] == s
        assert train.rows[0][doc].tolist() == want
        assert train.row_mask[0][doc].tolist() == [0] * n_prompt + [1] * (len(want) - n_prompt)


def test_fields_literals_and_special_tokens(tmp_path):
    """Nothing is put next to a special token; the bytes tokenizer's specials become their ids."""
    tok = load_tokenizer("bytes")
    path = write_jsonl(tmp_path / "q.jsonl", [{"q": "Why?", "a": "Because.", "n": 3}])
    c = cfg(tmp_path, path=path, format="fields", fields=r'[<|pad|>+"Q: "+q+<|pad|>],"A:"+a')
    train, _ = data.load_dataset(c, tok, seq_len=64)
    prompt = [256, 258, *b"Q: \nWhy?", 258]
    reply = [*b"A:\nBecause.", 257]
    assert train.rows[0, :len(prompt) + len(reply)].tolist() == prompt + reply
    assert train.row_mask[0].tolist() == [0] * len(prompt) + [1] * len(reply) + [0] * (65 - len(prompt) - len(reply))
    # A special token the tokenizer does not have is named before any data is read.
    with pytest.raises(ConfigError, match=r"^--data.fields: <\|im_start\|> is not a special token of the tokenizer "
                                          r"bytes \(its special tokens: <\|bos\|>, <\|eos\|>, <\|pad\|>\)"):
        data.load_dataset(cfg(tmp_path, path=path, format="fields", fields="[<|im_start|>+q],a"), tok, seq_len=64)


def test_fields_flag_errors():
    with pytest.raises(ConfigError, match=r"^--data.format=fields needs --data.fields=TEMPLATE"):
        parse(TrainConfig, ["--data.format=fields"])
    with pytest.raises(ConfigError, match=r"^--data.fields='\[a': unbalanced"):
        parse(TrainConfig, ["--data.format=fields", "--data.fields=[a"])
    with pytest.raises(ConfigError, match=r"^--data.fields is read only with --data.format=fields"):
        parse(TrainConfig, ["--data.fields=a"])
    with pytest.raises(ConfigError, match=r"^--data.packing=stream would run chat documents into each other"):
        parse(TrainConfig, ["--data.format=chat", "--data.packing=stream"])
    c = parse(TrainConfig, ["--data.format=preference", "--data.long=drop", "--data.skip_bad_rows"]).data
    assert (c.packing, c.isolated, c.long, c.skip_bad_rows) == ("auto", True, "drop", True)
    assert not parse(TrainConfig, []).data.isolated


# --------------------------------------------------------------------------- isolated packing

def segments_of(batch, b):
    """The token runs of row b of a batch, by its segment ids: (segment, inputs, positions, loss_mask)."""
    seg, inp, pos, m = (batch[k][b].tolist() for k in ("segment_ids", "inputs", "positions", "loss_mask"))
    runs = []
    for t, s in enumerate(seg):
        if s and (not runs or runs[-1][0] != s):
            runs.append((s, [], [], []))
        if s:
            runs[-1][1].append(inp[t]), runs[-1][2].append(pos[t]), runs[-1][3].append(m[t])
    return runs


def check_isolation(batch):
    """segment_ids count 1, 2, ... then 0; positions restart at 0; no loss across a boundary or on padding."""
    seg, pos, mask = batch["segment_ids"], batch["positions"], batch["loss_mask"]
    for b in range(seg.shape[0]):
        ids = [s for s in seg[b].tolist() if s]
        n = len(ids)
        assert seg[b, n:].sum() == 0 and pos[b, n:].sum() == 0 and mask[b, n:].sum() == 0
        assert sorted(set(ids)) == list(range(1, max(ids, default=0) + 1)) and ids == sorted(ids)
        for t in range(seg.shape[1]):
            within = 0 if t == 0 or seg[b, t] != seg[b, t - 1] else pos[b, t - 1] + 1
            assert pos[b, t] == (within if seg[b, t] else 0)
            target_seg = seg[b, t + 1] if t + 1 < seg.shape[1] else None
            if target_seg is not None and target_seg != seg[b, t]:
                assert mask[b, t] == 0


def test_isolated_chat_packing(tmp_path):
    tok = load_tokenizer("bytes")
    convs = [CONVERSATIONS[i % 3][:2 + i % 3] for i in range(20)]
    convs = [c if any(m["role"] == "assistant" for m in c) else c + [{"role": "assistant", "content": "ok"}]
             for c in convs]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in convs])
    train, _ = data.load_dataset(cfg(tmp_path, path=path, format="chat"), tok, seq_len=128)
    assert train.num_rows < len(convs)  # several conversations share a row
    seen = []
    for batch in train.eval_batches(3):
        check_isolation(batch)
        for b in range(batch["inputs"].shape[0]):
            for s, inputs, positions, mask in segments_of(batch, b):
                last = batch["targets"][b][len([x for x in batch["segment_ids"][b] if 0 < x <= s]) - 1]
                seen.append((inputs + [int(last)], mask))
    # Every conversation exactly once, in order, whole: its tokens and mask as encode_chat makes them
    # (a row's last document keeps its last token only as a target, and only when padding follows).
    assert len(seen) == len(convs)
    for (got, mask), conv in zip(seen, convs):
        ids, want_mask = tok.encode_chat(conv)
        assert got[:len(ids)] == ids and len(got) in (len(ids), len(ids) + 1)
        assert mask[:len(ids) - 1] == [float(x) for x in want_mask[1:]]


def test_packed_documents_do_not_see_each_other(tmp_path):
    """Through the real model: a packed batch's summed loss is the sum of its documents' losses,
    each document scored alone in a row of its own (no segment ids, positions from 0)."""
    import jax
    import jax.numpy as jnp
    from trainer.families import FAMILIES, ModelConfig
    from trainer.model import batch_loss, build_model
    tok = load_tokenizer("bytes")
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[i % 3]} for i in range(6)])
    train, _ = data.load_dataset(cfg(tmp_path, path=path, format="chat"), tok, seq_len=256)
    (packed,) = train.eval_batches(train.num_rows)
    assert packed["segment_ids"].max() >= 2  # rows really hold several documents
    docs = [(train.rows[r][train.segments[r] == s], train.row_mask[r][train.segments[r] == s])
            for r in range(train.num_rows) for s in range(1, train.segments[r].max() + 1)]
    alone = {k: np.zeros((len(docs), 256), np.float32 if k == "loss_mask" else np.int32)
             for k in ("inputs", "targets", "loss_mask")}
    for i, (ids, mask) in enumerate(docs):
        alone["inputs"][i, :len(ids) - 1], alone["targets"][i, :len(ids) - 1] = ids[:-1], ids[1:]
        alone["loss_mask"][i, :len(ids) - 1] = mask[1:]
    model = build_model(ModelConfig(**{"model_type": "llama", **FAMILIES["llama"].presets["tiny"],
                                       "num_hidden_layers": 2}))
    params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 256), jnp.int32))["params"]
    score = jax.jit(lambda b: batch_loss(model, params, b))
    (s_packed, n_packed), (s_alone, n_alone) = (score(b) for b in (packed, alone))
    assert float(n_packed) == float(n_alone) == sum(m[1:].sum() for _, m in docs) > 0
    np.testing.assert_allclose(float(s_packed), float(s_alone), rtol=1e-5)
    # ... which is no accident: without the segment keys the documents do see each other.
    s_mixed, _ = score({k: packed[k] for k in ("inputs", "targets", "loss_mask")})
    assert abs(float(s_mixed) - float(s_alone)) > 1e-3 * float(s_alone)


def test_isolated_text_cuts_long_documents(tmp_path):
    tok = load_tokenizer("bytes")
    docs = ["short one", "x" * 50, "a much longer document " * 3, "end"]
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": d} for d in docs])
    train, _ = data.load_dataset(cfg(tmp_path, path=path, packing="isolated"), tok, seq_len=23)
    row_len = 24
    pieces = []
    for r in range(train.num_rows):
        seg = train.segments[r]
        for s in range(1, seg.max() + 1):
            pieces.append(train.rows[r][seg == s].tolist())
            assert train.row_mask[r][seg == s].tolist() == [0] + [1] * (int((seg == s).sum()) - 1)
    want = [p for d in docs for ids in [[256, *d.encode(), 257]] for p in
            (ids[i:i + row_len] for i in range(0, len(ids), row_len))]
    assert pieces == want
    check_isolation(train.batch(0, 4, seed=0))


def test_isolated_batches_are_deterministic(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[i % 2]} for i in range(30)])
    tok = load_tokenizer("bytes")
    a, _ = data.load_dataset(cfg(tmp_path, path=path, format="chat", cache_dir=str(tmp_path / "c1")), tok, 128)
    b, _ = data.load_dataset(cfg(tmp_path, path=path, format="chat", cache_dir=str(tmp_path / "c2")), tok, 128)

    def digest(x):
        return hashlib.sha256(b"".join(x[k].tobytes() for k in sorted(x))).hexdigest()
    assert digest(a.batch(7, 4, seed=3)) == digest(b.batch(7, 4, seed=3)) != digest(a.batch(8, 4, seed=3))
    full = a.batch(2, 4, seed=0)
    assert all(np.array_equal(a.batch(2, 4, seed=0, rows=slice(2, 4))[k], full[k][2:4]) for k in full)


def test_eval_batches_pad_the_segment_keys(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[1]}] * 3)
    train, _ = data.load_dataset(cfg(tmp_path, path=path, format="chat"), load_tokenizer("bytes"), seq_len=64)
    (batch,) = train.eval_batches(train.num_rows + 2)
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
        k: ((train.num_rows + 2, 64), np.float32 if k == "loss_mask" else np.int32)
        for k in ("inputs", "targets", "loss_mask", "segment_ids", "positions")}
    pad = slice(train.num_rows, None)
    assert (batch["inputs"][pad] == 258).all() and (batch["targets"][pad] == 258).all()
    assert not batch["segment_ids"][pad].any() and not batch["positions"][pad].any()
    assert not batch["loss_mask"][pad].any()


# ------------------------------------------------------------------------ long conversations

def exchange(i, n=20):
    return [{"role": "user", "content": f"question {i} " + "q" * n},
            {"role": "assistant", "content": f"answer {i} " + "a" * n}]


def test_long_conversations_truncate_by_whole_exchanges(tmp_path, caplog):
    tok = load_tokenizer("bytes")
    system = [{"role": "system", "content": "You are terse."}]
    long = system + exchange(0) + exchange(1) + exchange(2)
    huge = exchange(9, n=200)  # even its last exchange is longer than a row
    short = exchange(5)
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in (short, long, huge)])
    seq_len = len(tok.encode_chat(system + exchange(1) + exchange(2))[0]) - 1  # exactly the last two fit
    with caplog.at_level(logging.WARNING, logger="trainer.data"):
        train, _ = data.load_dataset(cfg(tmp_path, path=path, format="chat"), tok, seq_len=seq_len)
    assert caplog.messages == [f"data: 2 of 3 conversations were longer than seq_len={seq_len}; truncated "
                               "(--data.long=truncate), 1 of them dropped: even the last exchange does not fit"]
    docs = [train.rows[r][train.segments[r] == s].tolist() for r in range(train.num_rows)
            for s in range(1, train.segments[r].max() + 1)]
    assert docs == [tok.encode_chat(short)[0], tok.encode_chat(system + exchange(1) + exchange(2))[0]]
    caplog.clear()  # the cache remembers the warning
    with caplog.at_level(logging.WARNING, logger="trainer.data"):
        data.load_dataset(cfg(tmp_path, path=path, format="chat"), tok, seq_len=seq_len)
    assert len(caplog.messages) == 1 and "truncated" in caplog.messages[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer.data"):
        train, _ = data.load_dataset(cfg(tmp_path, path=path, format="chat", long="drop"), tok, seq_len=seq_len)
    assert caplog.messages == [f"data: 2 of 3 conversations were longer than seq_len={seq_len}; dropped "
                               "(--data.long=drop)"]
    assert train.rows[0][train.segments[0] == 1].tolist() == tok.encode_chat(short)[0] and train.segments.max() == 1


def test_truncation_keeps_an_assistant_turn(tmp_path):
    tok = load_tokenizer("bytes")
    conv = exchange(0) + [{"role": "user", "content": "and a long follow-up with no reply " * 3}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": conv}, {"messages": exchange(1)}])
    train, _ = data.load_dataset(cfg(tmp_path, path=path, format="chat"), tok, seq_len=100)
    assert train.segments.max() == 1
    assert train.rows[0][train.segments[0] == 1].tolist() == tok.encode_chat(exchange(1))[0]


def test_long_fields_rows_are_dropped(tmp_path, caplog):
    rows = [{"q": "short", "a": "fine"}, {"q": "long " * 40, "a": "x"}]
    path = write_jsonl(tmp_path / "f.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="trainer.data"):
        train, _ = data.load_dataset(cfg(tmp_path, path=path, format="fields", fields="[q],a"),
                                     load_tokenizer("bytes"), seq_len=32)
    assert caplog.messages == ["data: 1 of 2 rows were longer than seq_len=32; dropped "
                               "(a fields row is never truncated)"]
    assert train.segments.max() == 1


def test_warning_prints_without_logging_configuration(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": exchange(0)}, {"messages": exchange(1, n=150)}])
    code = ("from trainer import data, config, tokenizer; data.load_dataset(config.{!r}, "
            "tokenizer.load_tokenizer('bytes'), {})")
    out = subprocess.run([sys.executable, "-c", code.format(cfg(tmp_path, path=path, format="chat"), 128)],
                         cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stderr == ("data: 1 of 2 conversations were longer than seq_len=128; truncated (--data.long=truncate), "
                          "1 of them dropped: even the last exchange does not fit\n")
    with pytest.raises(data.DataError, match=r"^--seq_len=32: 2 of 2 conversations were longer than seq_len=32; "
                                             r"truncated .*, so none is left; raise --seq_len$"):
        data.load_dataset(cfg(tmp_path, path=path, format="chat"), load_tokenizer("bytes"), 32)


# --------------------------------------------------------------------------------- bad rows

GOOD = {"messages": CONVERSATIONS[1]}


@pytest.mark.parametrize("row, fmt, message", [
    ({"messages": [{"role": "bot", "content": "x"}]}, "chat",
     r'messages\[0\] has role "bot"; allowed roles: system, user, assistant$'),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}, "chat",
     r'messages\[0\] has no "content"; every message needs a string "content"$'),
    ({"messages": [{"role": "user", "content": ["x"]}, {"role": "assistant", "content": "x"}]}, "chat",
     r'messages\[0\]\["content"\] is a list; it must be a string$'),
    ({"messages": [{"role": "user", "content": "hi"}]}, "chat",
     r"no assistant turn; a conversation needs at least one \{\"role\": \"assistant\"\} message"),
    ('{"messages": [oops', "chat", r"not valid JSON \(Expecting value\); each line must be one JSON object$"),
    ({"instruction": "x", "output": "y"}, "fields",
     r"no field 'input', which --data.fields names \(the row's fields: instruction, output\)$"),
    ({"instruction": "x", "input": "", "output": 5}, "fields",
     r"field 'output' is a number, not a string; --data.fields reads string fields only$"),
    ({"prompt": "x", "chosen": "y"}, "preference",
     r"no field 'rejected' \(fields: prompt, chosen\); a preference row needs \"prompt\", \"chosen\" and "
     r"\"rejected\"$"),
    ({"prompt": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "chosen": "a",
      "rejected": "b"}, "preference", r"'prompt' ends with a assistant turn; it must end with the user turn"),
])
def test_bad_row_errors_and_skipping(tmp_path, caplog, row, fmt, message):
    good = {"chat": GOOD, "fields": ALPACA[1], "preference": {"prompt": "p", "chosen": "c", "rejected": "r"}}[fmt]
    path = write_jsonl(tmp_path / "data.jsonl", [good, good, row, good])
    kw = dict(path=path, format=fmt, fields="[instruction+input],output" if fmt == "fields" else "")
    with pytest.raises(data.DataError, match=r"^.*/data.jsonl:3: " + message):
        data.load_dataset(cfg(tmp_path, **kw), load_tokenizer("bytes"), seq_len=128)
    with caplog.at_level(logging.WARNING, logger="trainer.data"):
        train, _ = data.load_dataset(cfg(tmp_path, skip_bad_rows=True, **kw), load_tokenizer("bytes"), seq_len=128)
    assert len(caplog.messages) == 1 and re.fullmatch(r"data: skipped 1 bad rows of 4 \(first: .*/data.jsonl:3: "
                                                      + message.rstrip("$") + r".*\)", caplog.messages[0])
    documents = train.num_rows if fmt == "preference" else train.segments.max(axis=1).sum()
    assert documents == 3


def test_all_bad_rows_and_empty_files(tmp_path):
    tok = load_tokenizer("bytes")
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": []}, "[1]"])
    with pytest.raises(data.DataError, match=r"^all 2 rows are bad \(first: .*bad.jsonl:1: 'messages' must be a "
                                             r"non-empty list"):
        data.load_dataset(cfg(tmp_path, path=path, format="chat", skip_bad_rows=True), tok, 64)
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "a.jsonl", [GOOD] * 3)
    (tmp_path / "d" / "b.jsonl").write_text("\n  \n")
    for skip in (False, True):  # an empty file is no bad row: always an error
        with pytest.raises(data.DataError, match=r"^.*/d/b.jsonl: the file is empty; remove it or leave it out of "
                                                 r"--data.path$"):
            data.load_dataset(cfg(tmp_path, path=str(tmp_path / "d" / "*.jsonl"), format="chat", skip_bad_rows=skip),
                              tok, 64)


# ---------------------------------------------------------------------------- preference

PAIRS = [
    {"prompt": "What is 2+2?", "chosen": "4.", "rejected": "5, probably."},
    {"prompt": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Rate me."}],
     "chosen": {"role": "assistant", "content": "Ten."}, "rejected": [{"role": "assistant", "content": "Two."}]},
    {"prompt": "Colour of the sky?", "chosen": "Blue.", "rejected": "Green."},
]


def reply_text(reply):
    return reply if isinstance(reply, str) else (reply if isinstance(reply, dict) else reply[0])["content"]


def test_preference_batches(tmp_path):
    tok = load_tokenizer("bytes")
    path = write_jsonl(tmp_path / "p.jsonl", PAIRS * 4)
    train, _ = data.load_dataset(cfg(tmp_path, path=path, format="preference"), tok, seq_len=96)
    batch = train.batch(1, 5, seed=0)
    assert {k: v.shape for k, v in batch.items()} == {k: (5, 2, 96) for k in ("inputs", "targets", "loss_mask")}
    replies = [(reply_text(p["chosen"]), reply_text(p["rejected"])) for p in PAIRS]
    for b in range(5):
        learned = [batch["targets"][b, i][batch["loss_mask"][b, i] > 0].tolist() for i in (0, 1)]
        assert all(ids[-1] == tok.eos_id for ids in learned)  # the reply's end token is learned
        # Loss on the replies alone (not the earlier "Hello." turn), chosen first, both of one pair.
        k = replies.index(tuple(tok.decode(ids) for ids in learned))
        prompt = PAIRS[k]["prompt"]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        for i, reply in enumerate(replies[k]):
            ids, _ = tok.encode_chat(prompt + [{"role": "assistant", "content": reply}])
            row = ids + [tok.pad_id] * (97 - len(ids))  # padded at the end, without loss
            assert batch["inputs"][b, i].tolist() == row[:-1] and batch["targets"][b, i].tolist() == row[1:]
            assert not batch["loss_mask"][b, i][len(ids) - 1:].any()


def test_preference_validation_split_and_eval_batches(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", PAIRS * 7)
    train, val = data.load_dataset(cfg(tmp_path, path=path, format="preference", val_fraction=0.2),
                                   load_tokenizer("bytes"), seq_len=96)
    assert (train.num_rows, val.num_rows) == (17, 4)
    batches = list(val.eval_batches(3))
    assert [b["inputs"].shape for b in batches] == [(3, 2, 96), (3, 2, 96)]
    assert not batches[1]["loss_mask"][1:].any() and (batches[1]["inputs"][1:] == 258).all()


def test_long_preference_pairs(tmp_path, caplog):
    tok = load_tokenizer("bytes")
    long_prompt = [{"role": "system", "content": "S"}, *exchange(0), {"role": "user", "content": "last?"}]
    rows = [{"prompt": long_prompt, "chosen": "yes", "rejected": "no"},
            {"prompt": "q" * 200, "chosen": "yes", "rejected": "no"}, PAIRS[0]]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="trainer.data"):
        train, _ = data.load_dataset(cfg(tmp_path, path=path, format="preference"), tok, seq_len=64)
    assert caplog.messages == ["data: 2 of 3 pairs were longer than seq_len=64; truncated (--data.long=truncate), "
                               "1 of them dropped: even the last exchange does not fit"]
    shortened = [long_prompt[0], long_prompt[-1], {"role": "assistant", "content": "yes"}]
    assert train.num_rows == 2
    assert train.rows[0, 0][train.rows[0, 0] != tok.pad_id].tolist() == tok.encode_chat(shortened)[0]


def test_hf_dataset_rows_for_fields_and_preference(tmp_path):
    datasets = pytest.importorskip("datasets")
    tok = load_tokenizer("bytes")
    datasets.Dataset.from_list(ALPACA * 3).save_to_disk(str(tmp_path / "alpaca"))
    with pytest.raises(data.DataError, match=r"^--data.fields: dataset .*alpaca has no column 'question' "
                                             r"\(columns: instruction, input, output\)$"):
        data.load_dataset(cfg(tmp_path, path=str(tmp_path / "alpaca"), format="fields", fields="[question],output"),
                          tok, 128)
    train, _ = data.load_dataset(cfg(tmp_path, path=str(tmp_path / "alpaca"), format="fields",
                                     fields="[instruction+input],output"), tok, 128)
    assert train.segments.max(axis=1).sum() == 6
    assert tok.decode(train.rows[0][train.segments[0] == 1]) == "Give a tip.\nSleep."
    pairs = [{"prompt": f"Q{i}?", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(4)]
    datasets.Dataset.from_list(pairs).save_to_disk(str(tmp_path / "pairs"))
    train, _ = data.load_dataset(cfg(tmp_path, path=str(tmp_path / "pairs"), format="preference"), tok, 64)
    assert [tok.decode(r[0]).endswith(f"good {i}") and tok.decode(r[1]).endswith(f"bad {i}")
            for i, r in enumerate(train.rows)] == [True] * 4


# ------------------------------------------------------------------------------- end to end

def test_train_cli_on_fields_data(tmp_path, cli):
    rows = [{"instruction": f"Repeat {i}.", "input": "" if i % 2 else "twice", "output": f"{i} {i}"} for i in range(60)]
    rows.append({"instruction": "x" * 100, "input": "", "output": "too long"})
    path = write_jsonl(tmp_path / "alpaca.jsonl", rows)
    out = cli("train", f"--data.path={path}", "--data.format=fields", "--data.fields=[instruction+input],output",
              f"--data.cache_dir={tmp_path / 'cache'}", f"--output_dir={tmp_path / 'run'}", "--steps=3",
              "--seq_len=64", "--batch_size=4", "--log_every=1", "--model.hidden_size=64",
              "--model.num_hidden_layers=1")
    assert "data: 1 of 61 rows were longer than seq_len=64; dropped (a fields row is never truncated)" in out.stderr
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2, 3]
    assert all(np.isfinite(m["loss"]) for m in metrics if "loss" in m)


def test_eval_names_its_own_fields_flag(tmp_path):
    """trainer.eval's flags are --fields and --data, not the train command's --data.*."""
    from tiny_hf import make_hf_dir
    from trainer import eval as eval_cli
    model = str(tmp_path / "hf")
    make_hf_dir(model, "llama_gqa")
    path = write_jsonl(tmp_path / "rows.jsonl", [{"q": "a", "a": "b"}])
    with pytest.raises(SystemExit) as e:
        eval_cli.main([f"--checkpoint={model}", f"--data={path}", "--format=fields",
                       "--fields=[q,a"])
    assert str(e.value).startswith("error: --fields='[q,a': ")
