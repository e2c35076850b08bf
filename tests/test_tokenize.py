"""trainer/tokenize.py, shards.py, permute.py and the lazy, mixed data path of data.py.

The oracle is the in-memory path (data.load_dataset_in_memory: every document tokenized and
packed in RAM, no shards), and numpy for the permutation and the mixture counts."""

import gzip
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import zstandard

from conftest import REPO, cli_env, run_cli
from test_gcs import BUCKET, gcs, gcs_env, names, upload  # noqa: F401 (gcs: the emulator fixture)
from trainer import data, shards, tokenize
from trainer.config import DataConfig
from trainer.permute import Permutation
from trainer.tokenizer import load_tokenizer

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
CHATS = [[{"role": "user", "content": f"Question {i}?"},
          {"role": "assistant", "content": "Answer " + "yes " * (i % 7)}] for i in range(60)]


def text_docs(seed, n):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(3, 60))) for _ in range(n)]


def jsonl(rows):
    return "".join(json.dumps(r) + "\n" for r in rows)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Text in every form the builder reads: plain JSONL, gzip, zstd and a .txt file."""
    d = tmp_path_factory.mktemp("corpus")
    (d / "a.jsonl").write_text(jsonl({"text": t} for t in text_docs(0, 150)))
    with gzip.open(d / "b.jsonl.gz", "wt") as f:
        f.write(jsonl({"text": t} for t in text_docs(1, 120)))
    (d / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        jsonl({"text": t} for t in text_docs(2, 90)).encode()))
    (d / "d.txt").write_text("\n\n".join(text_docs(3, 40)))
    return d


def build(tmp_path, name, **kw):
    cfg = DataConfig(**({"path": kw.pop("path")} | kw))
    tok = load_tokenizer("bytes")
    tokenize.build(cfg, tok, str(tmp_path / name), 64, progress=False)
    return str(tmp_path / name)


def files_digest(root):
    out = {}
    for dirpath, _, files in os.walk(root):
        for n in files:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, root)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def same_batches(a, b):
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


# ------------------------------------------------------------ shards = in-memory tokens

@pytest.mark.parametrize("fmt", ["text", "chat"])
def test_shards_hold_the_in_memory_tokens_boundaries_and_masks(corpus, tmp_path, fmt):
    if fmt == "chat":
        (tmp_path / "chats").mkdir()
        (tmp_path / "chats/a.jsonl").write_text(jsonl({"messages": m} for m in CHATS[:35]))
        with gzip.open(tmp_path / "chats/b.jsonl.gz", "wt") as f:
            f.write(jsonl({"messages": m} for m in CHATS[35:]))
        path = str(tmp_path / "chats/*")
    else:
        path = str(corpus / "*")
    cfg = DataConfig(path=path, format=fmt)
    tok = load_tokenizer("bytes")
    root = build(tmp_path, "shards", path=path, format=fmt)
    tokens, offsets, mask, _ = data._tokenize(data._resolve_source(cfg)[1](), tok, cfg, 64)
    reader = shards.ShardReader(root)
    assert reader.dtype == np.uint16 and len(reader.manifest["shards"]) == (2 if fmt == "chat" else 4)
    got = data._load_all(reader)
    np.testing.assert_array_equal(got[0], tokens)
    np.testing.assert_array_equal(got[1], offsets)
    if fmt == "chat":
        np.testing.assert_array_equal(got[2], mask)
        assert 0 < mask.mean() < 1
    # Training from the directory: exactly the in-memory path's batches.
    train, val = data.load_dataset(DataConfig(path=root, format=fmt, val_fraction=0.1), tok, 64)
    ref_train, ref_val = data.load_dataset_in_memory(DataConfig(path=path, format=fmt, val_fraction=0.1), tok, 64)
    assert isinstance(train, data.StreamDataset) == (fmt == "text")
    for step in (0, 3, 57):  # 57: past the first epoch
        same_batches(train.batch(step, 8, seed=5), ref_train.batch(step, 8, seed=5))
        same_batches(train.batch(step, 8, seed=5, rows=slice(4, 8)), ref_train.batch(step, 8, seed=5, rows=slice(4, 8)))
    for a, b in zip(val.eval_batches(8), ref_val.eval_batches(8), strict=True):
        same_batches(a, b)


def test_a_large_jsonl_file_is_split_into_tasks_on_line_boundaries(corpus, tmp_path, monkeypatch):
    size = (corpus / "a.jsonl").stat().st_size
    monkeypatch.setattr(data, "JSONL_TASK_BYTES", 997)  # cuts fall inside lines and on their ends
    cfg, tok = DataConfig(path=str(corpus / "*")), load_tokenizer("bytes")
    root = build(tmp_path, "shards", path=str(corpus / "*"))
    tasks = data.source_tasks(cfg)[1]
    assert len(tasks) == 3 + -(-size // 997) and tasks[1] == [f"file://{corpus}/a.jsonl", 997, 1994]
    tokens, offsets, _, _ = data._tokenize(data._resolve_source(cfg)[1](), tok, cfg, 64)
    got = data._load_all(shards.ShardReader(root))
    np.testing.assert_array_equal(got[0], tokens)
    np.testing.assert_array_equal(got[1], offsets)
    (tmp_path / "big.jsonl").write_text(jsonl([{"text": "fine"}] * 300) + "[1]\n")
    with pytest.raises(data.DataError, match=rf"big.jsonl:byte {300 * 17}: expected a JSON object, got list"):
        build(tmp_path, "bad", path=str(tmp_path / "big.jsonl"))


def test_lazy_reads_touch_only_the_rows_asked_for(corpus, tmp_path, monkeypatch):
    root = build(tmp_path, "shards", path=str(corpus / "*"))
    train, _ = data.load_dataset(DataConfig(path=root), load_tokenizer("bytes"), 64)
    asked = []
    real = train.reader.read
    monkeypatch.setattr(train.reader, "read", lambda kind, ranges: asked.extend(ranges) or real(kind, ranges))
    train.batch(7, 4, seed=0)
    assert sum(b - a for a, b in asked) == 4 * 65  # four rows of seq_len + 1, nothing else


# -------------------------------------------------------- CLI, engine, kill and resume

def test_cli_on_datatrove_with_two_workers_and_a_killed_rerun(corpus, tmp_path):
    out = tmp_path / "two"
    proc = run_cli("tokenize", f"--data.path={corpus}/*", f"--output={out}", "--workers=2")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["shards"] == 4 and summary["docs"] == 150 + 120 + 90 + 1  # d.txt: one document
    assert "docs" in proc.stderr and "tokens/s" in proc.stderr  # the progress bar
    reference = files_digest(out)

    # A real kill (SIGKILL, no cleanup) as soon as the first shard is done, then a re-run.
    killed = tmp_path / "killed"
    p = subprocess.Popen([sys.executable, "-m", "trainer.tokenize", f"--data.path={corpus}/*",
                          f"--output={killed}", "--workers=1"], cwd=REPO, env=cli_env(TMPDIR=str(tmp_path)),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while p.poll() is None and not (killed / "shards/00000.json").exists():
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    p.wait()
    # A manifest means the run had finished (the kill may land after it is written).
    assert not (killed / "manifest.json").exists() or all(
        (killed / f"shards/{i:05d}.json").exists() for i in range(4))
    # ... and what a kill in the middle of a shard leaves: a temp dir, a shard without its record.
    (killed / "shards").mkdir(parents=True, exist_ok=True)
    dead = killed / f"shards/.00003.tmp@{socket.gethostname()}@{p.pid}-x1y2"  # p is gone
    dead.mkdir()
    (dead / "tokens").write_bytes(b"\0" * 10)
    (killed / f"shards/00001.json.tmp@{socket.gethostname()}@{p.pid}").write_text("{")
    alive = killed / f"shards/.00003.tmp@{socket.gethostname()}@{os.getpid()}-x1y2"  # a live writer's
    alive.mkdir()
    (killed / "shards/00003.tokens").write_bytes(b"\1" * 7)
    (killed / "shards/00003.json").unlink(missing_ok=True)
    (killed / "manifest.json").unlink(missing_ok=True)
    done_before = {n: (killed / "shards" / n).stat().st_mtime_ns for n in ("00000.tokens",)}
    (killed / "shards/00001.json").unlink(missing_ok=True)
    run_cli("tokenize", f"--data.path={corpus}/*", f"--output={killed}", "--workers=1")
    assert alive.is_dir()  # another process's work in progress is left alone
    alive.rmdir()
    assert files_digest(killed) == reference  # byte-identical, and no leftovers
    assert (killed / "shards/00000.tokens").stat().st_mtime_ns == done_before["00000.tokens"]  # not redone


def test_nodes_each_build_their_block_and_the_last_writes_the_manifest(corpus, tmp_path):
    cfg, tok = DataConfig(path=str(corpus / "*")), load_tokenizer("bytes")
    one = build(tmp_path, "one", path=str(corpus / "*"))
    shared = str(tmp_path / "shared")
    assert tokenize.build(cfg, tok, shared, 64, nodes=2, node_rank=1, progress=False) is None
    assert sorted(os.listdir(f"{shared}/shards")) == [f"0000{i}.{k}" for i in (2, 3) for k in ("json", "offsets", "tokens")]
    assert tokenize.build(cfg, tok, shared, 64, nodes=2, node_rank=0, progress=False)["docs"] == 361
    assert files_digest(shared) == files_digest(one)


def test_cli_errors_are_one_line_and_leave_nothing(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    proc = run_cli("tokenize", f"--data.path={tmp_path}/bad.jsonl", f"--output={tmp_path}/out", check=False)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path}/bad.jsonl:2: not valid JSON (Expecting value); each line must be one JSON object")
    assert not (tmp_path / "out").exists()
    other = build(tmp_path, "other", path=str(tmp_path / "bad.jsonl"), skip_bad_rows=True)
    proc = run_cli("tokenize", f"--data.path={tmp_path}/bad.jsonl", f"--output={other}", check=False)
    assert proc.returncode == 1 and "holds shards of another corpus, tokenizer or options" in proc.stderr
    assert (tmp_path / "other/manifest.json").exists()  # someone else's shards stay


def test_training_refuses_unfinished_shards_and_another_tokenizer(corpus, tmp_path):
    root = build(tmp_path, "shards", path=str(corpus / "a.jsonl"))
    os.rename(f"{root}/manifest.json", f"{root}/manifest.bak")
    with pytest.raises(data.DataError, match="is an unfinished shard directory; re-run the trainer.tokenize"):
        data.load_dataset(DataConfig(path=root), load_tokenizer("bytes"), 64)
    os.rename(f"{root}/manifest.bak", f"{root}/manifest.json")
    sp = tmp_path / "x.model"
    import sentencepiece as spm
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text_docs(0, 200)), model_prefix=str(sp)[:-6],
                                   vocab_size=25, minloglevel=2)
    with pytest.raises(data.DataError, match=r"were made with another tokenizer \(bytes\)"):
        data.load_dataset(DataConfig(path=root), load_tokenizer(str(sp)), 64)


# ----------------------------------------------------------------- permutation, split

def test_permutation_is_a_true_permutation_exhaustively():
    for n in range(1, 300):
        for key in [(0, 0), (7, 1), (-3, 12345)]:
            perm = Permutation(n, key)
            out = perm(np.arange(n))
            np.testing.assert_array_equal(np.sort(out), np.arange(n))  # every row exactly once
            np.testing.assert_array_equal(perm.inverse(out), np.arange(n))
    a, b = Permutation(1000, (0, 0))(np.arange(1000)), Permutation(1000, (0, 1))(np.arange(1000))
    assert (a != b).mean() > 0.9 and abs(np.corrcoef(a, np.arange(1000))[0, 1]) < 0.1


def test_every_row_once_per_epoch_and_the_split_is_fixed():
    ds = data.Dataset(np.arange(37 * 3).reshape(37, 3) % 250, np.ones((37, 3), np.uint8), pad_id=258)
    seen = np.concatenate([ds.row_ids(s, 5, seed=2) for s in range(37 * 4 // 5 + 1)])[:37 * 4]
    for e in range(4):
        np.testing.assert_array_equal(np.sort(seen[37 * e:37 * (e + 1)]), np.arange(37))
    val = data.validation_doc_ids(1000, 0.05)
    assert len(val) == 50 and len(set(val)) == 50
    np.testing.assert_array_equal(val, data.validation_doc_ids(1000, 0.05))  # same every run, any --seed


# --------------------------------------------------------------------------- mixtures

def test_mixture_draws_by_weight_and_every_row_once_per_source_epoch():
    sizes, weights = [50, 31, 7], [0.6, 0.3, 0.1]
    parts = [data.Dataset(np.full((n, 3), i, np.uint32) * 1000 + np.arange(n)[:, None], np.ones((n, 3), np.uint8), 0)
             for i, n in enumerate(sizes)]
    mix = data.Mixture(["a", "b", "c"], weights, parts)
    steps, batch = 400, 16
    tokens = np.concatenate([mix.batch(s, batch, seed=3)["inputs"][:, 0] for s in range(steps)])
    source, row = tokens // 1000, tokens % 1000
    counts = np.bincount(source, minlength=3)
    n = steps * batch
    # Random draws would be within a few binomial sigmas; the schedule keeps each count within 1.
    for c, w in zip(counts, weights):
        assert abs(c - n * w) <= 1
    for s, size in enumerate(sizes):
        drawn = row[source == s]
        full = len(drawn) // size * size
        for e in range(0, full, size):  # each source epoch: every row once
            np.testing.assert_array_equal(np.sort(drawn[e:e + size]), np.arange(size))
    epochs = mix.epochs(steps, batch)
    assert epochs == {f"epochs.{k}": pytest.approx(c / s) for k, c, s in zip("abc", counts, sizes)}
    # A pure function of (seed, step), and a host's rows are its slice of the global batch.
    same_batches(mix.batch(123, batch, seed=3, rows=slice(8, 16)),
                 {k: v[8:] for k, v in mix.batch(123, batch, seed=3).items()})


def test_mix_flag_is_checked():
    from trainer.flags import ConfigError
    with pytest.raises(ConfigError, match="each source is NAME=WEIGHT:PATH"):
        DataConfig(mix="web=0.7")
    with pytest.raises(ConfigError, match="source names must differ"):
        DataConfig(mix="a=1:x,a=2:y")


# ------------------------------------------------------------- processes and gs://

READ_ROWS = """
import hashlib, sys
from trainer import data
from trainer.config import DataConfig
from trainer.tokenizer import load_tokenizer
path, lo, hi = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
train, _ = data.load_dataset(DataConfig(path=path), load_tokenizer("bytes"), 64)
for step in (0, 1, 40):
    b = train.batch(step, 8, seed=1, rows=slice(lo, hi))
    print(hashlib.sha256(b"".join(b[k].tobytes() for k in sorted(b))).hexdigest())
"""


def digests(batch_dicts):
    return [hashlib.sha256(b"".join(b[k].tobytes() for k in sorted(b))).hexdigest() for b in batch_dicts]


def test_batch_is_the_same_from_one_or_two_processes(corpus, tmp_path):
    root = build(tmp_path, "shards", path=str(corpus / "*"))
    procs = [subprocess.Popen([sys.executable, "-c", READ_ROWS, root, str(lo), str(hi)], cwd=REPO,
                              env=cli_env(), stdout=subprocess.PIPE, text=True)
             for lo, hi in ((0, 4), (4, 8))]
    halves = [p.communicate(timeout=120)[0].split() for p in procs]
    ref, _ = data.load_dataset_in_memory(DataConfig(path=str(corpus / "*")), load_tokenizer("bytes"), 64)
    for i, step in enumerate((0, 1, 40)):
        assert [halves[0][i], halves[1][i]] == digests(
            [ref.batch(step, 8, seed=1, rows=slice(0, 4)), ref.batch(step, 8, seed=1, rows=slice(4, 8))])


@pytest.mark.slow
def test_shards_on_gcs_by_byte_ranges(corpus, tmp_path, gcs):
    gcs_url, env = gcs, gcs_env(gcs)
    upload(gcs_url, "corpus/a.jsonl", (corpus / "a.jsonl").read_bytes())
    upload(gcs_url, "corpus/c.jsonl.zst", (corpus / "c.jsonl.zst").read_bytes())
    root = f"gs://{BUCKET}/shards"
    run_cli("tokenize", f"--data.path=gs://{BUCKET}/corpus/*", f"--output={root}", "--workers=2", env=env)
    assert {"shards/manifest.json", "shards/shards/00000.tokens", "shards/shards/00001.json"} <= set(
        names(gcs_url, "shards/"))
    out = subprocess.run([sys.executable, "-c", READ_ROWS, root, "0", "8"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    local = tmp_path / "local"
    local.mkdir()
    for n in ("a.jsonl", "c.jsonl.zst"):
        (local / n).write_bytes((corpus / n).read_bytes())
    ref, _ = data.load_dataset_in_memory(DataConfig(path=str(local / "*")), load_tokenizer("bytes"), 64)
    assert out.stdout.split() == digests([ref.batch(s, 8, seed=1) for s in (0, 1, 40)])


@pytest.mark.slow
def test_train_on_a_shard_dir_and_a_mixture(corpus, tmp_path):
    root = build(tmp_path, "shards", path=str(corpus / "*"))
    run_cli("train", f"--data.mix=web=0.75:{root},code=0.25:{corpus}/a.jsonl", "--steps=4",
            "--log_every=2", "--eval_every=4", "--eval_batches=1", "--batch_size=8", "--seq_len=64",
            "--model.num_hidden_layers=1", f"--data.cache_dir={tmp_path}/cache",
            f"--output_dir={tmp_path}/run", "--compile_cache=")
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["step"] == 4 and {"val_loss.web", "val_loss.code", "epochs.web", "epochs.code",
                                  "loss.web", "loss.code"} <= set(last)
    # The step's loss is the token-weighted mean of the sources': it lies between them.
    assert min(last["loss.web"], last["loss.code"]) <= last["loss"] <= max(last["loss.web"], last["loss.code"])
    train, _ = data.load_dataset(DataConfig(path=root), load_tokenizer("bytes"), 64)
    assert last["epochs.web"] == pytest.approx(4 * 8 * 0.75 / train.num_rows)


def test_per_source_training_loss_is_each_sources_own_loss():
    """The mixture objective's per-source sums equal the loss of each source's rows alone."""
    import jax
    from trainer import train
    from trainer.model import batch_loss, build_model
    cfg = train.resolve_config(["--data.mix=a=0.5:x,b=0.5:y", "--model.num_hidden_layers=1"])
    model = build_model(cfg.model)
    params = model.init(jax.random.PRNGKey(0), np.zeros((1, 16), np.int32))["params"]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (6, 17), np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "loss_mask": (rng.random((6, 16)) < 0.7).astype(np.float32),
             "source": np.array([0, 1, 1, 0, 1, 1], np.int32)}
    objective = train.make_objective(cfg, model, None)
    loss, count, sums = objective.loss(params, None, batch, None)
    assert set(objective.metrics) == set(sums) == {"loss_sum.a", "tokens.a", "loss_sum.b", "tokens.b"}
    for i, name in enumerate("ab"):
        rows = {k: v[batch["source"] == i] for k, v in batch.items() if k != "source"}
        alone, n = batch_loss(model, params, rows)
        np.testing.assert_allclose(sums[f"loss_sum.{name}"], alone, rtol=1e-5)
        assert float(sums[f"tokens.{name}"]) == float(n)
    np.testing.assert_allclose(loss, sums["loss_sum.a"] + sums["loss_sum.b"], rtol=1e-6)
