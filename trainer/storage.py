"""Paths that may be local or remote (gs://, any fsspec URL), in one place.

Libraries that read local files only (transformers, safetensors) get remote dirs through
`stage`, which copies the files they need into a local temporary dir once per process.
"""

import json
import os
import tempfile

import fsspec

# Files that make up a tokenizer in an HF dir (copied as they are).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "chat_template.jinja",
                   "chat_template.json", "vocab.json", "merges.txt", "generation_config.json")


def fs_and_path(path):
    """(fsspec filesystem, path within it) of a local path or URL."""
    return fsspec.core.url_to_fs(path)


def is_local(path):
    return "://" not in path or path.startswith("file://")


def exists(path):
    fs, p = fs_and_path(path)
    return fs.exists(p)


def read_json(path):
    with fsspec.open(path, "r") as f:
        return json.load(f)


_STAGED = {}  # remote dir -> its local staging dir


def stage(path, names=None):
    """A local dir holding `names` (those that exist; None: every file) of the dir `path`;
    path itself when it is local."""
    if is_local(path):
        return path
    fs, root = fs_and_path(path)
    root = root.rstrip("/")
    if root not in _STAGED:
        _STAGED[root] = tempfile.mkdtemp(prefix="meshlm-stage-")
    local = _STAGED[root]
    if names is None:
        names = [os.path.basename(f) for f in fs.ls(root, detail=False)]
    for name in names:
        if not os.path.exists(os.path.join(local, name)) and fs.isfile(f"{root}/{name}"):
            fs.get(f"{root}/{name}", os.path.join(local, name))
    return local


def forget_staged(path):
    """Drop the local copy of a remote dir that has just been rewritten."""
    _STAGED.pop(fs_and_path(path)[1].rstrip("/"), None)
