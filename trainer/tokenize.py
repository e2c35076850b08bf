"""python -m trainer.tokenize --data.path=D --tokenizer=T --output=DIR: a corpus -> token shards.

D is what the train command's --data.path takes (text, JSONL or chat files, globs of them,
.gz or .zst, local or gs://; a Hugging Face dataset; builtin). DIR (local or gs://) gets
the layout of trainer/shards.py, and `python -m trainer.train --data.path=DIR` reads it
lazily. Documents, masks and warnings are exactly those of the train command's own
tokenization (data.documents): one rule, one home.

One task per input file (per 256 MB of an uncompressed .jsonl file; one for a dataset or
builtin), each writing one shard. Tasks run on datatrove's executors: on one machine
`LocalPipelineExecutor` runs --workers processes (all cores by default); on several, every
machine runs the same command with --nodes=N
--node_rank=i and takes its share of the tasks (datatrove's local_tasks/local_rank_offset),
all writing to one gs:// DIR. datatrove was chosen over Ray Data and Apache Beam because it
is built for exactly this (FineWeb was tokenized with it), installs in seconds with pure-
Python dependencies (about 20 MB, no cluster runtime), runs locally with no cluster, and its
Slurm and Ray executors take the same per-task step (_datatrove_step) to a cluster. Ray
Data and Beam each bring a runtime of their own (Ray's object store and raylet, Beam's
runner) and a dataflow model that fights "one shard per file, written atomically". With
one worker the tasks run in this process, without datatrove (as the automatic cache does).

Resumable and atomic: a shard counts as done once its record (NNNNN.json) exists, and is
never redone; an unfinished one is built again from the start, byte for byte the same. The
manifest is written last, by whichever run (or node) finds every shard done.
"""

import contextlib
import dataclasses
import functools
import io
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from trainer import data, shards, storage
from trainer.config import DataConfig
from trainer.errors import UserError
from trainer.flags import ConfigError, flag, parse_or_exit
from trainer.tokenizer import load_tokenizer

_PROGRESS_EVERY = 1.0  # seconds between a task's progress notes


@dataclass(frozen=True)
class TokenizeFlags:
    data: DataConfig = flag(DataConfig(), "the corpus, as the train command's --data.* (path, "
                            "format, text_field, messages_field, fields, long, skip_bad_rows, split)")
    tokenizer: str = flag("bytes", "bytes | HF tokenizer dir | SentencePiece .model file")
    output: str = flag("", "shard directory to write (local or gs://)")
    seq_len: int = flag(128, "chat, fields and preference data: the row length documents must fit "
                        "(as the train command's --seq_len; training may use this or longer)")
    workers: int = flag(0, "processes on this machine (0: one per core)")
    nodes: int = flag(1, "machines sharing the build, each running this command with its own "
                      "--node_rank and the same --output")
    node_rank: int = flag(0, "this machine's index in [0, nodes)")
    progress: bool = flag(True, "show a progress bar (documents, tokens/s, ETA)")

    def __post_init__(self):
        if self.seq_len < 1 or self.workers < 0 or self.nodes < 1 or not 0 <= self.node_rank < self.nodes:
            raise ConfigError(f"--seq_len={self.seq_len}, --workers={self.workers}, --nodes={self.nodes}, "
                              f"--node_rank={self.node_rank}: need seq_len >= 1, workers >= 0, nodes >= 1 "
                              "and 0 <= node_rank < nodes")


def identity(cfg: DataConfig, tokenizer, seq_len: int, sources) -> dict:
    """What a shard directory was built from; a re-run must match it to resume."""
    how = ({"text_field": cfg.text_field} if cfg.format == "text" else
           {"messages_field": cfg.messages_field, "fields": cfg.fields, "long": cfg.long, "seq_len": seq_len})
    return {"layout": shards.LAYOUT_VERSION, "rules": data.CACHE_VERSION, "format": cfg.format,
            "tokenizer": tokenizer.fingerprint(), "vocab_size": tokenizer.vocab_size,
            "dtype": shards.token_dtype(tokenizer.vocab_size).name, "skip_bad_rows": cfg.skip_bad_rows,
            "split": cfg.split, **how, "task_bytes": data.JSONL_TASK_BYTES, "sources": sources}


# --------------------------------------------------------------------------- one task

@functools.lru_cache(maxsize=None)
def _tokenizer(spec):  # once per worker process
    return load_tokenizer(spec)


def _progress_file(job, rank):
    return os.path.join(job["progress_dir"], f"{rank:05d}")


def run_task(job: dict, rank: int, tokenizer=None):
    """Build shard `rank` unless it is done. A UserError (a bad row) is recorded for the
    parent, which reports it as one line."""
    root = job["output"]
    if storage.exists(shards.shard_path(root, rank, "json")):
        return
    _remove_leftovers(root, rank)
    cfg = DataConfig(**job["data"])
    tok = tokenizer or _tokenizer(job["tokenizer_spec"])
    bad, long = data._BadRows(cfg.skip_bad_rows), data._LongRows(cfg, job["seq_len"])
    opened, task = [], job["tasks"][rank]
    writer = shards.ShardWriter(root, rank, job["identity"]["dtype"], with_mask=cfg.format != "text")
    try:
        rows = data.task_rows(cfg, task, opened)
        note, last = _progress_file(job, rank), 0.0
        for ids, mask in data.documents(rows, tok, cfg, job["seq_len"], bad, long):
            writer.add(ids, mask)
            if writer.docs % 256 == 0 and time.monotonic() - last > _PROGRESS_EVERY:
                last = time.monotonic()
                _note(note, writer.docs, writer.tokens, _bytes_read(opened, task, job["sizes"][rank]))
    except UserError as e:
        writer.abort()
        with open(_progress_file(job, rank) + ".error", "w") as f:
            f.write(str(e))
        return
    except BaseException:
        writer.abort()
        raise
    counts = {"rows": bad.rows, "bad": bad.bad, "first_bad": bad.first,
              "long_rows": long.rows, "long": long.long, "dropped": long.dropped}
    writer.commit({"source": task, "counts": counts})
    _note(_progress_file(job, rank), writer.docs, writer.tokens, job["sizes"][rank] or 0)


def _bytes_read(opened, task, size):
    """How many bytes of its (compressed) input a task has read."""
    if not opened:
        return 0
    try:
        done = opened[0].tell() - (task[1] if isinstance(task, list) else 0)
    except ValueError:  # closed: read to the end (its last documents are still being written)
        return size or 0
    return max(0, min(done, size or done))


def _note(path, docs, tokens, done_bytes):
    with open(path + ".tmp", "w") as f:
        f.write(f"{docs} {tokens} {done_bytes}")
    os.replace(path + ".tmp", path)


def _remove_leftovers(root, rank):
    """The temporary files of a killed task (local dirs only: on GCS nothing half-written
    exists). Those of live processes, such as another host building the same cache, stay."""
    if not storage.is_local(root):
        return
    where = storage.fs_and_path(root)[1] + "/shards"
    for name in os.listdir(where) if os.path.isdir(where) else []:
        if name.lstrip(".").startswith(f"{rank:05d}.") and shards.is_stale(name):
            path = os.path.join(where, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def _datatrove_step(job):
    """The pipeline step datatrove runs for each rank (a picklable callable)."""
    def step(_data, rank, _world_size):
        run_task(job, rank)
        return []
    return step


# ------------------------------------------------------------------------- the build

def build(cfg: DataConfig, tokenizer, output: str, seq_len: int, *, tokenizer_spec: str = "",
          workers: int = 1, nodes: int = 1, node_rank: int = 0, progress=None) -> dict | None:
    """Build (or finish building) the shards of cfg's source in `output`. Returns the
    manifest, or None when other nodes still have shards to build. progress: True, False,
    or None (only on a terminal)."""
    if cfg.format == "fields":
        data._check_specials(data.parse_fields(cfg.fields), tokenizer)
    sources, tasks, sizes = data.source_tasks(cfg)
    ident = identity(cfg, tokenizer, seq_len, sources)
    manifest = shards.read_manifest(output)
    if manifest is not None:
        if {k: manifest.get(k) for k in ident} != ident:
            raise UserError(f"--output: {output} holds shards of another corpus, tokenizer or "
                            "options; choose a new directory or delete it")
        return manifest
    plan_path = output.rstrip("/") + "/plan.json"
    if storage.exists(plan_path):
        if storage.read_json(plan_path) != ident:
            raise UserError(f"--output: {output} holds an unfinished build of another corpus, "
                            "tokenizer or options; choose a new directory or delete it")
    else:
        shards.put_json(plan_path, ident)

    # A node's share is a contiguous block of tasks (as datatrove's local_rank_offset takes it).
    mine = list(range(len(tasks) * node_rank // nodes, len(tasks) * (node_rank + 1) // nodes))
    progress_dir = tempfile.mkdtemp(prefix="meshlm-tokenize-")
    job = {"output": output, "data": dataclasses.asdict(cfg), "tokenizer_spec": tokenizer_spec,
           "seq_len": seq_len, "identity": ident, "tasks": tasks, "sizes": sizes,
           "progress_dir": progress_dir}
    try:
        with _ProgressBar(job, mine, progress):
            if workers <= 1 or len(mine) <= 1:
                for rank in mine:
                    run_task(job, rank, tokenizer)
                    if any(f.endswith(".error") for f in os.listdir(progress_dir)):
                        break  # reported below
            else:
                _run_datatrove(job, mine, workers)
        errors = sorted(f for f in os.listdir(progress_dir) if f.endswith(".error"))
        if errors:
            with open(os.path.join(progress_dir, errors[0])) as f:
                raise data.DataError(f.read())
    finally:
        for f in os.listdir(progress_dir):
            os.remove(os.path.join(progress_dir, f))
        os.rmdir(progress_dir)
    return _finish(cfg, output, ident, len(tasks), seq_len)


def _run_datatrove(job, mine, workers):
    try:
        from datatrove.executor import LocalPipelineExecutor
    except ImportError:
        raise ConfigError("--workers > 1 runs on datatrove: pip install 'meshlm[data]' "
                          "(or pass --workers=1)") from None
    from loguru import logger
    logger.remove()  # datatrove's own log lines would break the progress bar

    class Quiet(LocalPipelineExecutor):
        def _run_for_rank(self, rank, local_rank=0, node_rank=-1):
            with contextlib.redirect_stderr(io.StringIO()):
                return super()._run_for_rank(rank, local_rank, node_rank)

    logs = tempfile.mkdtemp(prefix="meshlm-datatrove-")
    try:
        # Our shard records say what is done (on every node), so datatrove's own completion
        # marks are not consulted. Fork: the workers inherit the loaded modules.
        Quiet([_datatrove_step(job)], tasks=len(job["tasks"]), workers=min(workers, len(mine)),
              logging_dir=logs, skip_completed=False, local_tasks=len(mine),
              local_rank_offset=mine[0], start_method="fork").run()
    finally:
        shutil.rmtree(logs, ignore_errors=True)


def _finish(cfg, output, ident, n_tasks, seq_len):
    """Write the manifest once every shard is done (None while some are not)."""
    records = []
    for rank in range(n_tasks):
        path = shards.shard_path(output, rank, "json")
        if not storage.exists(path):
            return None
        records.append(storage.read_json(path))
    bad, long = data._BadRows(cfg.skip_bad_rows), data._LongRows(cfg, seq_len)
    for r in records:
        c = r["counts"]
        bad.rows, bad.bad, bad.first = bad.rows + c["rows"], bad.bad + c["bad"], bad.first or c["first_bad"]
        long.rows, long.long = long.rows + c["long_rows"], long.long + c["long"]
        long.dropped += c["dropped"]
    notes = data.check_counts(cfg, seq_len, bad, long)
    manifest = {**ident, "notes": notes, "docs": sum(r["docs"] for r in records),
                "tokens": sum(r["tokens"] for r in records),
                "shards": [{k: r[k] for k in ("docs", "tokens", "mask", "source")} for r in records]}
    shards.put_json(output.rstrip("/") + "/" + shards.MANIFEST, manifest)
    return manifest


class _ProgressBar:
    """Documents, tokens/s and ETA (by input bytes) from the tasks' notes, polled in a thread."""

    def __init__(self, job, ranks, enabled):
        self.job, self.ranks, self.enabled = job, ranks, enabled
        sizes = [job["sizes"][r] for r in ranks]
        self.total = sum(sizes) if sizes and all(s is not None for s in sizes) else None
        self.stop = threading.Event()

    def __enter__(self):
        if self.enabled is False or (self.enabled is None and not sys.stderr.isatty()):
            return self
        from tqdm import tqdm
        self.bar = tqdm(total=self.total, unit="B", unit_scale=True, desc="tokenize", dynamic_ncols=True,
                        file=sys.stderr)
        self.start = time.monotonic()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _read(self):
        docs = tokens = done = 0
        for rank in self.ranks:
            try:
                with open(_progress_file(self.job, rank)) as f:
                    d, t, b = map(int, f.read().split())
            except (OSError, ValueError):
                continue
            docs, tokens, done = docs + d, tokens + t, done + b
        return docs, tokens, done

    def _poll(self):
        while True:
            stopping = self.stop.wait(0.5)
            docs, tokens, done = self._read()
            self.bar.n = done
            rate = tokens / max(time.monotonic() - self.start, 1e-9)
            self.bar.set_postfix_str(f"{docs:,} docs, {rate:,.0f} tokens/s", refresh=False)
            self.bar.refresh()
            if stopping:
                return

    def __exit__(self, *exc):
        if hasattr(self, "bar"):
            self.stop.set()
            self.thread.join()
            self.bar.close()


def main(argv=None):
    cfg = parse_or_exit("trainer.tokenize", TokenizeFlags, argv)
    if not cfg.output:
        sys.exit("error: --output is required: the shard directory to write (local or gs://)")
    if cfg.data.mix:
        sys.exit("error: --data.mix: trainer.tokenize builds one source; run it once per source "
                 "(--data.path=PATH --output=DIR) and mix the directories when training")
    created = not storage.exists(cfg.output)
    try:
        tokenizer = load_tokenizer(cfg.tokenizer)
        workers = cfg.workers or os.cpu_count() or 1
        t0 = time.perf_counter()
        manifest = build(cfg.data, tokenizer, cfg.output, cfg.seq_len, tokenizer_spec=cfg.tokenizer,
                         workers=workers, nodes=cfg.nodes, node_rank=cfg.node_rank,
                         progress=cfg.progress)
    except UserError as e:
        if created and storage.exists(cfg.output):  # nothing that looks like a result stays
            fs, path = storage.fs_and_path(cfg.output)
            fs.rm(path, recursive=True)
        sys.exit(f"error: {e}")
    seconds = time.perf_counter() - t0
    if manifest is None:
        print(f"node {cfg.node_rank}: its shards are done; the last node to finish writes the manifest")
        return
    for note in manifest["notes"]:
        print(note, file=sys.stderr)
    print(json.dumps({"output": cfg.output, "shards": len(manifest["shards"]), "docs": manifest["docs"],
                      "tokens": manifest["tokens"], "seconds": round(seconds, 3)}))


if __name__ == "__main__":
    main()
