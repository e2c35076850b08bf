"""trainer/plan.py: the compiled memory plan of a train step, checked against the state a
real run allocates, its verdict around the budget, and its command line."""

import json

import jax
import pytest

from conftest import run_cli
from test_sharding import build, per_device_bytes
from trainer import plan


@pytest.mark.parametrize("flags", [(), ("--lora.rank=4", "--lora.base_dtype=bfloat16")])
def test_plan_state_is_what_a_run_holds_and_the_verdict_flips_at_the_total(flags):
    cfg, mesh, trainer = build("1,8,1", "--remat=none", *flags, batch_size=8)
    lines = []
    result = plan.plan(cfg, mesh, out=lines.append)
    with jax.set_mesh(mesh):
        state = trainer.fresh_state()
    assert result["state"] == per_device_bytes(state)
    assert result["state_params"] == per_device_bytes(state["params"])
    assert result["temp"] > 0 and result["total"] > result["state"] + result["temp"] * 0.99
    assert 0.5 < result["analytic_state"] / result["state"] < 1.5
    assert any("largest buffers:" in l for l in lines) and len(result["largest"]) == 5
    assert json.loads(lines[-1])["total"] == result["total"]

    total = result["total"]
    below = plan.plan(cfg, mesh, budget=total - 1, out=lines.append)
    above = plan.plan(cfg, mesh, budget=total + 1, out=lines.append)
    assert not below["fits"] and above["fits"]
    assert any(l.startswith("does not fit") for l in lines)
    assert any(l.startswith("fits:") for l in lines)


def test_remat_auto_is_none_when_the_step_fits_else_full():
    cfg, mesh, _ = build("1,8,1", batch_size=8, seq_len=256)  # --remat=auto
    none = plan.plan(cfg, mesh, budget=2 ** 40, out=lambda line: None)
    lines = []
    tight = plan.plan(cfg, mesh, budget=none["total"] - 1, out=lines.append)
    assert lines[0].startswith("remat: full (--remat=auto; without it the step needs")
    assert "remat full" in lines[1] and tight["total"] < none["total"] and tight["fits"]
    lines = []
    plan.plan(cfg, mesh, out=lines.append)  # no budget on CPU: remat stays off
    assert lines[0] == "remat: none (--remat=auto; this backend has no fixed memory budget)"


def test_plan_command_line(tmp_path):
    args = ["--devices=8", "--mesh=1,8,1", "--batch_size=16", "--model.num_hidden_layers=2",
            "--remat=none", f"--output_dir={tmp_path}/run"]
    proc = run_cli("plan", *args, "--device_memory=1MiB", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "does not fit" in proc.stdout and "--remat=full" in proc.stdout
    assert "--remat=offload: as full, with the block inputs in host memory" in proc.stdout
    assert "--grad_accum=2" in proc.stdout  # two rows per device: halve them
    assert not json.loads(proc.stdout.strip().splitlines()[-1])["fits"]
    proc = run_cli("plan", *args, "--device_memory=64GiB")
    assert "fits:" in proc.stdout
    assert not (tmp_path / "run").exists()  # a plan writes nothing
    for bad, message in [("--device_memory=lots", "--device_memory: expected a size"),
                         ("--devices=0", "--devices: expected a positive number"),
                         ("--mesh=1,3,1", "--mesh=1,3,1")]:
        proc = run_cli("plan", *args, bad, check=False)
        assert proc.returncode == 1 and message in proc.stderr.strip().splitlines()[-1]
        assert "Traceback" not in proc.stderr


def test_parse_bytes():
    assert plan.parse_bytes("16GiB") == 16 * 2 ** 30
    assert plan.parse_bytes("80GB") == 80 * 10 ** 9
    assert plan.parse_bytes("1.5 gib") == int(1.5 * 2 ** 30)
    assert plan.parse_bytes("512") == 512
    assert plan.parse_bytes("12 parsecs") is None and plan.parse_bytes("") is None
