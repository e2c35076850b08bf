"""Data sources, the tokenization cache, packing and the batch for step k.

Formats (--data.format) and their JSONL rows:
  text        {"text": "..."}, or .txt files: every token is learned
  chat        {"messages": [{"role": "system|user|assistant", "content": "..."}, ...]}:
              loss on the assistant turns (tokenizer.py says exactly where)
  fields      any JSON object, rendered by the --data.fields template (tokenizer.parse_fields)
  preference  {"prompt": "..." or messages ending in a user turn, "chosen": "...",
              "rejected": "..."}: two sequences through the chat template, loss on the replies

Flow: a source yields rows -> each row is checked and becomes one document of ids with a
per-token loss mask (two for a preference pair); a bad row is one DataError naming its file
and line, or with --data.skip_bad_rows is skipped and counted; a conversation longer than a
row is shortened by whole exchanges or dropped (--data.long) -> the documents are written
to token shards (trainer/tokenize.py; --data.path may name such a directory, else the
automatic cache builds one) -> split by whole documents (pairs) into train/validation ->
packed into rows of seq_len+1 tokens -> `Dataset.batch(step)` picks rows by a per-epoch
keyed permutation (permute.py). Text is read lazily from the shards (StreamDataset: only the
rows a step needs); chat, fields and preference sets are packed in memory. --data.mix draws
each step's rows from several such sources by weight (Mixture). The batch for a step is a
pure function of (data, seed, step): there is no iterator state (DESIGN rule 4).

Packing (--data.packing): `stream` concatenates documents and cuts the stream into rows
(text); `isolated` places documents whole into rows, greedily in order, each its own
segment. A preference pair has a row to itself.

The batch: "inputs" and "targets" int32 and "loss_mask" float32, [B, T] ([B, 2, T] for
preference: index 0 chosen, 1 rejected); with isolated packing also "segment_ids" (1, 2, ...
per document within a row, 0 on padding) and "positions" (from 0 in each document), int32
[B, T] and aligned with inputs. loss_mask is 0 on padding and wherever the target lies in
another segment than the input. The train step divides the summed token loss of the whole
global batch (all micro-batches and hosts) by the number of unmasked targets in it.
"""
import dataclasses
import functools
import hashlib
import io
import itertools
import json
import logging
import math
import os

import fsspec
import numpy as np

from trainer import shards, storage
from trainer.config import DataConfig, parse_mix
from trainer.errors import UserError, one_line
from trainer.flags import ConfigError
from trainer.permute import Permutation
from trainer.tokenizer import Tokenizer, parse_fields

log = logging.getLogger(__name__)
# Warnings (long conversations, skipped rows) print as bare lines on stderr, whatever
# handlers other libraries put on the root logger.
_handler = logging.StreamHandler()
_handler.setFormatter(logging.Formatter("%(message)s"))
log.addHandler(_handler)
log.propagate = False

CACHE_VERSION = 3          # bump when the cached layout or tokenization rules change
_TEXT_CHUNK_CHARS = 1 << 16  # .txt files longer than this are split at blank lines
JSONL_TASK_BYTES = 1 << 28  # an uncompressed .jsonl file is tokenized in pieces of this size
ROLES = ("system", "user", "assistant")
COMPRESSED = {".gz": "gzip", ".zst": "zstd"}  # read through as the suffix says
PAIR_FIELDS = ("prompt", "chosen", "rejected")


class DataError(UserError):
    """A data or tokenizer problem the user can fix; the message is one line."""


# ------------------------------------------------------------------------------- sources

def _is_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def _stat(fs, path) -> list:
    """Identity of a file for the cache key: path, size and a modification stamp."""
    info = fs.info(path)
    stamp = next((info[k] for k in ("mtime", "updated", "LastModified", "generation", "created") if k in info), "")
    return [fs.unstrip_protocol(path), info.get("size"), str(stamp)]


def _resolve_source(cfg: DataConfig):
    """Returns (key, rows): key identifies the source for the cache; rows() yields (where,
    row) with `where` like "data.jsonl:3" for error messages, and row a dict (a JSON object,
    a dataset row, or {text_field: text} for a text file) or, for a line that is not a JSON
    object, the DataError that says so (a bad row like any other)."""
    spec, fmt = cfg.path, cfg.format
    if spec == "builtin":
        if fmt != "text":
            raise DataError(f"--data.format={fmt} needs --data.path with JSONL rows; the builtin corpus is plain text")
        return ["builtin"], lambda: _builtin_rows(cfg.text_field)
    fs, path = fsspec.core.url_to_fs(spec)
    if _is_glob(spec):
        files = sorted(fs.glob(path))
        if not files:
            raise DataError(f"--data.path: no files match {spec!r}")
    elif fs.isfile(path):
        files = [path]
    elif fs.isdir(path) or not _looks_like_file(spec):
        return _hf_source(spec, fs, path, cfg)
    else:
        raise DataError(f"--data.path: file not found: {spec}")
    key = [_stat(fs, f) for f in files]
    return key, lambda: (r for f in files for r in _file_rows(fs, f, cfg))


def source_tasks(cfg: DataConfig):
    """(sources, tasks, sizes): the source's identity (as the cache key has it), its units of
    work for the shard builder, in corpus order, and their sizes in bytes (None: unknown). A
    task is a file's URL; [URL, start, end] for the lines that begin in bytes [start, end)
    of a large uncompressed .jsonl file, so that several workers share it; or None for
    builtin or an HF dataset (one task)."""
    key, _ = _resolve_source(cfg)
    if not (key and isinstance(key[0], list)):
        return key, [None], [None]
    tasks, sizes = [], []
    for url, size, _ in key:
        if url.endswith(".jsonl") and size and size > JSONL_TASK_BYTES:
            for start in range(0, size, JSONL_TASK_BYTES):
                tasks.append([url, start, min(size, start + JSONL_TASK_BYTES)])
                sizes.append(tasks[-1][2] - start)
        else:
            tasks.append(url)
            sizes.append(size)
    return key, tasks, sizes


def task_rows(cfg: DataConfig, task, opened=None):
    """The rows of one unit of work from source_tasks."""
    if task is None:
        return _resolve_source(cfg)[1]()
    if isinstance(task, list):
        fs, path = fsspec.core.url_to_fs(task[0])
        return _jsonl_range_rows(fs, path, task[1], task[2], opened)
    fs, path = fsspec.core.url_to_fs(task)
    return _file_rows(fs, path, cfg, opened)


def _jsonl_range_rows(fs, path, start, end, opened=None):
    """The rows of the lines of a .jsonl file that begin in bytes [start, end). `where` says
    the byte offset of the line (its number would need every byte before it read)."""
    url = fs.unstrip_protocol(path)
    name = path if storage.is_local(url) else url
    with fs.open(path, "rb") as f:
        if opened is not None:
            opened.append(f)
        pos = start
        if start:  # the line under way at `start` belongs to the task before
            f.seek(start - 1)
            pos = start - 1 + len(f.readline())
        while pos < end:
            line = f.readline()
            if not line:
                break
            where = f"{name}:byte {pos}"
            pos += len(line)
            if line.strip():
                yield where, _json_row(line.decode("utf-8"), where)


def _looks_like_file(spec: str) -> bool:
    """A missing path that is clearly meant as a file (not a Hugging Face dataset name)."""
    suffix = os.path.splitext(spec)[1]
    return "://" in spec or spec.startswith((".", "/", "~")) or suffix in (".txt", ".jsonl", ".json", *COMPRESSED)


def _builtin_rows(field):
    """Python's own help topics: ~80 documents, ships with every Python."""
    from pydoc_data.topics import topics
    for name in sorted(topics):
        yield f"builtin:{name}", {field: topics[name]}


def _file_rows(fs, path, cfg, opened=None):
    """The rows of one file; `opened`, a list, receives the raw (compressed) file object, so
    that a caller can follow how far it has read."""
    url = fs.unstrip_protocol(path)
    name = path if storage.is_local(url) else url  # as the user wrote it
    stem, suffix = os.path.splitext(path)
    codec = COMPRESSED.get(suffix)
    stem = stem if codec else path
    empty = DataError(f"{name}: the file is empty; remove it or leave it out of --data.path")
    with fs.open(path, "rb") as raw:
        if opened is not None:
            opened.append(raw)
        yield from _text_rows(raw, codec, stem, name, cfg, empty)


def _text_rows(raw, codec, stem, name, cfg, empty):
    if codec:
        from fsspec.compression import compr
        raw = compr[codec](raw, mode="rb")
    with io.TextIOWrapper(raw, encoding="utf-8") as f:
        if stem.endswith(".jsonl"):
            lines = 0
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    lines += 1
                    yield f"{name}:{lineno}", _json_row(line, f"{name}:{lineno}")
            if not lines:
                raise empty
            return
        if cfg.format != "text":
            raise DataError(f"--data.path: {name}: --data.format={cfg.format} needs .jsonl files, "
                            "one JSON object per line")
        text = f.read()
    if not text.strip():
        raise empty
    # A text file is one document; a long one is cut at blank lines so that the
    # validation split (by whole documents) has something to choose from.
    chunk = []
    for para in text.split("\n\n"):
        chunk.append(para)
        if sum(map(len, chunk)) >= _TEXT_CHUNK_CHARS:
            yield name, {cfg.text_field: "\n\n".join(chunk)}
            chunk = []
    if any(chunk):
        yield name, {cfg.text_field: "\n\n".join(chunk)}


def _json_row(line, where):
    """A JSONL line as a dict, or the DataError saying why it is not one."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        return DataError(f"{where}: not valid JSON ({e.msg}); each line must be one JSON object")
    if not isinstance(row, dict):
        return DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    return row


def _columns(cfg: DataConfig):
    """The row fields a format reads, and the flag that names them."""
    if cfg.format == "fields":
        names = [v for _, part in parse_fields(cfg.fields) for kind, v in part if kind == "field"]
        return list(dict.fromkeys(names)), "--data.fields"
    return {"text": ([cfg.text_field], "--data.text_field"),
            "chat": ([cfg.messages_field], "--data.messages_field"),
            "preference": (list(PAIR_FIELDS), "--data.format=preference")}[cfg.format]


def _hf_source(spec, fs, path, cfg):
    """A Hugging Face dataset: a save_to_disk directory or one already in the local HF cache."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing may be downloaded
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise DataError(f"--data.path: {spec!r} is not a file, so it is read as a Hugging Face dataset, "
                        "which needs `pip install datasets`") from None
    saved = fs.isdir(path) and any(fs.exists(f"{path}/{n}") for n in ("state.json", "dataset_dict.json"))
    try:
        ds = datasets.load_from_disk(spec) if saved else datasets.load_dataset(spec, split=cfg.split)
    except Exception as e:  # noqa: BLE001 -- offline lookups fail in many ways; all mean "not available"
        raise DataError(f"--data.path: {spec!r} is not a file, glob, or Hugging Face dataset available "
                        f"offline ({one_line(e)[:200]})") from None
    if isinstance(ds, datasets.DatasetDict):
        if cfg.split not in ds:
            raise DataError(f"--data.split: {spec} has no split {cfg.split!r} (splits: {', '.join(ds)})")
        ds = ds[cfg.split]
    columns, flag = _columns(cfg)
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise DataError(f"{flag}: dataset {spec} has no column {missing[0]!r} (columns: {', '.join(ds.column_names)})")
    key = ["hf", spec, cfg.split] + [_stat(fsspec.filesystem("file"), f["filename"]) for f in ds.cache_files]

    def rows():
        for i, values in enumerate(zip(*(ds[c] for c in columns))):
            yield f"{spec}[{i}]", dict(zip(columns, values))
    return key, rows


# ---------------------------------------------------------------------- row checks

def _json_type(value) -> str:
    return {bool: "true/false", int: "a number", float: "a number", type(None): "null",
            list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def _value(row, where, field, flag, what):
    if field not in row:
        raise DataError(f"{where}: no field {field!r} (fields: {', '.join(map(str, row)) or 'none'}); "
                        f"set {flag} to the field that holds the {what}")
    return row[field]


def _text(row, where, field):
    value = _value(row, where, field, "--data.text_field", "text")
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} is {_json_type(value)}, not a string")
    return value


def _messages(value, where, field):
    """A list of {"role", "content"} with known roles and string contents."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {field!r} must be a non-empty list of {{\"role\", \"content\"}} objects")
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise DataError(f"{where}: {field}[{i}] must be a {{\"role\", \"content\"}} object, "
                            f"got {json.dumps(m)[:60]}")
        if m.get("role") not in ROLES:
            raise DataError(f"{where}: {field}[{i}] has role {json.dumps(m.get('role'))}; "
                            f"allowed roles: {', '.join(ROLES)}")
        if "content" not in m:
            raise DataError(f"{where}: {field}[{i}] has no \"content\"; every message needs a string \"content\"")
        if not isinstance(m["content"], str):
            raise DataError(f"{where}: {field}[{i}][\"content\"] is {_json_type(m['content'])}; it must be a string")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _conversation(row, where, field):
    messages = _messages(_value(row, where, field, "--data.messages_field", "messages"), where, field)
    if not _has_assistant(messages):
        raise DataError(f"{where}: no assistant turn; a conversation needs at least one "
                        "{\"role\": \"assistant\"} message to learn from")
    return messages


def _has_assistant(messages) -> bool:
    return any(m["role"] == "assistant" for m in messages)


def _pair(row, where):
    """A preference row -> (prompt messages, chosen reply, rejected reply)."""
    for field in PAIR_FIELDS:
        if field not in row:
            raise DataError(f"{where}: no field {field!r} (fields: {', '.join(map(str, row)) or 'none'}); "
                            "a preference row needs \"prompt\", \"chosen\" and \"rejected\"")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    else:
        prompt = _messages(prompt, where, "prompt")
        if prompt[-1]["role"] != "user":
            raise DataError(f"{where}: 'prompt' ends with a {prompt[-1]['role']} turn; it must end "
                            "with the user turn that chosen and rejected reply to")
    return prompt, _reply(row, "chosen", where), _reply(row, "rejected", where)


def _reply(row, field, where):
    """A string, or an assistant message (alone, or as a one-element list): its content."""
    value = row[field]
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, dict) and value.get("role", "assistant") == "assistant":
        value = value.get("content")
    if not isinstance(value, str):
        raise DataError(f"{where}: {field!r} must be a string or one {{\"role\": \"assistant\", "
                        f"\"content\": string}} message, got {json.dumps(row[field])[:60]}")
    return value


def _render_fields(parts, row, where):
    """A row as (text, loss) segments, by a parsed --data.fields template: its pieces in order,
    one newline between neighbours except next to a special token; an empty field adds nothing."""
    pieces = []  # (text, loss, is_special)
    for loss, part in parts:
        for kind, value in part:
            text = _field_text(row, value, where) if kind == "field" else value
            if text:
                pieces.append((text, loss, kind == "special"))
    if not any(loss for _, loss, _ in pieces):
        raise DataError(f"{where}: the unbracketed (loss) parts of --data.fields are all empty in this "
                        "row, so it has nothing to learn")
    segments = []
    for prev, cur in zip([None] + pieces, pieces):
        if prev is not None and not (prev[2] or cur[2]):
            segments.append(("\n", prev[1] and cur[1]))  # between prompt and reply: prompt
        segments.append(cur[:2])
    return segments


def _field_text(row, field, where):
    if field not in row:
        raise DataError(f"{where}: no field {field!r}, which --data.fields names (the row's fields: "
                        f"{', '.join(map(str, row)) or 'none'})")
    value = row[field]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} is {_json_type(value)}, not a string; --data.fields "
                        "reads string fields only")
    return value


def _check_specials(parts, tokenizer: Tokenizer):
    """Every <special> piece of a --data.fields template is one of the tokenizer's."""
    for _, part in parts:
        for kind, value in part:
            if kind == "special" and value not in tokenizer.specials:
                known = list(tokenizer.specials)
                known = ", ".join(known[:12]) + (", ..." if len(known) > 12 else "")
                raise ConfigError(f"--data.fields: {value} is not a special token of the tokenizer "
                                  f"{tokenizer.name} (its special tokens: {known or 'none'}); write "
                                  "plain text as a \"literal\"")


class _BadRows:
    """Rows that fail their checks: the first one is the error, or, with
    --data.skip_bad_rows, each is skipped and counted."""

    def __init__(self, skip: bool):
        self.skip, self.rows, self.bad, self.first = skip, 0, 0, ""

    def filter(self, rows, check):
        """(where, check(where, row)) for the good rows; check raises DataError on a bad one."""
        for where, row in rows:
            self.rows += 1
            try:
                if isinstance(row, DataError):  # a line that is not a JSON object
                    raise row
                value = check(where, row)
            except DataError as e:
                if not self.skip:
                    raise
                self.bad, self.first = self.bad + 1, self.first or str(e)
                continue
            yield where, value

    def notes(self) -> list[str]:
        return [f"data: skipped {self.bad:,} bad rows of {self.rows:,} (first: {self.first})"] if self.bad else []


# ------------------------------------------------------------------ documents of a row

def _shortenings(messages):
    """The conversation with its earliest exchanges (a user turn and the replies up to the
    next user turn) dropped one by one, longest first; a leading system turn stays."""
    head = messages[:1] if messages[0]["role"] == "system" else []
    rest = messages[len(head):]
    for i in range(1, len(rest)):
        if rest[i]["role"] == "user":
            yield head + rest[i:]


def _fit(encode, messages, shorter, row_len):
    """(documents, outcome): encode(messages) if every document fits in a row (outcome None),
    else that of the first of `shorter` that fits ("truncated"), else none ("dropped")."""
    docs = encode(messages)
    if all(len(ids) <= row_len for ids, _ in docs):
        return docs, None
    for candidate in shorter:
        docs = encode(candidate)
        if all(len(ids) <= row_len for ids, _ in docs):
            return docs, "truncated"
    return [], "dropped"


def _encode_chat(tokenizer, messages, where, last_only=False):
    try:
        return tokenizer.encode_chat(messages, last_only)
    except Exception as e:  # noqa: BLE001 -- e.g. a template that rejects the role order
        raise DataError(f"{where}: cannot apply the chat template: {one_line(e)}") from None


def _row_encoder(cfg: DataConfig, tokenizer: Tokenizer, row_len: int):
    """(where, row) -> (documents, outcome) for a chat, fields or preference row: documents
    are (ids, mask) pairs that each fit in a row; outcome (see _fit) says whether it was long."""
    truncate = cfg.long == "truncate"
    if cfg.format == "chat":
        def encode(where, row):
            messages = _conversation(row, where, cfg.messages_field)
            shorter = itertools.takewhile(_has_assistant, _shortenings(messages)) if truncate else ()
            return _fit(lambda m: [_encode_chat(tokenizer, m, where)], messages, shorter, row_len)
    elif cfg.format == "preference":
        def encode(where, row):
            prompt, chosen, rejected = _pair(row, where)

            def both(p):  # the pair's two sequences, loss on the reply alone
                return [_encode_chat(tokenizer, p + [{"role": "assistant", "content": reply}], where, True)
                        for reply in (chosen, rejected)]
            return _fit(both, prompt, _shortenings(prompt) if truncate else (), row_len)
    else:
        parts = parse_fields(cfg.fields)

        def encode(where, row):
            doc = tokenizer.encode_fields(_render_fields(parts, row, where))
            return _fit(lambda _: [doc], None, (), row_len)  # a fields row is never truncated
    return encode


class _LongRows:
    """Counts the documents longer than a row, and says what became of them."""

    def __init__(self, cfg: DataConfig, seq_len: int):
        self.cfg, self.seq_len = cfg, seq_len
        self.rows = self.long = self.dropped = 0

    def count(self, outcome):
        self.rows += 1
        self.long += outcome is not None
        self.dropped += outcome == "dropped"

    def notes(self) -> list[str]:
        if not self.long:
            return []
        noun = {"chat": "conversations", "fields": "rows", "preference": "pairs"}[self.cfg.format]
        head = f"data: {self.long:,} of {self.rows:,} {noun} were longer than seq_len={self.seq_len}; "
        if self.cfg.format == "fields":
            return [head + "dropped (a fields row is never truncated)"]
        if self.cfg.long == "drop":
            return [head + "dropped (--data.long=drop)"]
        return [head + "truncated (--data.long=truncate)" + (
            f", {self.dropped:,} of them dropped: even the last exchange does not fit" if self.dropped else "")]


# ------------------------------------------------------------------ tokenization + cache

def documents(rows, tokenizer: Tokenizer, cfg: DataConfig, seq_len: int, bad, long):
    """Every good row becomes its documents, as the tokenizer's rules say (tokenizer.py):
    yields (ids, mask or None for text); `bad` (_BadRows) and `long` (_LongRows) count."""
    if cfg.format == "text":
        texts = (text for _, text in bad.filter(rows, lambda where, row: _text(row, where, cfg.text_field)))
        while batch := list(itertools.islice(texts, 1024)):  # batches let HF use its threads
            yield from ((ids, None) for ids in tokenizer.encode_documents(batch))
    else:
        for _, (row_docs, outcome) in bad.filter(rows, _row_encoder(cfg, tokenizer, seq_len + 1)):
            long.count(outcome)
            yield from row_docs


def check_counts(cfg: DataConfig, seq_len: int, bad, long) -> list[str]:
    """The errors a whole corpus can end in (every row bad, every row too long), else the
    warnings to show on every run."""
    if bad.bad and bad.bad == bad.rows:
        raise DataError(f"all {bad.rows:,} rows are bad (first: {bad.first})")
    if long.rows and long.dropped == long.rows:
        raise DataError(f"--seq_len={seq_len}: {long.notes()[0][len('data: '):]}, so none is left; "
                        "raise --seq_len")
    return bad.notes() + long.notes()


def _tokenize(rows, tokenizer: Tokenizer, cfg: DataConfig, seq_len: int):
    """The whole source tokenized in memory (the reference the shards are tested against).
    Returns (tokens uint32, offsets int64 [n_docs+1], mask uint8 or None for text, notes:
    the warnings to show on every run)."""
    bad, long = _BadRows(cfg.skip_bad_rows), _LongRows(cfg, seq_len)
    docs = list(documents(rows, tokenizer, cfg, seq_len, bad, long))
    notes = check_counts(cfg, seq_len, bad, long)
    offsets = np.zeros(len(docs) + 1, np.int64)
    np.cumsum([len(ids) for ids, _ in docs], out=offsets[1:])
    tokens = np.concatenate([np.asarray(ids, np.uint32) for ids, _ in docs]) if docs else np.zeros(0, np.uint32)
    mask = None
    if cfg.format != "text":
        mask = np.concatenate([np.asarray(m, np.uint8) for _, m in docs]) if docs else np.zeros(0, np.uint8)
    return tokens, offsets, mask, notes


def _cached_shards(cfg: DataConfig, tokenizer, seq_len) -> str:
    """The shard directory of a source: --data.path itself when it is one, else the
    automatic cache, a small local run of the shard builder (trainer/tokenize.py) in
    --data.cache_dir (local or gs://), keyed by everything the tokens depend on. The
    warnings of the first run (bad rows, long conversations) are shown again."""
    from trainer import tokenize
    if is_shard_dir(cfg.path):
        return cfg.path
    if not _is_glob(cfg.path) and storage.exists(cfg.path.rstrip("/") + "/plan.json"):
        raise DataError(f"--data.path: {cfg.path} is an unfinished shard directory; re-run the "
                        "trainer.tokenize command that writes it, which continues where it stopped")
    sources = source_tasks(cfg)[0]
    key = json.dumps(tokenize.identity(cfg, tokenizer, seq_len, sources), sort_keys=True)
    cache_dir = cfg.cache_dir or os.path.expanduser("~/.cache/meshlm/tokens")
    root = f"{cache_dir.rstrip('/')}/{hashlib.sha256(key.encode()).hexdigest()[:32]}"
    fresh = shards.read_manifest(root) is None
    try:
        tokenize.build(cfg, tokenizer, root, seq_len, progress=None)
    except UserError:  # a bad source leaves no cache behind
        fs, path = storage.fs_and_path(root)
        if fs.exists(path):
            fs.rm(path, recursive=True)
        raise
    log.info("data: %s %s", "tokenized into" if fresh else "from the cache", root)
    return root


def is_shard_dir(path: str) -> bool:
    """Whether path is a finished shard directory (trainer.tokenize's output)."""
    return path != "builtin" and not _is_glob(path) and shards.read_manifest(path) is not None


def _read_manifest_for(root, cfg: DataConfig, tokenizer, seq_len) -> dict:
    """The manifest of a shard directory, checked against this run's tokenizer and format."""
    m = shards.read_manifest(root)
    if m["tokenizer"] != tokenizer.fingerprint():
        raise DataError(f"--data.path: the shards in {root} were made with another tokenizer "
                        f"({m['tokenizer'].split('|')[0]}); re-run trainer.tokenize with --tokenizer="
                        f"{tokenizer.name}, or train with theirs")
    if m["format"] != cfg.format:
        raise DataError(f"--data.path: the shards in {root} hold --data.format={m['format']} "
                        f"documents; pass --data.format={m['format']}")
    if cfg.format != "text" and m["seq_len"] > seq_len:
        raise DataError(f"--seq_len={seq_len}: the shards in {root} were fitted to rows of "
                        f"--seq_len={m['seq_len']}; train with that or re-run trainer.tokenize "
                        f"with --seq_len={seq_len}")
    for note in m["notes"]:
        log.warning(note)
    return m


def _load_all(reader: "shards.ShardReader"):
    """Every document of a shard directory in memory: (tokens, offsets, mask or None)."""
    tokens = np.zeros(0, np.uint32) if not reader.manifest["tokens"] else np.concatenate(
        reader.read("tokens", reader.split_ranges(0, int(reader.token_start[-1])))).astype(np.uint32)
    offsets = np.concatenate([[0]] + [np.asarray(reader.offsets(i))[1:] + reader.token_start[i]
                                      for i in range(len(reader.shard_docs))]).astype(np.int64)
    mask = None
    if reader.manifest["format"] != "text":
        mask = np.concatenate([np.zeros(0, np.uint8)] + reader.read(
            "mask", reader.split_ranges(0, int(reader.token_start[-1]))))
    return tokens, offsets, mask


# ------------------------------------------------------------------------- packing

def _stream_rows(tokens, row_len, pad_id, keep_tail):
    """Concatenated documents cut into rows of row_len; the tail is dropped or padded."""
    n = len(tokens) // row_len + (1 if keep_tail and len(tokens) % row_len else 0)
    rows = np.full(n * row_len, pad_id, np.uint32)
    rmask = np.zeros(n * row_len, np.uint8)
    used = min(len(tokens), n * row_len)
    rows[:used] = tokens[:used]
    rmask[:used] = 1
    return rows.reshape(n, row_len), rmask.reshape(n, row_len)


def _pieces(offsets, row_len):
    """(start, length) of each document; one longer than a row (text) cut into row-sized pieces."""
    return [(s, min(row_len, int(b) - s)) for a, b in zip(offsets[:-1], offsets[1:])
            for s in range(int(a), int(b), row_len)]


def _isolated_rows(tokens, offsets, mask, row_len, pad_id):
    """Documents placed whole into rows (greedy, in order), each its own segment: segment
    ids 1, 2, ... within a row, 0 on padding. Returns (rows, row_mask, segments). A segment's
    first token is no target: nothing before it in its segment predicts it."""
    placements, row, col, seg = [], 0, 0, 0
    for start, length in _pieces(offsets, row_len):
        if col + length > row_len:
            row, col, seg = row + 1, 0, 0
        seg += 1
        placements.append((start, length, row, col, seg))
        col += length
    n = row + 1 if placements else 0
    rows = np.full((n, row_len), pad_id, np.uint32)
    rmask, segments = np.zeros((n, row_len), np.uint8), np.zeros((n, row_len), np.int32)
    for start, length, r, c, s in placements:
        rows[r, c:c + length] = tokens[start:start + length]
        rmask[r, c:c + length] = 1 if mask is None else mask[start:start + length]
        rmask[r, c] = 0
        segments[r, c:c + length] = s
    return rows, rmask, segments


def _pair_rows(tokens, offsets, mask, row_len, pad_id):
    """Preference pairs (documents 2i chosen, 2i+1 rejected) as rows [n, 2, row_len], padded."""
    n = (len(offsets) - 1) // 2
    rows = np.full((n, 2, row_len), pad_id, np.uint32)
    rmask = np.zeros((n, 2, row_len), np.uint8)
    for d in range(2 * n):
        a, b = offsets[d], offsets[d + 1]
        rows[d // 2, d % 2, :b - a] = tokens[a:b]
        rmask[d // 2, d % 2, :b - a] = mask[a:b]
    return rows, rmask


VAL_KEY = (0x5EED, 0)  # the held-out split's permutation key: fixed, so --seed never moves it


def validation_doc_ids(n_docs, val_fraction) -> np.ndarray:
    """The held-out documents, sorted: those a fixed keyed permutation puts first, the same
    on every run and host. Costs O(held-out documents), not O(documents)."""
    if val_fraction <= 0:
        return np.zeros(0, np.int64)
    n_val = max(1, round(n_docs * val_fraction))
    if n_val >= n_docs:
        raise DataError(f"--data.path: only {n_docs} document(s), too few to hold {n_val} out for validation; "
                        "add data or set --data.val_fraction=0")
    return np.sort(Permutation(n_docs, VAL_KEY).inverse(np.arange(n_val)))


def _validation_docs(n_docs, val_fraction) -> np.ndarray:
    """validation_doc_ids as a mask over all documents (the in-memory path)."""
    is_val = np.zeros(n_docs, bool)
    is_val[validation_doc_ids(n_docs, val_fraction)] = True
    return is_val


def _select_docs(tokens, offsets, mask, keep):
    """The tokens (and offsets, mask) of the documents where keep is True, in order."""
    lengths = np.diff(offsets)
    token_keep = np.repeat(keep, lengths)
    new_offsets = np.zeros(int(keep.sum()) + 1, np.int64)
    np.cumsum(lengths[keep], out=new_offsets[1:])
    return tokens[token_keep], new_offsets, (mask[token_keep] if mask is not None else None)


# --------------------------------------------------------------------------- datasets

def draw_positions(step: int, batch_size: int, rows: slice | None = None) -> np.ndarray:
    """The global draw positions of batch rows `rows` (all: None) of step `step`."""
    local = range(batch_size)[rows] if rows is not None else range(batch_size)
    return step * batch_size + np.arange(local.start, local.stop, local.step, dtype=np.int64)


def epoch_rows(num_rows: int, seed: int, positions, salt: tuple = ()) -> np.ndarray:
    """The rows at global draw positions (over endless epochs): epoch e's order is a keyed
    permutation (seed, e) of the rows, O(1) memory and looked up position by position."""
    g = np.asarray(positions, np.int64)
    epochs, pos = np.divmod(g, num_rows)
    out = np.empty_like(g)
    for e in np.unique(epochs):
        out[epochs == e] = Permutation(num_rows, (seed, int(e), *salt))(pos[epochs == e])
    return out


def _positions(segments):
    """Each token's index within its segment (0 on padding), for segments [B, T]."""
    idx = np.broadcast_to(np.arange(segments.shape[1]), segments.shape)
    starts = np.ones(segments.shape, bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = np.maximum.accumulate(np.where(starts, idx, 0), axis=1)
    return np.where(segments > 0, idx - first, 0).astype(np.int32)


class Dataset:
    """Packed rows of one split, in memory. Each row holds seq_len+1 tokens so that
    inputs = row[:-1] and targets = row[1:]; row_mask[t] says whether token t is a target;
    segments (isolated packing) holds each token's segment id. A preference row is
    [2, seq_len+1]: chosen, then rejected."""

    def __init__(self, rows: np.ndarray, row_mask: np.ndarray, pad_id: int, segments: np.ndarray | None = None):
        self.rows, self.row_mask, self.pad_id, self.segments = rows, row_mask, pad_id, segments
        self.num_rows, self.seq_len = rows.shape[0], rows.shape[-1] - 1

    def row_ids(self, step: int, batch_size: int, seed: int, rows: slice | None = None) -> np.ndarray:
        """Dataset rows for global batch positions `rows` of `step`, over endless epochs."""
        return epoch_rows(self.num_rows, seed, draw_positions(step, batch_size, rows))

    def epochs(self, step: int, batch_size: int) -> dict:
        """{"epochs": passes over the rows in steps [0, step)}, for the metrics."""
        return {"epochs": step * batch_size / max(self.num_rows, 1)}

    def _take(self, ids):
        """(tokens, row mask, segments or None) of the rows ids."""
        return self.rows[ids], self.row_mask[ids], None if self.segments is None else self.segments[ids]

    def _make(self, ids) -> dict[str, np.ndarray]:
        tok, mask, segments = self._take(ids)
        batch = {"inputs": tok[..., :-1].astype(np.int32), "targets": tok[..., 1:].astype(np.int32),
                 "loss_mask": mask[..., 1:].astype(np.float32)}
        if segments is not None:
            segments = segments[:, :-1]
            batch |= {"segment_ids": segments, "positions": _positions(segments)}
        return batch

    def batch(self, step: int, batch_size: int, seed: int, rows: slice | None = None) -> dict[str, np.ndarray]:
        """The batch for global step `step` (a pure function of data, seed, step); with
        `rows`, only that slice of the global batch (this host's share)."""
        if self.num_rows == 0:
            raise DataError("this dataset split has no rows")
        return self._make(self.row_ids(step, batch_size, seed, rows))

    def eval_batches(self, batch_size: int):
        """All rows in order; the last batch is padded with rows of pad tokens, loss_mask 0,
        segment 0 and position 0."""
        fill = {"inputs": self.pad_id, "targets": self.pad_id}
        for start in range(0, self.num_rows, batch_size):
            ids = np.arange(start, min(start + batch_size, self.num_rows))
            b = self._make(ids)
            if len(ids) < batch_size:
                pad = batch_size - len(ids)
                b = {k: np.concatenate([v, np.full((pad, *v.shape[1:]), fill.get(k, 0), v.dtype)])
                     for k, v in b.items()}
            yield b


class StreamDataset(Dataset):
    """Stream-packed rows read from shards on demand (local: a memory map; gs://: byte-range
    reads), the same rows `_stream_rows` cuts in memory. The stream is the concatenation of
    `segments`, global token ranges of the shard directory in order; row r is stream tokens
    [r * row_len, (r + 1) * row_len). Memory: the segments (one per held-out document),
    never the tokens."""

    def __init__(self, reader, segments: np.ndarray, row_len: int, pad_id: int, keep_tail: bool):
        self.reader, self.pad_id, self.row_len, self.segments = reader, pad_id, row_len, None
        self.seg_start = segments[:, 0]
        self.cum = np.concatenate([[0], np.cumsum(segments[:, 1] - segments[:, 0])]).astype(np.int64)
        self.total = int(self.cum[-1])
        self.num_rows = self.total // row_len + (1 if keep_tail and self.total % row_len else 0)
        self.seq_len = row_len - 1

    def _take(self, ids):
        ids = np.asarray(ids, np.int64)
        L = self.row_len
        tok = np.full((len(ids), L), self.pad_id, np.uint32)
        mask = np.zeros((len(ids), L), np.uint8)
        where, ranges = [], []  # (row, column) of each global token range read
        for n, r in enumerate(ids):
            p, end = int(r) * L, min((int(r) + 1) * L, self.total)
            j = int(np.searchsorted(self.cum, p, "right")) - 1
            while p < end:
                take = min(end, int(self.cum[j + 1])) - p
                start = int(self.seg_start[j]) + p - int(self.cum[j])
                for a, b in self.reader.split_ranges(start, start + take):
                    where.append((n, p - int(r) * L + a - start))
                    ranges.append((a, b))
                p, j = p + take, j + 1
        for (n, col), piece in zip(where, self.reader.read("tokens", ranges)):
            tok[n, col:col + len(piece)] = piece
            mask[n, col:col + len(piece)] = 1
        return tok, mask, None

    @property
    def rows(self):  # every row at once: for small sets and tests
        return self._take(np.arange(self.num_rows))[0]

    @property
    def row_mask(self):
        return self._take(np.arange(self.num_rows))[1]


def _split_segments(reader, val_ids: np.ndarray):
    """(train, validation) segments of a shard directory: the held-out documents' global
    token ranges, and the ranges between them. Reads the offsets of the shards that hold
    held-out documents, one shard at a time."""
    starts, stops = np.zeros(len(val_ids), np.int64), np.zeros(len(val_ids), np.int64)
    shard_of = np.searchsorted(reader.doc_start, val_ids, "right") - 1
    for i in np.unique(shard_of):
        sel = shard_of == i
        local = val_ids[sel] - reader.doc_start[i]
        offsets = reader.offsets(int(i))
        starts[sel] = offsets[local] + reader.token_start[i]
        stops[sel] = offsets[local + 1] + reader.token_start[i]
    val = np.stack([starts, stops], 1)
    edges = np.concatenate([[0], stops]), np.concatenate([starts, [reader.token_start[-1]]])
    train = np.stack(edges, 1)
    return train[train[:, 1] > train[:, 0]], val[val[:, 1] > val[:, 0]]


class Mixture:
    """Training rows drawn from several sources by weight, a pure function of (seed, step).

    Weights become small integers q_s (per mille, divided by their gcd), and the global draw
    positions run through a fixed period of sum(q) slots in which source s has exactly q_s,
    spread evenly (smooth weighted round robin). So after n draws source s has had n * w_s
    of them, give or take one, its k-th draw is found without counting (k from the period
    and a prefix table), and it reads row epoch_rows(k) of that source: every row of a
    source once per epoch of that source, in a keyed order of its own."""

    def __init__(self, names, weights, datasets):
        self.names, self.datasets = list(names), list(datasets)
        q = [max(1, round(1000 * w / sum(weights))) for w in weights]
        g = functools.reduce(math.gcd, q)
        self.q = np.array([x // g for x in q], np.int64)
        period, credit = int(self.q.sum()), np.zeros(len(q), np.int64)
        self.order = np.zeros(period, np.int64)
        for t in range(period):
            credit += self.q
            s = int(np.argmax(credit))
            self.order[t], credit[s] = s, credit[s] - period
        self.before = np.zeros((period + 1, len(q)), np.int64)  # draws of each source in slots [0, t)
        self.before[1:] = np.cumsum(np.eye(len(q), dtype=np.int64)[self.order], 0)
        self.pad_id, self.seq_len = datasets[0].pad_id, datasets[0].seq_len
        self.num_rows = sum(d.num_rows for d in datasets)

    def draws(self, positions):
        """(source, that source's draw index) of global draw positions."""
        g = np.asarray(positions, np.int64)
        cycles, slot = np.divmod(g, len(self.order))
        source = self.order[slot]
        return source, cycles * self.q[source] + self.before[slot, source]

    def batch(self, step: int, batch_size: int, seed: int, rows: slice | None = None):
        g = draw_positions(step, batch_size, rows)
        source, k = self.draws(g)
        out = None
        for s in np.unique(source):
            sel = source == s
            ds = self.datasets[s]
            part = ds._make(epoch_rows(ds.num_rows, seed, k[sel], salt=(int(s) + 1,)))
            if out is None:
                out = {key: np.zeros((len(g), *v.shape[1:]), v.dtype) for key, v in part.items()}
            for key, v in part.items():
                out[key][sel] = v
        out["source"] = source.astype(np.int32)  # per-source loss (train.make_objective)
        return out

    def epochs(self, step: int, batch_size: int) -> dict:
        """{"epochs.<name>": epochs of each source seen in steps [0, step)}."""
        counts = np.zeros(len(self.names), np.int64)
        if step:
            cycles, slot = divmod(step * batch_size, len(self.order))
            counts = cycles * self.q + self.before[slot]
        return {f"epochs.{n}": float(c / d.num_rows) for n, c, d in zip(self.names, counts, self.datasets)}


class HeldOut:
    """The validation rows of a mixture: each source's, in turn (`parts` by name)."""

    def __init__(self, parts: dict):
        self.parts = parts
        self.num_rows = sum(d.num_rows for d in parts.values())

    def eval_batches(self, batch_size: int):
        for d in self.parts.values():
            yield from d.eval_batches(batch_size)


def batch_shapes(cfg: DataConfig, batch_size: int, seq_len: int) -> dict:
    """{key: (shape, dtype)} of the batches `Dataset.batch` gives for this data config: what
    the train step is compiled for, known without reading any data (trainer.plan)."""
    if cfg.format == "preference":  # one pair per row, no packing
        shape = (batch_size, 2, seq_len)
        return {"inputs": (shape, np.int32), "targets": (shape, np.int32),
                "loss_mask": (shape, np.float32)}
    shape = (batch_size, seq_len)
    out = {"inputs": (shape, np.int32), "targets": (shape, np.int32),
           "loss_mask": (shape, np.float32)}
    if cfg.isolated:
        out |= {"segment_ids": (shape, np.int32), "positions": (shape, np.int32)}
    if cfg.mix:
        out["source"] = ((batch_size,), np.int32)  # which --data.mix source each row is from
    return out


def load_dataset(cfg: DataConfig, tokenizer: Tokenizer, seq_len: int):
    """(train, validation) for the source in cfg (see the module docstring): text is read
    lazily from the shards (the corpus may be larger than memory), chat, fields and
    preference data (fine-tuning sets) are packed in memory; --data.mix mixes sources."""
    if cfg.mix:
        names, weights, parts = [], [], {}
        train = []
        for name, weight, path in parse_mix(cfg.mix):
            t, v = load_dataset(dataclasses.replace(cfg, path=path, mix=""), tokenizer, seq_len)
            names.append(name)
            weights.append(weight)
            train.append(t)
            parts[name] = v
        return Mixture(names, weights, train), HeldOut(parts)
    if cfg.format == "fields":
        _check_specials(parse_fields(cfg.fields), tokenizer)
    root = _cached_shards(cfg, tokenizer, seq_len)
    manifest = _read_manifest_for(root, cfg, tokenizer, seq_len)
    reader = shards.ShardReader(root, manifest)
    spec, row_len, pad_id = cfg.path, seq_len + 1, tokenizer.pad_id
    if cfg.format == "text" and not cfg.isolated:
        n_docs = manifest["docs"]
        if n_docs == 0:
            raise DataError(f"--data.path: no documents found in {spec}")
        train_seg, val_seg = _split_segments(reader, validation_doc_ids(n_docs, cfg.val_fraction))
        train = StreamDataset(reader, train_seg, row_len, pad_id, keep_tail=False)
        if train.num_rows == 0:
            raise DataError(f"--data.path: the training split of {spec} has {train.total} tokens, but one row "
                            f"needs at least seq_len+1 = {row_len}; use a smaller --seq_len or more data")
        return train, StreamDataset(reader, val_seg, row_len, pad_id, keep_tail=True)
    return _pack(cfg, *_load_all(reader), row_len, pad_id)


def load_dataset_in_memory(cfg: DataConfig, tokenizer: Tokenizer, seq_len: int) -> tuple[Dataset, Dataset]:
    """(train, validation) tokenized and packed in memory, with no shards: the reference
    the shard path is tested against."""
    if cfg.format == "fields":
        _check_specials(parse_fields(cfg.fields), tokenizer)
    tokens, offsets, mask, notes = _tokenize(_resolve_source(cfg)[1](), tokenizer, cfg, seq_len)
    return _pack(cfg, tokens, offsets, mask, seq_len + 1, tokenizer.pad_id)


def _pack(cfg: DataConfig, tokens, offsets, mask, row_len, pad_id) -> tuple[Dataset, Dataset]:
    """Split by whole documents (pairs) and pack both splits in memory."""
    spec = cfg.path
    per_doc = 2 if cfg.format == "preference" else 1  # a pair's two documents stay together
    n_docs = (len(offsets) - 1) // per_doc
    if n_docs == 0:
        raise DataError(f"--data.path: no documents found in {spec}")
    is_val = np.repeat(_validation_docs(n_docs, cfg.val_fraction), per_doc)
    train, val = _select_docs(tokens, offsets, mask, ~is_val), _select_docs(tokens, offsets, mask, is_val)
    if cfg.format == "preference":
        train_ds, val_ds = (Dataset(*_pair_rows(*split, row_len, pad_id), pad_id) for split in (train, val))
    elif cfg.isolated:
        train_ds, val_ds = (Dataset(rows, rmask, pad_id, segments) for rows, rmask, segments in
                            (_isolated_rows(*split, row_len, pad_id) for split in (train, val)))
    else:
        if len(train[0]) < row_len:
            raise DataError(f"--data.path: the training split of {spec} has {len(train[0])} tokens, but one row "
                            f"needs at least seq_len+1 = {row_len}; use a smaller --seq_len or more data")
        train_ds = Dataset(*_stream_rows(train[0], row_len, pad_id, keep_tail=False), pad_id)
        val_ds = Dataset(*_stream_rows(val[0], row_len, pad_id, keep_tail=True), pad_id)  # every held-out token counts
    if not train_ds.row_mask.any():
        raise DataError(f"--data.path: the training split of {spec} has no tokens to learn (every loss mask is 0)")
    return train_ds, val_ds
