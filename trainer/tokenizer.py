"""Tokenizers (bytes, Hugging Face, SentencePiece) and the one rule for what text encodes to.

The rule, kept here and nowhere else:
  - a document or a prompt encodes as transformers' `tokenizer(text)` does, with its default
    add_special_tokens: BOS (or anything else) only where the tokenizer itself adds it.
    The bytes and SentencePiece tokenizers add BOS, and so do their exported HF forms;
  - a document then ends with EOS, which separates packed documents;
  - a chat encodes as `apply_chat_template`: the tokenizer's own template, or
    BUILTIN_CHAT_TEMPLATE for tokenizers that bring none. The loss mask of a chat is 1
    exactly on the characters of each assistant turn (its closing token included);
  - a fields row (--data.fields) encodes as its rendered text would by `tokenizer(text)`
    (the same specials around it), then EOS; special-token text becomes its id.
"""

import functools
import hashlib
import json
import os
import re
import tempfile

import fsspec

from trainer import storage
from trainer.errors import UserError, one_line
from trainer.flags import ConfigError


class TokenizerError(UserError):
    """A tokenizer that can't be loaded or used; one line naming it."""


# The built-in chat format, for tokenizers that bring no template:
#   [BOS]<|user|>\n{content}\n<|assistant|>\n{content}[EOS]...
# Jinja, so that an exported model is prompted exactly as it was trained.
BUILTIN_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>\n{{ m['content'] }}{{ eos_token }}"
    "{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


class Tokenizer:
    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int
    name: str
    specials: dict  # special token text -> id, for rendering and reading chat templates

    def encode(self, text: str) -> list[int]:
        """The text's own tokens, no special tokens added."""
        raise NotImplementedError

    def encode_batch(self, texts):
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        raise NotImplementedError

    def encode_text(self, text: str) -> list[int]:
        """A prompt, as `tokenizer(text)` gives it: with the specials the tokenizer adds."""
        return self.encode_texts([text])[0]

    def encode_texts(self, texts):
        bos = [self.bos_id] if self.bos_id is not None else []
        return [bos + ids for ids in self.encode_batch(texts)]

    def encode_documents(self, texts):
        """Training documents: encode_text, then EOS to separate packed documents."""
        return [ids if ids[-1:] == [self.eos_id] else ids + [self.eos_id]
                for ids in self.encode_texts(texts)]

    @property
    def stop_ids(self) -> frozenset:
        """The ids that end a generation: EOS here; see HFTokenizer."""
        return frozenset({self.eos_id})

    def fingerprint(self) -> str:
        """What must match for cached token ids to be reusable."""
        return f"{self.name}|{self.vocab_size}|{self.bos_id}|{self.eos_id}"

    # ---------------------------------------------------------------- chat
    def render_chat(self, messages, add_generation_prompt=False) -> str:
        import jinja2.sandbox
        # The environment transformers renders chat templates in.
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        ids = {v: k for k, v in self.specials.items()}
        return env.from_string(BUILTIN_CHAT_TEMPLATE).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=ids.get(self.bos_id, ""), eos_token=ids[self.eos_id])

    def apply_chat_template(self, messages, add_generation_prompt=True) -> list[int]:
        """Prompt ids for generation and serving: the conversation, then the assistant header."""
        return self._encode_spans(self.render_chat(messages, add_generation_prompt), [])[0]

    def encode_chat(self, messages, last_only=False):
        """(ids, mask) of a whole conversation; mask is 1 on the assistant turns (with
        last_only, on the last one: a preference pair's response)."""
        # An assistant turn is the text between the prompt rendered up to it (with the
        # generation header) and the conversation rendered through it.
        full = self.render_chat(messages)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        spans = []
        for i in turns[-1:] if last_only else turns:
            start = self.render_chat(messages[:i], True)
            through = self.render_chat(messages[: i + 1])
            if not (full.startswith(start) and full.startswith(through)):
                raise ValueError("the chat template does not render earlier turns the same way "
                                 "as the whole conversation, so assistant turns cannot be located")
            # The turn's own text, its end token included, without trailing newlines.
            spans.append((len(start), len(start) + len(through[len(start):].rstrip())))
        return self._encode_spans(full, spans)

    # --------------------------------------------------------------- fields
    def encode_fields(self, segments):
        """(ids, mask) of a rendered fields row: `segments` are (text, loss) in order. The
        text gets the specials `encode_text` puts around a text and then EOS (as a document);
        those after it carry the loss of the last segment, those before it none."""
        text, spans, at = "", [], 0
        for piece, loss in segments:
            if loss and spans and spans[-1][1] == at:
                spans[-1] = (spans[-1][0], at + len(piece))  # one span: fewer cuts
            elif loss:
                spans.append((at, at + len(piece)))
            text, at = text + piece, at + len(piece)
        ids, mask = self._encode_spans(text, spans)
        before, after = self._added_around
        last = int(segments[-1][1])
        ids, mask = before + ids + after, [0] * len(before) + mask + [last] * len(after)
        if ids[-1:] != [self.eos_id]:
            ids, mask = ids + [self.eos_id], mask + [last]
        return ids, mask

    @functools.cached_property
    def _added_around(self):
        """The ids `encode_text` puts before and after a text's own tokens (computed once:
        every fields row needs them)."""
        own, full = self.encode("a"), self.encode_text("a")
        i = next(i for i in range(len(full) - len(own) + 1) if full[i:i + len(own)] == own)
        return full[:i], full[i + len(own):]

    def _encode_spans(self, text, spans):
        """(ids, mask) of rendered text, mask 1 inside spans. Pieces are encoded one by one,
        special-token text becoming its id (a bytes / SentencePiece tokenizer has no
        character offsets, and its encoding of a piece does not depend on its neighbours)."""
        cuts = sorted({0, len(text), *[c for span in spans for c in span]})
        pattern = "(" + "|".join(map(re.escape, self.specials)) + ")"
        ids, mask = [], []
        for a, b in zip(cuts, cuts[1:]):
            inside = int(any(s <= a and b <= e for s, e in spans))
            for part in re.split(pattern, text[a:b]):
                piece = [self.specials[part]] if part in self.specials else self.encode(part)
                ids += piece
                mask += [inside] * len(piece)
        return ids, mask


class ByteTokenizer(Tokenizer):
    """Raw UTF-8 bytes (ids 0..255) plus three specials; needs no files."""

    def __init__(self):
        self.name, self.vocab_size = "bytes", 259
        self.bos_id, self.eos_id, self.pad_id = 256, 257, 258
        self.specials = {"<|bos|>": 256, "<|eos|>": 257, "<|pad|>": 258}

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    def to_hf(self):
        """The same tokenizer as a transformers one: byte-level BPE without merges, ids 0-255
        the bytes, 256/257/258 bos/eos/pad, BOS added to every text."""
        import transformers
        from tokenizers import AddedToken, Tokenizer as RustTokenizer, decoders, models
        from tokenizers import pre_tokenizers
        from transformers.convert_slow_tokenizer import bytes_to_unicode
        chars = bytes_to_unicode()
        tok = RustTokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in self.specials])
        tok.post_processor = bos_post_processor("<|bos|>", self.bos_id)
        return transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>")


def bos_post_processor(bos_token, bos_id):
    """A tokenizers post-processor that puts BOS before every text."""
    from tokenizers import processors
    return processors.TemplateProcessing(single=f"{bos_token} $A",
                                         pair=f"{bos_token} $A {bos_token} $B",
                                         special_tokens=[(bos_token, bos_id)])


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, spec: str, model_proto: bytes):
        import sentencepiece
        self._sp = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
        self.name, self.vocab_size = spec, self._sp.get_piece_size()
        bos, eos, pad = self._sp.bos_id(), self._sp.eos_id(), self._sp.pad_id()
        if eos < 0:
            raise TokenizerError(f"--tokenizer: SentencePiece model {spec} has no EOS piece; "
                                 "train it with eos_id set")
        self.bos_id = bos if bos >= 0 else None
        self.eos_id, self.pad_id = eos, (pad if pad >= 0 else eos)
        self.specials = {self._sp.id_to_piece(i): i for i in (bos, eos) if i >= 0}

    def encode(self, text):
        return self._sp.encode(text)

    def encode_batch(self, texts):
        return self._sp.encode(texts)

    def fingerprint(self):
        return super().fingerprint() + "|" + hashlib.sha256(self._sp.serialized_model_proto()).hexdigest()

    def decode(self, ids):
        return self._sp.decode([int(i) for i in ids])  # control pieces (bos/eos) decode to ""


class HFTokenizer(Tokenizer):
    def __init__(self, spec: str, local_dir: str):
        import transformers
        try:
            self._tok = transformers.AutoTokenizer.from_pretrained(local_dir, local_files_only=True)
        except Exception as e:  # noqa: BLE001 -- any load failure is the user's files
            raise TokenizerError(f"--tokenizer: cannot load Hugging Face tokenizer from {spec}: "
                                 f"{one_line(e)}") from None
        tok = self._tok
        tok.model_max_length = 1 << 62  # we pack long documents; silence "sequence too long" warnings
        if tok.eos_token_id is None:
            raise TokenizerError(f"--tokenizer: {spec} has no eos_token; set \"eos_token\" in its "
                                 "tokenizer_config.json")
        self.name, self.vocab_size = spec, len(tok)  # len() counts added tokens too
        self.bos_id, self.eos_id = tok.bos_token_id, tok.eos_token_id
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        # Added tokens are matched as written wherever they appear in a text.
        self.specials = dict(tok.get_added_vocab())
        self.chat_template = tok.chat_template or BUILTIN_CHAT_TEMPLATE
        self._local_dir = local_dir

    @functools.cached_property
    def stop_ids(self):
        """EOS and every eos_token_id of the generation_config.json beside the tokenizer, as
        HF's generate stops at any of them: chat models end a turn with a token that may not
        be the tokenizer's EOS (Llama 3 Instruct: <|eot_id|>; Gemma: <end_of_turn>)."""
        path = os.path.join(self._local_dir, "generation_config.json")
        eos = storage.read_json(path).get("eos_token_id") if os.path.exists(path) else None
        return frozenset({self.eos_id, *(eos if isinstance(eos, list) else
                                         [] if eos is None else [eos])})

    def encode(self, text):
        return self._tok.encode(text, add_special_tokens=False)

    def encode_batch(self, texts):
        return self._tok(texts, add_special_tokens=False)["input_ids"]  # batched in Rust

    def encode_texts(self, texts):
        return self._tok(texts)["input_ids"]  # the tokenizer's own special tokens

    def decode(self, ids):
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def fingerprint(self):
        vocab = json.dumps([sorted(self._tok.get_vocab().items()), self.chat_template,
                            self.encode_text("a")])  # what it adds around a text counts too
        return super().fingerprint() + "|" + hashlib.sha256(vocab.encode()).hexdigest()

    def render_chat(self, messages, add_generation_prompt=False):
        return self._tok.apply_chat_template(messages, chat_template=self.chat_template,
                                             tokenize=False,
                                             add_generation_prompt=add_generation_prompt)

    def _encode_spans(self, text, spans):
        # As transformers' apply_chat_template: the rendered text, no specials added.
        enc = self._tok(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = [int(e > s and any(a <= s and e <= b for a, b in spans))
                for s, e in enc["offset_mapping"]]
        return list(enc["input_ids"]), mask


# ------------------------------------------------------------------- fields templates

_FIELDS_TOKEN = re.compile(r'\s*(?:(?P<text>"(?:[^"\\]|\\.)*")|(?P<special><[^\s<>",+\[\]]+>)'
                           r'|(?P<field>[^\s\[\],+"<>]+)|(?P<op>[\[\],+])|(?P<bad>\S))')


def parse_fields(template: str):
    """--data.fields: how a JSON row becomes one training text.

    A template is comma-separated parts, concatenated in order. A part in square brackets,
    `[...]`, is prompt (no loss); any other part carries loss. Inside a part, pieces are
    joined with `+`. A piece is
      - a field name of the row (its value must be a string),
      - a double-quoted literal with JSON escapes, e.g. "### Response:",
      - a special token written as-is, e.g. <|im_start|>: one of the tokenizer's specials.
    Neighbouring pieces, within a part and across parts, are separated by one newline,
    except that a field whose value is empty adds nothing (no newline either), and nothing
    is put next to a special token. So '[instruction+input],output' on {"instruction":
    "Give a tip.", "input": "", "output": "Sleep."} renders "Give a tip.\nSleep.", with
    loss on "Sleep." (and on the EOS that ends the document).

    Returns ((loss, ((kind, value), ...)), ...), kind one of field | text | special (a
    literal's value is its decoded text). A bad template is a ConfigError naming the flag.
    """
    def fail(what):
        raise ConfigError(f"--data.fields={template!r}: {what}; e.g. '[instruction+input],output'")

    tokens, pos, text = [], 0, template.rstrip()
    while pos < len(text):
        m = _FIELDS_TOKEN.match(text, pos)
        kind, value, pos = m.lastgroup, m.group(m.lastgroup), m.end()
        if kind == "bad":
            fail('a "literal" is not closed' if value == '"' else f"cannot read {value!r} at "
                 f"column {pos}: pieces are field names, \"literals\" or <special> tokens")
        if kind == "text":
            try:
                value = json.loads(value, strict=False)  # a raw newline is fine too
            except json.JSONDecodeError as e:
                fail(f"the literal {value} is not a JSON string ({e.msg})")
        tokens.append((kind, value))

    def at(i):
        return tokens[i] if i < len(tokens) else ("end", "")

    parts, i = [], 0
    while True:
        prompt = at(i) == ("op", "[")
        i += prompt
        pieces = []
        while True:  # piece (+ piece)*
            kind, value = at(i)
            if kind == "op" and value == "[":
                fail("unbalanced [ ] (brackets do not nest)")
            if kind in ("op", "end"):
                fail("a + with nothing after it" if pieces else "an empty part")
            pieces.append((kind, value))
            i += 1
            if at(i) != ("op", "+"):
                break
            i += 1
        if prompt:
            if at(i) != ("op", "]"):
                fail("unbalanced [ ]")
            i += 1
        parts.append((not prompt, tuple(pieces)))
        if at(i)[0] == "end":
            break
        if at(i) != ("op", ","):
            fail("unbalanced [ ]" if at(i)[1] in "[]" else
                 f"{at(i)[1]!r} follows a piece: join pieces with + and parts with ,")
        i += 1
    if not any(loss for loss, _ in parts):
        fail("every part is a [prompt] part, so nothing would be learned; leave the response "
             "part unbracketed")
    return tuple(parts)


def load_tokenizer(spec: str) -> Tokenizer:
    """'bytes', a Hugging Face tokenizer directory, or a SentencePiece .model file (local or gs://)."""
    if spec == "bytes":
        return ByteTokenizer()
    fs, path = fsspec.core.url_to_fs(spec)
    if spec.endswith(".model") and fs.isfile(path):
        with fs.open(path, "rb") as f:
            return SentencePieceTokenizer(spec, f.read())
    if os.path.basename(path) in ("tokenizer.json", "tokenizer_config.json") and fs.isfile(path):
        spec = spec.rsplit("/", 1)[0]
        path = os.path.dirname(path)
    if fs.isdir(path) and any(fs.exists(f"{path}/{n}") for n in ("tokenizer.json",
                                                                 "tokenizer_config.json")):
        # transformers reads local files only; a remote dir is copied once per process.
        return HFTokenizer(spec, storage.stage(spec, storage.TOKENIZER_FILES))
    raise TokenizerError(f"--tokenizer: {spec!r} is not 'bytes', a Hugging Face tokenizer "
                         "directory or a SentencePiece .model file")


def to_hf(spec):
    """The tokenizer a meshlm spec names, as a transformers tokenizer that encodes texts and
    chats the same way (with a chat template and BOS as meshlm uses them)."""
    import transformers
    tok = load_tokenizer(spec)
    if isinstance(tok, ByteTokenizer):
        hf_tok = tok.to_hf()
    elif isinstance(tok, SentencePieceTokenizer):  # converted by transformers
        source = tempfile.mkdtemp(prefix="meshlm-sp-")
        with fsspec.open(spec, "rb") as f, open(os.path.join(source, "tokenizer.model"), "wb") as g:
            g.write(f.read())
        hf_tok = transformers.AutoTokenizer.from_pretrained(source, local_files_only=True)
        if tok.bos_id is not None:  # meshlm puts BOS before every SentencePiece text
            hf_tok.backend_tokenizer.post_processor = bos_post_processor(
                hf_tok.convert_ids_to_tokens(tok.bos_id), tok.bos_id)
    else:
        hf_tok = tok._tok
    if not hf_tok.chat_template:
        hf_tok.chat_template = BUILTIN_CHAT_TEMPLATE
    return hf_tok
