"""Eight virtual CPU devices for in-process tests, and a helper to run the CLI for real."""

import os
import subprocess
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_threefry_partitionable", True)

import pytest  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli_env(devices=1, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.update(JAX_NUM_CPU_DEVICES=str(devices), PYTHONPATH=REPO, **extra)
    return env


def run_cli(module, *args, devices=1, timeout=600, check=True, env=None):
    """Run `python -m trainer.<module> args...` in a fresh process; returns CompletedProcess."""
    proc = subprocess.run([sys.executable, "-m", f"trainer.{module}", *args], cwd=REPO,
                          env=env or cli_env(devices), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"trainer.{module} {' '.join(args)} exited {proc.returncode}:\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture
def cli():
    return run_cli
