"""trainer/dpo.py: DPO's loss and implicit rewards against numpy, log 2 at the start, and a
policy that learns to prefer the chosen responses (in process and from the command line)."""

import json
import math

import jax
import numpy as np
import pytest

from conftest import run_cli
from test_sharding import build
from trainer import dpo, lora
from trainer.model import build_model

T = 32  # tokens per sequence
PROMPT = 12  # the prompt's tokens; the rest of each sequence is the response


def pair_batch(seed, batch_size=16):
    """[B, 2, T] pairs: one random prompt per row, then a chosen response that repeats a
    fixed pattern and a random rejected one; the loss mask covers the responses."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (batch_size, 2, T + 1), np.int32)
    tokens[:, 1, :PROMPT] = tokens[:, 0, :PROMPT]
    tokens[:, 0, PROMPT:] = (np.arange(T + 1 - PROMPT) * 7) % 50 + 97
    mask = np.zeros((batch_size, 2, T), np.float32)
    mask[:, :, PROMPT - 1:] = 1  # targets t+1 >= PROMPT are response tokens
    mask[0, 1, -5:] = 0  # a shorter rejected response
    return {"inputs": tokens[..., :-1], "targets": tokens[..., 1:], "loss_mask": mask}


def numpy_dpo(model, policy, reference, batch, beta):
    """The DPO loss and rewards from per-token log-probabilities, in numpy float64."""
    def logp(params):
        rows = batch["inputs"].reshape(-1, T)
        logits = np.asarray(model.apply({"params": params}, rows), np.float64)
        logits -= logits.max(-1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        token = np.take_along_axis(log_probs, batch["targets"].reshape(-1, T)[..., None], -1)
        return (token[..., 0] * batch["loss_mask"].reshape(-1, T)).sum(-1).reshape(-1, 2)
    rewards = beta * (logp(policy) - logp(reference))
    margin = rewards[:, 0] - rewards[:, 1]
    return {"loss": np.mean(np.log1p(np.exp(-margin))), "reward_accuracy": np.mean(margin > 0),
            "reward_margin": margin.mean(), "chosen_reward": rewards[:, 0].mean(),
            "rejected_reward": rewards[:, 1].mean()}


@pytest.mark.parametrize("flags", [(), ("--lora.rank=4",)])
def test_dpo_starts_at_log2_then_matches_numpy_and_prefers_the_chosen(flags):
    cfg, mesh, trainer = build("1,1,1", "--data.format=preference", "--dpo.beta=0.5",
                               "--optimizer.lr=3e-3", "--optimizer.warmup_steps=0", *flags,
                               seq_len=T)
    assert ("ref_params" in trainer.abstract_state) == (not cfg.lora.rank)
    with jax.set_mesh(mesh):
        state = trainer.fresh_state()
        history = []
        for step in range(12):
            state, metrics = trainer.step_fn(state, jax.device_put(pair_batch(step % 3),
                                                                   trainer.batch_sharding))
            history.append(jax.device_get(metrics))
    assert history[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    # (The policy's forward pass is fused with its backward pass, the reference's is not:
    # equal in math, they may round apart by an ulp.)
    assert abs(history[0]["reward_margin"]) < 1e-5
    assert history[-1]["loss"] < 0.5 * math.log(2)
    assert history[-1]["reward_accuracy"] == 1 and history[-1]["reward_margin"] > 0
    assert history[-1]["chosen_reward"] > history[-1]["rejected_reward"]

    # The step's loss and rewards, against numpy from per-token log-probabilities.
    state = jax.device_get(state)
    reference = (lora.adapters_off(state["params"]) if cfg.lora.rank else state["ref_params"])
    batch = pair_batch(7)
    loss_sum, pairs, sums = dpo.dpo_loss(trainer.model, state["params"], reference, batch, 0.5)
    expected = numpy_dpo(trainer.model, state["params"], reference, batch, 0.5)
    assert float(loss_sum / pairs) == pytest.approx(expected["loss"], rel=1e-4)
    for name in dpo.METRICS:
        assert float(sums[name] / pairs) == pytest.approx(expected[name], rel=1e-4, abs=1e-5), name
    if cfg.lora.rank:  # the reference really is the base: the adapters are off
        base = lora.without_adapters(state["params"])
        plain = build_model(cfg.model)
        np.testing.assert_array_equal(
            trainer.model.apply({"params": reference}, batch["inputs"][:, 0]),
            plain.apply({"params": base}, batch["inputs"][:, 0]))


def test_dpo_from_the_command_line_logs_rewards_and_learns(tmp_path):
    rows = []
    for i in range(40):
        question = f"What is {i} plus {i}?"
        rows.append({"prompt": question, "chosen": f"{2 * i}. Glad to help!",
                     "rejected": f"I think it is {i * 3 + 1}, maybe."})
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_cli("train", f"--data.path={path}", "--data.format=preference", "--seq_len=96",
            "--batch_size=8", "--steps=30", "--log_every=5", "--eval_every=15",
            "--model.hidden_size=64", "--model.intermediate_size=128", "--lora.rank=8",
            "--lora.alpha=16", "--optimizer.lr=1e-2", "--dpo.beta=0.2",
            f"--output_dir={tmp_path}/run")
    lines = [json.loads(l) for l in open(f"{tmp_path}/run/metrics.jsonl")]
    logged = [l for l in lines if "loss" in l]
    assert logged[0]["loss"] < math.log(2) + 0.05
    assert logged[-1]["loss"] < logged[0]["loss"] - 0.2
    assert logged[-1]["reward_accuracy"] > 0.8 and logged[-1]["reward_margin"] > 0
    val = [l["val_loss"] for l in lines if "val_loss" in l]
    assert val[0] == pytest.approx(math.log(2), abs=1e-5)  # step 0: policy = reference


def test_dpo_on_a_mesh_with_accumulation_equals_one_device():
    """The [B, 2, T] pairs split over devices and micro-batches: the same losses and
    rewards as one device taking the whole batch at once."""
    def run(mesh_text, *flags):
        _, mesh, trainer = build(mesh_text, "--data.format=preference",
                                 "--model.num_key_value_heads=4", "--optimizer.lr=3e-3",
                                 "--optimizer.warmup_steps=0", *flags, seq_len=T)
        out = []
        with jax.set_mesh(mesh):
            state = trainer.fresh_state()
            for step in range(4):
                state, metrics = trainer.step_fn(state, jax.device_put(pair_batch(step % 2),
                                                                       trainer.batch_sharding))
                out.append({k: float(metrics[k]) for k in ("loss", *dpo.METRICS)})
        return out
    one, many = run("1,1,1"), run("2,2,2", "--grad_accum=2")
    for step, (a, b) in enumerate(zip(one, many)):
        for k in a:
            if k == "reward_accuracy" and step < 3:
                continue  # margins near 0 (at first, all are): which are > 0 is noise
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), (step, k)
