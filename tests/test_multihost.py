"""Real multi-host training: two OS processes with 4 CPU devices each, joined by
jax.distributed on 127.0.0.1 (gloo collectives), train on one global 8-device mesh and must
match one process with 8 devices. Also: the launch scripts parse."""

import hashlib
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO, cli_env, run_cli
from trainer import data, train
from trainer.tokenizer import load_tokenizer

FLAGS = ["--model=tiny", "--steps=3", "--log_every=1", "--batch_size=16", "--seq_len=64",
         "--eval_batches=2"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_together(commands, envs, logs, timeout):
    """Start all commands; if one fails, kill the rest (a dead peer must not hang the test)."""
    procs = []
    try:
        for command, env, log in zip(commands, envs, logs):
            procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=open(log, "w"),
                                          stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return [p.returncode for p in procs]


def logged(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [
    "2,2,2",  # dp spans the two processes; fsdp and tp stay inside each
    "1,8,1",  # fsdp spans them: every weight is split across hosts
])
def test_two_processes_train_exactly_like_one(tmp_path, mesh):
    common = [*FLAGS, f"--mesh={mesh}", f"--data.cache_dir={tmp_path}/cache"]
    run_cli("train", *common, f"--output_dir={tmp_path}/single", devices=8, timeout=300)

    port, rows_log = free_port(), tmp_path / "rows"
    commands = [[sys.executable, "-m", "trainer.train", *common, f"--output_dir={tmp_path}/multi",
                 f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                 f"--process_id={i}"] for i in range(2)]
    envs = [cli_env(4, MESHLM_DEBUG_ROWS_LOG=str(rows_log))] * 2
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    codes = run_together(commands, envs, logs, timeout=300)
    out = [log.read_text() for log in logs]
    assert codes == [0, 0], f"exit codes {codes}\n" + "\n".join(o[-3000:] for o in out)

    # The same losses, held-out losses and step count as one process on 8 devices.
    single, multi = logged(tmp_path / "single"), logged(tmp_path / "multi")
    assert [r["step"] for r in multi] == [r["step"] for r in single] == [0, 1, 2, 3]
    for a, b in zip(single, multi):
        for key in ("loss", "val_loss", "grad_norm"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5), (key, a, b)
    print("max relative loss difference, one process vs two:", max(
        abs(b["loss"] / a["loss"] - 1) for a, b in zip(single, multi) if "loss" in a))

    # Only process 0 talks; every process saved its part of the checkpoint.
    assert "done: 3 steps" in out[0] and "val_loss" in out[0]
    assert "done:" not in out[1] and "val_loss" not in out[1]
    assert (tmp_path / "multi" / "checkpoints" / "3" / "params").is_dir()

    # Each process loaded exactly its half of every global batch, and the right rows.
    cfg = train.resolve_config(common)
    dataset, _ = data.load_dataset(cfg.data, load_tokenizer("bytes"), cfg.seq_len)
    for i in range(2):
        records = [json.loads(l) for l in open(f"{rows_log}.{i}").read().splitlines()]
        assert [r["step"] for r in records] == [0, 1, 2]
        for r in records:
            lo, hi = 8 * i, 8 * i + 8
            assert r["process"] == i and r["rows"] == [lo, hi] and r["loaded"] == 8
            full = dataset.batch(r["step"], cfg.batch_size, cfg.seed)
            assert r["sha1"] == hashlib.sha1(full["inputs"][lo:hi].tobytes()).hexdigest()


@pytest.mark.parametrize("script", ["tpu_pod.sh", "gpu_multinode.sh"])
def test_launch_scripts_parse(script):
    path = os.path.join(REPO, "scripts", script)
    assert os.access(path, os.X_OK), f"{path} is not executable"
    subprocess.run(["bash", "-n", path], check=True)
    # --help works without a cluster and names the command it runs.
    proc = subprocess.run(["bash", path, "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "trainer.train" in proc.stdout
