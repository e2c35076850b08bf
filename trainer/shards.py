"""Token shards on disk (local or gs://): the layout, atomic writes, and lazy reads.

A shard directory holds
  manifest.json           written last, once every shard is done: what was tokenized (the
                          source files, the tokenizer's fingerprint, the format options), the
                          shards in corpus order with their document and token counts, and
                          the warnings of the build. Readers trust nothing without it.
  shards/NNNNN.tokens     the documents' tokens back to back (EOS-terminated), raw uint16
                          when the vocab fits, else uint32: memory-mappable as they are
  shards/NNNNN.offsets    int64 [docs + 1]: document d is tokens[offsets[d]:offsets[d+1]]
  shards/NNNNN.mask       uint8 per token, the loss mask (chat, fields and preference only)
  shards/NNNNN.json       the shard's own record (counts, warnings), written after its
                          arrays: a shard without it is unfinished and is built again
Every file is written under a temporary name and renamed into place (on GCS an object
appears whole when its upload ends), so a half-written shard is never read.
"""

import json
import os
import re
import socket
import tempfile

import numpy as np

from trainer import storage

MANIFEST = "manifest.json"
LAYOUT_VERSION = 1


def token_dtype(vocab_size: int):
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _join(root, *parts):
    return "/".join([root.rstrip("/"), *parts])


def shard_path(root, index, kind):
    return _join(root, "shards", f"{index:05d}.{kind}")


def read_manifest(root):
    """The manifest of a shard directory, or None when there is none (not built, or not done)."""
    path = _join(root, MANIFEST)
    return storage.read_json(path) if storage.exists(path) else None


def tmp_tag() -> str:
    """Names this process in temporary file names: several processes (hosts of one run
    building the same cache) may write the same shard at once, each to its own files."""
    return f"tmp@{socket.gethostname()}@{os.getpid()}"


def is_stale(name: str) -> bool:
    """Whether a temporary name belongs to a process of this host that is gone."""
    m = re.search(r"tmp@([^@]+)@(\d+)", name)
    if not m or m.group(1) != socket.gethostname():
        return False
    try:
        os.kill(int(m.group(2)), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def put_bytes(path, data: bytes):
    """Write a whole file atomically: a temporary name, then a rename (local), or one upload (gs://)."""
    fs, p = storage.fs_and_path(path)
    if storage.is_local(path):
        os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
        tmp = f"{p}.{tmp_tag()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, p)
    else:
        fs.pipe_file(p, data)


def put_json(path, obj):
    put_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


class ShardWriter:
    """Streams one shard's documents to local temporary files, then moves them into place."""

    def __init__(self, root, index, dtype, with_mask):
        self.root, self.index, self.dtype = root, index, np.dtype(dtype)
        local = storage.is_local(root)
        where = storage.fs_and_path(_join(root, "shards"))[1] if local else None
        if local:
            os.makedirs(where, exist_ok=True)
        self.tmpdir = tempfile.mkdtemp(prefix=f".{index:05d}.{tmp_tag()}-", dir=where)
        self.kinds = ["tokens", "offsets"] + (["mask"] if with_mask else [])
        self.files = {k: open(os.path.join(self.tmpdir, k), "wb") for k in self.kinds}
        self.buf, self.mbuf, self.ends, self.buffered = [], [], [], 0
        self.docs, self.tokens = 0, 0
        self.files["offsets"].write(np.zeros(1, np.int64).tobytes())

    def add(self, ids, mask=None):
        self.buf.append(ids)
        if mask is not None:
            self.mbuf.append(mask)
        self.docs += 1
        self.tokens += len(ids)
        self.buffered += len(ids)
        self.ends.append(self.tokens)
        if self.buffered >= 1 << 20:
            self._flush()

    def _flush(self):
        if self.buf:
            self.files["tokens"].write(np.concatenate([np.asarray(b, np.int64) for b in self.buf])
                                       .astype(self.dtype).tobytes())
            self.files["offsets"].write(np.asarray(self.ends, np.int64).tobytes())
            if "mask" in self.files:
                self.files["mask"].write(np.concatenate([np.asarray(m, np.uint8) for m in self.mbuf])
                                         .tobytes())
        self.buf, self.mbuf, self.ends, self.buffered = [], [], [], 0

    def commit(self, record: dict) -> dict:
        """Move the arrays into place, then write the shard's record (which marks it done)."""
        self._flush()
        for f in self.files.values():
            f.close()
        fs = storage.fs_and_path(self.root)[0]
        for kind in self.kinds:
            src, dst = os.path.join(self.tmpdir, kind), shard_path(self.root, self.index, kind)
            if storage.is_local(self.root):
                os.replace(src, storage.fs_and_path(dst)[1])
            else:
                fs.put_file(src, storage.fs_and_path(dst)[1])
        self.abort()
        record = {"docs": self.docs, "tokens": self.tokens, "mask": "mask" in self.kinds} | record
        put_json(shard_path(self.root, self.index, "json"), record)
        return record

    def abort(self):
        for f in self.files.values():
            f.close()
        for name in os.listdir(self.tmpdir):
            os.remove(os.path.join(self.tmpdir, name))
        os.rmdir(self.tmpdir)


class ShardReader:
    """Reads token ranges of a finished shard directory: a memory map locally, byte-range
    reads on gs:// (never a whole shard). Offsets are small and read whole when needed."""

    def __init__(self, root, manifest=None):
        self.root = root
        self.manifest = manifest or read_manifest(root)
        self.dtype = np.dtype(self.manifest["dtype"])
        self.local = storage.is_local(root)
        self.fs = storage.fs_and_path(root)[0]
        self._maps = {}
        self.shard_tokens = np.array([s["tokens"] for s in self.manifest["shards"]], np.int64)
        self.shard_docs = np.array([s["docs"] for s in self.manifest["shards"]], np.int64)
        self.token_start = np.concatenate([[0], np.cumsum(self.shard_tokens)])  # global token coordinates
        self.doc_start = np.concatenate([[0], np.cumsum(self.shard_docs)])

    def _map(self, index, kind, dtype):
        key = (index, kind)
        if key not in self._maps:
            path = storage.fs_and_path(shard_path(self.root, index, kind))[1]
            self._maps[key] = (np.memmap(path, dtype, mode="r") if os.path.getsize(path)
                               else np.zeros(0, dtype))
        return self._maps[key]

    def offsets(self, index) -> np.ndarray:
        if self.local:
            return self._map(index, "offsets", np.int64)
        path = storage.fs_and_path(shard_path(self.root, index, "offsets"))[1]
        return np.frombuffer(self.fs.cat_file(path), np.int64)

    def read(self, kind, ranges) -> list[np.ndarray]:
        """Arrays for global token ranges [(start, stop), ...], each within one shard."""
        dtype = self.dtype if kind == "tokens" else np.dtype(np.uint8)
        where = [(int(np.searchsorted(self.token_start, a, "right")) - 1, a, b) for a, b in ranges]
        if self.local:
            return [np.asarray(self._map(i, kind, dtype)[a - self.token_start[i]:b - self.token_start[i]])
                    for i, a, b in where]
        paths = [storage.fs_and_path(shard_path(self.root, i, kind))[1] for i, _, _ in where]
        starts = [int(a - self.token_start[i]) * dtype.itemsize for i, a, _ in where]
        stops = [int(b - self.token_start[i]) * dtype.itemsize for i, _, b in where]
        blobs = self.fs.cat_ranges(paths, starts, stops) if paths else []
        return [np.frombuffer(b, dtype) for b in blobs]

    def split_ranges(self, start, stop):
        """A global token range cut at shard boundaries."""
        out = []
        while start < stop:
            i = int(np.searchsorted(self.token_start, start, "right")) - 1
            end = min(stop, int(self.token_start[i + 1]))
            out.append((start, end))
            start = end
        return out
