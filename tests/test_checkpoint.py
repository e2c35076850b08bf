"""Spot-ready training, run for real: Orbax checkpoints, resume by re-running the same
command, SIGTERM, kill -9 in the middle of a save, restore onto other meshes, bad steps.

One reference run (A) trains 12 steps on a 1,8,1 mesh; the other runs repeat it with
interruptions and must reproduce its metrics and weights bit for bit (or, on another
mesh, to fp32 tolerance)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from conftest import REPO, cli_env, run_cli
from trainer import checkpoint, lora, optim, train

STEPS = 12
SMALL = ["--seq_len=32", "--batch_size=8", "--model.num_hidden_layers=2", "--eval_every=0",
         "--eval_batches=2", "--log_every=1", f"--steps={STEPS}"]
COMPARED = ("loss", "grad_norm", "lr", "val_loss", "skipped")


def train_args(out_dir, cache, *extra, mesh="1,8,1"):
    # A save after every step, keeping the newest 2 and every 6th: 6, 11 and 12 survive.
    return [*SMALL, f"--mesh={mesh}", "--save_every=1", "--keep=2", "--keep_every=6",
            f"--data.cache_dir={cache}", f"--output_dir={out_dir}", *extra]


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def compared(records):
    return [{k: r[k] for k in ("step", *COMPARED) if k in r} for r in records]


def steps_on_disk(run_dir):
    return sorted(int(n) for n in os.listdir(os.path.join(run_dir, "checkpoints")) if n.isdigit())


def load_numpy(step_dir, item="params"):
    """One item of a checkpoint as a tree of numpy arrays, whatever mesh wrote it."""
    ckptr = ocp.PyTreeCheckpointer()
    path = os.path.join(step_dir, item)
    tree = ckptr.metadata(path).item_metadata.tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    return ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))


def assert_trees_equal(a, b):
    flat_a, flat_b = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)
    assert len(flat_a) == len(flat_b)
    for (path, x), y in zip(flat_a, flat_b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes(), f"{jax.tree_util.keystr(path)} differs"


class Started:
    """`python -m trainer.train args` in the background, its output going to files (a pipe
    nobody reads while we wait could fill up and stall it)."""

    def __init__(self, args, log_prefix, devices=8):
        self.out_path, self.err_path = f"{log_prefix}.out", f"{log_prefix}.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trainer.train", *args], cwd=REPO, stdout=out,
                stderr=err, env=cli_env(devices, PYTHONUNBUFFERED="1"))  # for kill -9
        self.pid = self.proc.pid

    def poll(self):
        return self.proc.poll()

    def state(self):
        """R, S, T (stopped), Z... from /proc/<pid>/stat"""
        with open(f"/proc/{self.pid}/stat") as f:
            return f.read().rsplit(") ", 1)[-1][0]

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def wait(self, timeout):
        """-> (returncode, stdout, stderr)"""
        self.proc.wait(timeout=timeout)
        with open(self.out_path) as out, open(self.err_path) as err:
            return self.proc.returncode, out.read(), err.read()


def last_logged_step(run_dir):
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            steps = [json.loads(line)["step"] for line in f if line.strip()]
    except (FileNotFoundError, json.JSONDecodeError):
        return -1
    return max(steps, default=-1)


def wait_for_save_then_kill(proc, ckpt_dir, after_step):
    """SIGSTOP the trainer while a checkpoint directory is still temporary, check that it
    is, then SIGKILL: a kill -9 that certainly lands in the middle of a save."""
    while proc.poll() is None:
        names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
        tmp = [n for n in names
               if ".orbax-checkpoint-tmp" in n and int(n.split(".")[0]) > after_step]
        if not tmp:
            time.sleep(0.002)
            continue
        os.kill(proc.pid, signal.SIGSTOP)
        while proc.poll() is None and proc.state() not in "Tt":  # until it really stopped
            time.sleep(0.001)
        if proc.poll() is not None:
            break
        if any(os.path.exists(os.path.join(ckpt_dir, n)) for n in tmp):
            os.kill(proc.pid, signal.SIGKILL)
            return int(tmp[0].split(".")[0])
        os.kill(proc.pid, signal.SIGCONT)  # that save finished meanwhile: catch the next one
    raise AssertionError("the run ended before a save could be interrupted:\n"
                         + proc.wait(timeout=60)[2][-2000:])


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("token_cache"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
    """Run A: 12 steps straight, never interrupted."""
    run_dir = str(tmp_path_factory.mktemp("A") / "run")
    run_cli("train", *train_args(run_dir, cache), devices=8)
    return run_dir


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory, cache):
    """Run B: A's command, run three times. The first gets SIGTERM once training is under
    way; the second a kill -9 in the middle of a save; the third runs to the end."""
    base = tmp_path_factory.mktemp("B")
    run_dir, ckpt_dir = str(base / "run"), str(base / "run" / "checkpoints")
    args = train_args(run_dir, cache)

    proc = Started(args, base / "first")
    try:
        deadline = time.time() + 300
        while last_logged_step(run_dir) < 2 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGTERM)
        signalled = time.time()
        rc, out, err = proc.wait(timeout=120)
    finally:
        proc.kill()
    term = dict(rc=rc, seconds=time.time() - signalled, out=out, err=err,
                metrics=read_metrics(run_dir), steps=steps_on_disk(run_dir))
    term["newest"] = checkpoint.locate(run_dir) if term["steps"] else None

    proc = Started(args, base / "second")
    try:
        killed_at = wait_for_save_then_kill(proc, ckpt_dir, max(term["steps"], default=0))
        rc, out, err = proc.wait(timeout=60)
    finally:
        proc.kill()
    kill = dict(step=killed_at, rc=rc, out=out, err=err, left=os.listdir(ckpt_dir),
                steps=steps_on_disk(run_dir))

    final = run_cli("train", *args, devices=8)
    return run_dir, term, kill, final


# ------------------------------------------------------------------ resume, SIGTERM, kill -9
@pytest.mark.slow
def test_sigterm_saves_exits_0_and_the_same_command_resumes_there(interrupted):
    run_dir, term, kill, _ = interrupted
    assert term["rc"] == 0, term["err"][-2000:]
    assert term["seconds"] < 60
    stopped = re.search(r"stopped by signal at step (\d+); checkpoint saved in (\S+)\. Re-run",
                        term["out"])
    assert stopped, term["out"] + term["err"][-2000:]
    step = int(stopped.group(1))
    assert 2 <= step < STEPS
    assert stopped.group(2) == f"{run_dir}/checkpoints/{step}"
    assert "SIGTERM: finishing this step, then saving a checkpoint" in term["err"]
    assert step in term["steps"] and term["newest"] == (f"{run_dir}/checkpoints", step)
    assert term["metrics"][-1]["step"] == step
    assert f"resuming from step {step} of {run_dir}\n" in kill["out"]
    assert kill["out"].count("resuming from step") == 1


@pytest.mark.slow
def test_kill_9_during_a_save_resumes_from_the_previous_checkpoint(interrupted):
    run_dir, _, kill, final = interrupted
    step = kill["step"]
    assert kill["rc"] == -signal.SIGKILL
    assert any(n.startswith(f"{step}.orbax-checkpoint-tmp") for n in kill["left"]), kill["left"]
    assert step not in kill["steps"] and max(kill["steps"]) == step - 1
    assert f"resuming from step {step - 1} of {run_dir}\n" in final.stdout
    assert "Traceback" not in final.stderr
    assert not [n for n in os.listdir(f"{run_dir}/checkpoints") if "tmp" in n]  # cleaned up


@pytest.mark.slow
def test_interrupted_run_is_bitwise_identical_to_an_uninterrupted_one(reference, interrupted):
    run_dir = interrupted[0]
    expected = compared(read_metrics(reference))
    assert [r["step"] for r in expected] == list(range(STEPS + 1))
    assert expected[-1]["val_loss"] > 0
    assert compared(read_metrics(run_dir)) == expected  # every loss, grad_norm, lr, val_loss
    for item in ("params", "train"):
        assert_trees_equal(load_numpy(f"{reference}/checkpoints/{STEPS}", item),
                           load_numpy(f"{run_dir}/checkpoints/{STEPS}", item))
    assert steps_on_disk(reference) == steps_on_disk(run_dir) == [6, 11, 12]  # --keep(_every)


# ------------------------------------------------------------------ elastic restore
@pytest.mark.slow
@pytest.mark.parametrize("mesh,devices", [("2,2,2", 8), ("1,1,1", 1)])
def test_checkpoint_restores_onto_another_mesh(reference, cache, tmp_path, mesh, devices):
    run_dir = str(tmp_path / "run")
    shutil.copytree(reference, run_dir)
    for step in (11, 12):  # resume from step 6, saved on the 1,8,1 mesh
        shutil.rmtree(f"{run_dir}/checkpoints/{step}")
    out = run_cli("train", *train_args(run_dir, cache, mesh=mesh), devices=devices).stdout
    assert f"resuming from step 6 of {run_dir}" in out
    expected, got = read_metrics(reference), read_metrics(run_dir)
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    assert compared(got[:7]) == compared(expected[:7])  # kept from before the restore
    for want, have in zip(expected[7:], got[7:]):
        np.testing.assert_allclose(have["loss"], want["loss"], rtol=1e-5)
        np.testing.assert_allclose(have["grad_norm"], want["grad_norm"], rtol=1e-4)
    np.testing.assert_allclose(got[-1]["val_loss"], expected[-1]["val_loss"], rtol=1e-5)


# ------------------------------------------------------------------ --resume=never, bad steps
@pytest.mark.slow
def test_resume_never_refuses_a_used_dir_without_overwrite(reference, cache, tmp_path):
    run_dir = str(tmp_path / "run")
    shutil.copytree(reference, run_dir)
    proc = run_cli("train", *train_args(run_dir, cache, "--resume=never", mesh="1,1,1"),
                   check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: --output_dir={run_dir} is not empty; pass --overwrite to start over there, "
        "or pick another dir")
    assert steps_on_disk(run_dir) == [6, 11, 12]  # untouched


@pytest.mark.slow
def test_nan_steps_are_skipped_then_the_run_stops_naming_the_last_good_checkpoint(
        reference, cache, tmp_path):
    run_dir = str(tmp_path / "run")
    shutil.copytree(reference, run_dir)  # a used dir: --overwrite starts over there
    proc = run_cli("train", *train_args(run_dir, cache, "--resume=never", "--overwrite",
                                        "--save_every=2", "--max_bad_steps=3",
                                        "--debug_nan_steps=3,4,5", mesh="1,1,1"), check=False)
    assert proc.returncode == 1
    assert "resuming" not in proc.stdout
    for step, streak in ((3, 1), (4, 2), (5, 3)):
        assert f"step {step}: skipped the update (loss nan, grad_norm nan); {streak} bad in a row" \
            in proc.stdout
    assert (f"error: 3 bad steps in a row at step 5 (non-finite or spiking loss); last good "
            f"checkpoint: {run_dir}/checkpoints/2.") in proc.stderr
    assert "Traceback" not in proc.stderr
    assert steps_on_disk(run_dir) == [2]  # A's are gone; no periodic save mid streak (step 4)
    metrics = read_metrics(run_dir)
    assert [r["step"] for r in metrics] == [0, 1, 2, 3, 4, 5]
    assert [r["step"] for r in metrics if r.get("skipped")] == [3, 4, 5]
    assert all(np.isfinite(r["loss"]) for r in metrics[1:3])


@pytest.fixture(scope="module")
def step_parts():
    cfg = train.resolve_config(["--seq_len=16", "--model.num_hidden_layers=1",
                              "--optimizer.warmup_steps=0"])
    model = train.build_model(cfg.model)
    optimizer, schedule = optim.make_optimizer(cfg.optimizer, cfg.steps)
    trainable = lora.trainable_mask(jax.eval_shape(model.init, jax.random.PRNGKey(0),
                                                   np.zeros((1, 16), np.int32))["params"])
    state = train.init_state(jax.random.PRNGKey(0), model=model, optimizer=optimizer, seq_len=16,
                             trainable=trainable)
    tokens = np.random.default_rng(0).integers(0, 256, (4, 17)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "loss_mask": np.ones((4, 16), np.float32)}
    return dict(objective=train.make_objective(cfg, model, trainable), trainable=trainable,
                optimizer=optimizer, schedule=schedule, grad_accum=1), state, batch


def same(a, b):
    return all(np.array_equal(x, y, equal_nan=True) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def jitted_step(step_parts):
    parts, _, _ = step_parts
    return jax.jit(lambda s, b: train.train_step(s, b, **parts, spike_sigma=3.0,
                                                 nan_steps=(1,)))


def test_train_step_skips_a_non_finite_update_and_counts_it(step_parts, jitted_step):
    parts, state, batch = step_parts
    bad, metrics = jitted_step(state, batch)  # step 1 is poisoned
    assert metrics["skipped"] and not np.isfinite(metrics["loss"])
    assert same(bad["params"], state["params"]) and same(bad["opt_state"], state["opt_state"])
    assert int(bad["step"]) == 1 and int(bad["bad_steps"]) == 1 and int(bad["good_steps"]) == 0
    good, metrics = jitted_step(bad, batch)  # step 2 is not
    assert not metrics["skipped"] and np.isfinite(metrics["loss"])
    assert metrics["lr"] == parts["schedule"](0)  # the optimizer's count skipped step 1 too
    assert not same(good["params"], state["params"])
    assert int(good["bad_steps"]) == 0 and int(good["good_steps"]) == 1


def test_spike_guard_skips_a_loss_far_above_the_running_mean(step_parts, jitted_step):
    _, state, batch = step_parts  # (warmed up: 100 good steps, loss 1 +- 0.1 so far)
    warm = {**state, "step": np.int32(5), "good_steps": np.int32(100),
            "loss_var": np.float32(0.01)}
    _, metrics = jitted_step({**warm, "loss_mean": np.float32(1.0)}, batch)  # loss ~6: a spike
    assert metrics["skipped"] and np.isfinite(metrics["loss"]) and int(metrics["bad_steps"]) == 1
    _, metrics = jitted_step({**warm, "loss_mean": np.float32(6.5)}, batch)  # within 3 sigma
    assert not metrics["skipped"]
