"""Data sources, the tokenization cache, packing and the batch for step k.

Flow: a source yields records (text or chat messages) -> the tokenizer turns each into
one document of ids (plus a per-token loss mask for chat) -> the documents are cached on
disk -> split by whole documents into train/validation -> packed into rows of seq_len+1
tokens -> `Dataset.batch(step)` picks rows by a per-epoch permutation.  The batch for a
step is a pure function of (data, seed, step): there is no iterator state (DESIGN rule 4).
"""
import functools
import hashlib
import io
import itertools
import json
import logging
import os

import fsspec
import numpy as np

from trainer import storage
from trainer.config import DataConfig
from trainer.errors import UserError, one_line
from trainer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

CACHE_VERSION = 2          # bump when the cached layout or tokenization rules change
_TEXT_CHUNK_CHARS = 1 << 16  # .txt files longer than this are split at blank lines


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
    """Returns (key, records): key identifies the source for the cache; records() yields
    (where, text_or_messages) with `where` like "data.jsonl:3" for error messages."""
    spec, fmt = cfg.path, cfg.format
    field = cfg.messages_field if fmt == "chat" else cfg.text_field
    if spec == "builtin":
        if fmt == "chat":
            raise DataError("--data.format=chat needs --data.path with conversations; the builtin corpus is plain text")
        return ["builtin"], _builtin_records
    fs, path = fsspec.core.url_to_fs(spec)
    if _is_glob(spec):
        files = sorted(fs.glob(path))
        if not files:
            raise DataError(f"--data.path: no files match {spec!r}")
    elif fs.isfile(path):
        files = [path]
    elif fs.isdir(path) or not _looks_like_file(spec):
        return _hf_source(spec, fs, path, fmt, field, cfg.split)
    else:
        raise DataError(f"--data.path: file not found: {spec}")
    key = [_stat(fs, f) for f in files]
    return key, lambda: (r for f in files for r in _file_records(fs, f, fmt, field))


def _looks_like_file(spec: str) -> bool:
    """A missing path that is clearly meant as a file (not a Hugging Face dataset name)."""
    suffix = os.path.splitext(spec)[1]
    return "://" in spec or spec.startswith((".", "/", "~")) or suffix in (".txt", ".jsonl", ".json", ".gz")


def _builtin_records():
    """Python's own help topics: ~80 documents, ships with every Python."""
    from pydoc_data.topics import topics
    for name in sorted(topics):
        yield f"builtin:{name}", topics[name]


def _file_records(fs, path, fmt, field):
    url = fs.unstrip_protocol(path)
    name = path if storage.is_local(url) else url  # as the user wrote it
    stem = path[:-3] if path.endswith(".gz") else path
    with fs.open(path, "rt", encoding="utf-8", compression="infer") as f:
        if stem.endswith(".jsonl"):
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield f"{name}:{lineno}", _json_record(line, f"{name}:{lineno}", fmt, field)
            return
        if fmt == "chat":
            raise DataError(f"--data.path: {name}: --data.format=chat needs .jsonl files with a "
                            f"{field!r} list per line")
        text = f.read()
    # A text file is one document; a long one is cut at blank lines so that the
    # validation split (by whole documents) has something to choose from.
    chunk = []
    for para in text.split("\n\n"):
        chunk.append(para)
        if sum(map(len, chunk)) >= _TEXT_CHUNK_CHARS:
            yield name, "\n\n".join(chunk)
            chunk = []
    if any(chunk):
        yield name, "\n\n".join(chunk)


def _json_record(line, where, fmt, field):
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg}); each line must be one JSON object") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    return _field(row, where, fmt, field)


def _field(row, where, fmt, field):
    flag = "--data.messages_field" if fmt == "chat" else "--data.text_field"
    if field not in row:
        raise DataError(f"{where}: no field {field!r} (fields: {', '.join(map(str, row)) or 'none'}); "
                        f"set {flag} to the field that holds the {'messages' if fmt == 'chat' else 'text'}")
    value = row[field]
    if fmt == "chat":
        return _check_messages(value, where, field)
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} is a {type(value).__name__}, not a string")
    return value


def _check_messages(messages, where, field):
    ok_roles = ("system", "user", "assistant")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: {field!r} must be a non-empty list of {{\"role\", \"content\"}} objects")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in ok_roles and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: {field}[{i}] must be {{\"role\": one of {'|'.join(ok_roles)}, "
                            f"\"content\": string}}, got {json.dumps(m)[:80]}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _hf_source(spec, fs, path, fmt, field, split):
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
        ds = datasets.load_from_disk(spec) if saved else datasets.load_dataset(spec, split=split)
    except Exception as e:  # noqa: BLE001 -- offline lookups fail in many ways; all mean "not available"
        raise DataError(f"--data.path: {spec!r} is not a file, glob, or Hugging Face dataset available "
                        f"offline ({one_line(e)[:200]})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"--data.split: {spec} has no split {split!r} (splits: {', '.join(ds)})")
        ds = ds[split]
    if field not in ds.column_names:
        flag = "--data.messages_field" if fmt == "chat" else "--data.text_field"
        raise DataError(f"{flag}: dataset {spec} has no column {field!r} (columns: {', '.join(ds.column_names)})")
    key = ["hf", spec, split] + [_stat(fsspec.filesystem("file"), f["filename"]) for f in ds.cache_files]

    def records():
        for i, value in enumerate(ds[field]):
            yield f"{spec}[{i}]", _field({field: value}, f"{spec}[{i}]", fmt, field)
    return key, records


# ------------------------------------------------------------------ tokenization + cache

def _tokenize(records, tokenizer: Tokenizer, fmt: str):
    """Every record becomes one document, as the tokenizer's rules say (tokenizer.py): the
    text as `tokenizer(text)` encodes it, then EOS; a chat through its chat template.
    Returns (tokens uint32, offsets int64 [n_docs+1], mask uint8 or None)."""
    docs, masks = [], []
    if fmt == "chat":
        for where, messages in records:
            try:
                ids, mask = tokenizer.encode_chat(messages)
            except Exception as e:  # noqa: BLE001 -- e.g. a template that rejects the role order
                raise DataError(f"{where}: cannot apply the chat template: {one_line(e)}") from None
            docs.append(np.asarray(ids, np.uint32))
            masks.append(np.asarray(mask, np.uint8))
    else:
        records = iter(records)
        while texts := [text for _, text in itertools.islice(records, 1024)]:  # batches let HF use its threads
            docs += [np.asarray(ids, np.uint32) for ids in tokenizer.encode_documents(texts)]
    offsets = np.zeros(len(docs) + 1, np.int64)
    np.cumsum([len(d) for d in docs], out=offsets[1:])
    tokens = np.concatenate(docs) if docs else np.zeros(0, np.uint32)
    return tokens, offsets, (np.concatenate(masks) if masks else None)


def _cached_tokenize(cfg: DataConfig, tokenizer):
    """Tokenize the source once; later runs load the .npz from the cache (local or gs://)."""
    fmt = cfg.format
    source_key, records = _resolve_source(cfg)
    key = json.dumps([CACHE_VERSION, source_key, tokenizer.fingerprint(), fmt,
                      cfg.text_field, cfg.messages_field])
    cache_dir = cfg.cache_dir or os.path.expanduser("~/.cache/meshlm/tokens")
    fs, root = fsspec.core.url_to_fs(cache_dir)
    file = f"{root.rstrip('/')}/{hashlib.sha256(key.encode()).hexdigest()[:32]}.npz"
    if fs.exists(file):
        with fs.open(file, "rb") as f:
            z = np.load(io.BytesIO(f.read()))
        log.info("data: %d documents (%d tokens) from the cache %s", len(z["offsets"]) - 1, len(z["tokens"]), file)
        return z["tokens"], z["offsets"], (z["mask"] if "mask" in z.files else None)
    tokens, offsets, mask = _tokenize(records(), tokenizer, fmt)
    arrays = dict(tokens=tokens, offsets=offsets) | ({"mask": mask} if mask is not None else {})
    fs.makedirs(root, exist_ok=True)
    tmp = f"{file}.tmp-{os.getpid()}"  # write then rename: a killed run never leaves half a cache
    with fs.open(tmp, "wb") as f:
        np.savez(f, **arrays)
    fs.mv(tmp, file)
    log.info("data: tokenized %d documents (%d tokens); cached at %s", len(offsets) - 1, len(tokens), file)
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


def _whole_rows(tokens, offsets, mask, row_len, pad_id):
    """Conversations placed whole into rows (greedy, in order), padding the rest; a
    conversation longer than a row is truncated to one row."""
    placements, row, col = [], 0, 0
    for d in range(len(offsets) - 1):
        length = min(int(offsets[d + 1] - offsets[d]), row_len)
        if col + length > row_len:
            row, col = row + 1, 0
        placements.append((d, row, col, length))
        col += length
    n = row + 1 if placements else 0
    rows, rmask = np.full((n, row_len), pad_id, np.uint32), np.zeros((n, row_len), np.uint8)
    for d, r, c, length in placements:
        rows[r, c:c + length] = tokens[offsets[d]:offsets[d] + length]
        rmask[r, c:c + length] = mask[offsets[d]:offsets[d] + length]
    return rows, rmask


def _validation_docs(n_docs, val_fraction) -> np.ndarray:
    """A fixed pseudo-random set of whole documents, the same on every run and host."""
    is_val = np.zeros(n_docs, bool)
    if val_fraction > 0:
        n_val = max(1, round(n_docs * val_fraction))
        if n_val >= n_docs:
            raise DataError(f"--data.path: only {n_docs} document(s), too few to hold {n_val} out for validation; "
                            "add data or set --data.val_fraction=0")
        is_val[np.random.default_rng(0).permutation(n_docs)[:n_val]] = True
    return is_val


def _select_docs(tokens, offsets, mask, keep):
    """The tokens (and offsets, mask) of the documents where keep is True, in order."""
    lengths = np.diff(offsets)
    token_keep = np.repeat(keep, lengths)
    new_offsets = np.zeros(int(keep.sum()) + 1, np.int64)
    np.cumsum(lengths[keep], out=new_offsets[1:])
    return tokens[token_keep], new_offsets, (mask[token_keep] if mask is not None else None)


# --------------------------------------------------------------------------- datasets

@functools.lru_cache(maxsize=4)
def _permutation(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


class Dataset:
    """Packed rows of one split, in memory. Each row holds seq_len+1 tokens so that
    inputs = row[:-1] and targets = row[1:]; row_mask[t] says whether token t is a target."""

    def __init__(self, rows: np.ndarray, row_mask: np.ndarray, pad_id: int):
        self.rows, self.row_mask, self.pad_id = rows, row_mask, pad_id
        self.num_rows, self.seq_len = rows.shape[0], rows.shape[1] - 1

    def row_ids(self, step: int, batch_size: int, seed: int, rows: slice | None = None) -> np.ndarray:
        """Dataset rows for global batch positions `rows` of `step`, over endless epochs."""
        local = range(batch_size)[rows] if rows is not None else range(batch_size)
        g = step * batch_size + np.arange(local.start, local.stop, local.step, dtype=np.int64)
        epochs, pos = np.divmod(g, self.num_rows)
        out = np.empty_like(g)
        for e in np.unique(epochs):
            out[epochs == e] = _permutation(self.num_rows, seed, int(e))[pos[epochs == e]]
        return out

    def _make(self, ids) -> dict[str, np.ndarray]:
        tok, mask = self.rows[ids], self.row_mask[ids]
        return {"inputs": tok[:, :-1].astype(np.int32), "targets": tok[:, 1:].astype(np.int32),
                "loss_mask": mask[:, 1:].astype(np.float32)}

    def batch(self, step: int, batch_size: int, seed: int, rows: slice | None = None) -> dict[str, np.ndarray]:
        """The batch for global step `step` (a pure function of data, seed, step); with
        `rows`, only that slice of the global batch (this host's share)."""
        if self.num_rows == 0:
            raise DataError("this dataset split has no rows")
        return self._make(self.row_ids(step, batch_size, seed, rows))

    def eval_batches(self, batch_size: int):
        """All rows in order; the last batch is padded with loss_mask=0 rows."""
        for start in range(0, self.num_rows, batch_size):
            ids = np.arange(start, min(start + batch_size, self.num_rows))
            b = self._make(ids)
            if len(ids) < batch_size:
                pad = batch_size - len(ids)
                b = {k: np.concatenate([v, np.full((pad, self.seq_len), self.pad_id if k != "loss_mask" else 0,
                                                   v.dtype)]) for k, v in b.items()}
            yield b


def load_dataset(cfg: DataConfig, tokenizer: Tokenizer, seq_len: int) -> tuple[Dataset, Dataset]:
    """(train, validation) for the source in cfg (see the module docstring)."""
    fmt, spec = cfg.format, cfg.path
    val_fraction = cfg.val_fraction
    tokens, offsets, mask = _cached_tokenize(cfg, tokenizer)
    n_docs, row_len = len(offsets) - 1, seq_len + 1
    if n_docs == 0:
        raise DataError(f"--data.path: no documents found in {spec}")
    is_val = _validation_docs(n_docs, val_fraction)
    train, val = _select_docs(tokens, offsets, mask, ~is_val), _select_docs(tokens, offsets, mask, is_val)
    if fmt == "chat":
        train_rows = _whole_rows(*train, row_len, tokenizer.pad_id)
        val_rows = _whole_rows(*val, row_len, tokenizer.pad_id)
        if not train_rows[1].any():
            raise DataError(f"--data.path: {spec} has no assistant tokens in the training split; nothing to learn")
    else:
        if len(train[0]) < row_len:
            raise DataError(f"--data.path: the training split of {spec} has {len(train[0])} tokens, but one row "
                            f"needs at least seq_len+1 = {row_len}; use a smaller --seq_len or more data")
        train_rows = _stream_rows(train[0], row_len, tokenizer.pad_id, keep_tail=False)
        val_rows = _stream_rows(val[0], row_len, tokenizer.pad_id, keep_tail=True)  # every held-out token counts
    return Dataset(*train_rows, tokenizer.pad_id), Dataset(*val_rows, tokenizer.pad_id)
