"""The train, eval and generate commands, run for real: README commands, determinism, errors."""

import json
import os
import re
import shlex

import pytest

from conftest import REPO, run_cli
from trainer import config, convert, eval as eval_cli, flags, generate as generate_cli, plan, serve
from trainer import tokenize

COMMANDS = {"train": config.TrainConfig, "eval": eval_cli.EvalFlags,
            "generate": generate_cli.GenerateFlags, "convert": convert.ConvertFlags,
            "serve": serve.ServeFlags, "tokenize": tokenize.TokenizeFlags}

SMALL = ["--seq_len=64", "--batch_size=8", "--model.num_hidden_layers=2", "--eval_batches=2"]


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def readme_commands():
    """Every `python -m trainer.<module> ...` command in the README, as (module, args)."""
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        for match in re.finditer(r"python -m trainer\.(\w+)([^&|`]*)", line):
            commands.append((match.group(1), shlex.split(match.group(2))))
    return commands


def test_readme_opens_with_install_and_test_commands():
    """The first installs the runtime only and trains; the second, in a new shell, activates
    that venv, adds the test extra and runs pytest, exactly as .ci/run does."""
    with open(os.path.join(REPO, "README.md")) as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), re.S)
    first, second = blocks[0].strip(), blocks[1].strip()
    assert "pip install -e . " in first + " " and "[test]" not in first
    assert first.endswith("python -m trainer.train")
    assert second.startswith(". .venv/bin/activate && ") and 'pip install -e ".[test]"' in second
    assert second.endswith("python -m pytest -q")
    with open(os.path.join(REPO, ".ci", "run")) as f:
        assert second in f.read().splitlines()


def test_runtime_dependencies_leave_out_torch():
    """`pip install -e .` must not pull torch (several GB with CUDA): it is a test extra."""
    import importlib.metadata
    requires = importlib.metadata.requires("meshlm")
    runtime = [r for r in requires if "extra ==" not in r]
    assert not [r for r in runtime if r.lower().startswith("torch")], runtime
    assert any(r.startswith("torch") and 'extra == "test"' in r for r in requires)


def test_every_readme_flag_parses():
    commands = readme_commands()
    assert sum(module == "train" for module, _ in commands) >= 3
    for module, args in commands:
        if module == "plan":  # the train flags, plus the plan's own
            own, args = plan.split_plan_flags(args)
            assert set(own) <= set(plan.PLAN_FLAGS) and plan.parse_bytes(own["device_memory"])
            module = "train"
        assert module in COMMANDS, module
        if args != ["--help"]:
            flags.parse(COMMANDS[module], args)  # raises ConfigError on an unknown flag


def enumerated_flags(cls, prefix=""):
    """Every flag of a command whose values are a declared set of choices."""
    import dataclasses
    import typing
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        inner = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        if dataclasses.is_dataclass(inner[0]):
            yield from enumerated_flags(inner[0], f"{prefix}{f.name}.")
        elif flags.choices(tp):
            yield prefix + f.name, flags.choices(tp)


def test_every_enumerated_flag_rejects_a_wrong_value_in_one_line(tmp_path, capsys):
    """A wrong value for any enumerated flag of any command: one line naming the flag and
    its choices, exit status 1, before anything is written."""
    mains = {"train": __import__("trainer.train").train.main, "eval": eval_cli.main,
             "generate": generate_cli.main, "convert": convert.main, "serve": serve.main,
             "tokenize": tokenize.main}
    # The flag naming what a command writes.
    writes = {"train": "output_dir", "convert": "output", "tokenize": "output"}
    checked = set()
    for command, cls in COMMANDS.items():
        for name, allowed in enumerated_flags(cls):
            out = tmp_path / f"{command}-{name}"
            argv = [f"--{name}=nonsense"] + ([f"--{writes[command]}={out}"]
                                              if command in writes else [])
            with pytest.raises(SystemExit) as exit_:
                mains[command](argv)
            message = str(exit_.value.code)
            assert message.startswith(f"error: --{name}: expected one of "), message
            assert "\n" not in message and all(str(c) in message for c in allowed if c)
            assert not out.exists()
            checked.add(f"{command} --{name}")
    # The flags the issue names, among all the others.
    assert {"train --optimizer.name", "train --optimizer.schedule", "train --remat",
            "train --model.rope_scaling.rope_type", "train --model.hidden_act",
            "train --model.layer_types", "train --dtype", "train --data.format",
            "train --resume", "eval --format", "convert --dtype", "serve --dtype"} <= checked
    # And through a real process: exit status 1, one line, no traceback, nothing written.
    proc = run_cli("train", "--optimizer.name=adam", f"--output_dir={tmp_path / 'real'}",
                   check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: --optimizer.name: expected one of adamw, adafactor, sgd, got 'adam'"]
    assert not (tmp_path / "real").exists()


def test_help():
    for module in ("train", "eval", "generate"):
        out = run_cli(module, "--help").stdout
        assert "usage: python -m trainer." + module in out and "--checkpoint" in out or \
            module == "train"
    out = run_cli("train", "--help").stdout
    for flag in ("--mesh", "--data.path", "--optimizer.lr", "--model.num_hidden_layers"):
        assert flag in out


@pytest.mark.slow
def test_readme_quickstart_learns(tmp_path):
    """The README's no-flag run: held-out loss drops by at least 40%, then eval and generate
    work on its checkpoint exactly as the README shows."""
    env_cwd = tmp_path
    from conftest import cli_env
    import subprocess
    import sys

    def run(module, args):
        proc = subprocess.run([sys.executable, "-m", f"trainer.{module}", *args], cwd=env_cwd,
                              env=cli_env(), capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    commands = readme_commands()
    assert commands[0] == ("train", [])
    run("train", [])
    metrics = read_metrics(tmp_path / "runs" / "tiny")
    val = [m["val_loss"] for m in metrics if "val_loss" in m]
    assert metrics[0]["step"] == 0 and metrics[-1]["step"] == 300
    assert val[-1] < 0.6 * val[0], val
    assert (tmp_path / "runs" / "tiny" / "checkpoints" / "300").is_dir()

    for module, args in commands[1:3]:
        out = run(module, args)
        if module == "eval":
            result = json.loads(out.strip().splitlines()[-1])
            assert result["loss"] < 0.6 * val[0] and result["tokens"] > 10000
            assert result["perplexity"] == pytest.approx(2.718281828 ** result["loss"], rel=1e-6)
        else:
            assert out.startswith("The with statement") and len(out) > len("The with statement")


def test_same_command_twice_gives_identical_metrics(tmp_path):
    runs = []
    for name in ("a", "b"):
        run_cli("train", *SMALL, "--steps=8", "--log_every=1", "--eval_every=4",
                f"--output_dir={tmp_path / name}")
        runs.append(read_metrics(tmp_path / name))
    fields = ("step", "loss", "grad_norm", "lr", "val_loss", "tokens")
    strip = lambda rows: [{k: r[k] for k in fields if k in r} for r in rows]
    assert strip(runs[0]) == strip(runs[1])
    assert len(runs[0]) == 9 and runs[0][-1]["loss"] < runs[0][1]["loss"]


def test_eval_and_generate_commands(tmp_path):
    run_cli("train", *SMALL, "--steps=2", f"--output_dir={tmp_path}")
    out = run_cli("eval", f"--checkpoint={tmp_path}", "--seq_len=64", "--max_batches=2").stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result) == {"loss", "perplexity", "tokens"} and result["tokens"] == 2 * 8 * 64
    out = run_cli("generate", f"--checkpoint={tmp_path}/checkpoints/2", "--prompt=ab|cd",
                  "--prompt_sep=|", "--max_new_tokens=5").stdout
    assert out.startswith("ab") and "\ncd" in out


def write(path, text):
    path.write_text(text)
    return str(path)


BAD_INPUTS = {
    "missing data file": (lambda d: ["--data.path=" + str(d / "nope.jsonl")],
                          ["file not found", "nope.jsonl"]),
    "malformed jsonl": (lambda d: ["--data.path=" + write(
        d / "bad.jsonl", '{"text": "a"}\n{"text": "b"}\n{"text": oops}\n')],
        ["bad.jsonl:3", "JSON"]),
    "row without text field": (lambda d: ["--data.path=" + write(
        d / "nofield.jsonl", '{"text": "a"}\n{"body": "b"}\n'), "--data.val_fraction=0"],
        ["nofield.jsonl:2", "--data.text_field"]),
    "unknown preset": (lambda d: ["--model=llama9_70b"], ["unknown preset", "llama3_8b"]),
    "seq_len too long": (lambda d: ["--seq_len=4096"],
                         ["--seq_len=4096", "max_position_embeddings=1024"]),
    "empty corpus": (lambda d: ["--data.path=" + write(d / "empty.txt", ""),
                                "--data.val_fraction=0"], ["empty.txt", "the file is empty"]),
    "non-numeric flag": (lambda d: ["--batch_size=lots"], ["--batch_size", "'lots'"]),
    "attention kernel this machine lacks": (lambda d: ["--attention=cudnn"],
                                            ["--attention=cudnn", "needs a GPU"]),
    "splash on an odd length": (lambda d: ["--attention=splash"], ["--attention=splash"]),
    # Checked before training, not after: the export would lose or refuse these.
    "export drops a Gemma-only field": (lambda d: [
        "--model.final_logit_softcapping=30", f"--export_hf={d / 'hf'}"],
        ["--export_hf", "LlamaForCausalLM has no final_logit_softcapping"]),
    "export config transformers rejects": (lambda d: [
        "--model.model_type=phi3", "--model.rope_scaling.rope_type=linear",
        "--model.rope_scaling.factor=2", f"--export_hf={d / 'hf'}"],
        ["--export_hf", "Phi-3", "rope_type=default"]),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_gives_one_clear_line(tmp_path, case):
    make_args, needles = BAD_INPUTS[case]
    out_dir = tmp_path / "run"
    proc = run_cli("train", *make_args(tmp_path), f"--output_dir={out_dir}",
                   f"--data.cache_dir={tmp_path / 'cache'}", check=False)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr
    assert lines[-1].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[-1], lines[-1]
    assert not out_dir.exists()  # nothing written


def test_async_loop_gives_the_same_metrics_and_the_compile_cache_serves_a_rerun(tmp_path):
    """The asynchronous loop (prefetch, metrics fetched on logging steps only) logs exactly
    what waiting on every step logs; the second run compiles nothing new (every program
    comes from the persistent cache, which the first run filled)."""
    cache = tmp_path / "xla"
    common = [*SMALL, "--steps=6", "--log_every=2", "--eval_every=4",
              f"--compile_cache={cache}"]
    run_cli("train", *common, f"--output_dir={tmp_path / 'async'}")
    entries = sorted(p.name for p in cache.iterdir())
    assert entries  # the first run wrote its compiled programs
    run_cli("train", *common, "--async_loop=false", f"--output_dir={tmp_path / 'sync'}")
    assert sorted(p.name for p in cache.iterdir()) == entries  # nothing compiled anew
    fields = ("step", "loss", "grad_norm", "lr", "val_loss", "tokens")
    a, b = (read_metrics(tmp_path / name) for name in ("async", "sync"))
    assert [{k: r.get(k) for k in fields} for r in a] == [{k: r.get(k) for k in fields} for r in b]
    assert [r["step"] for r in a] == [0, 2, 4, 6]
    assert [r["step"] for r in a if "val_loss" in r] == [0, 4, 6]


def test_device_benchmark_runs_here_as_a_smoke_test():
    """bench/bench_device.py (scripts/bench_device.sh on a GPU) on the CPU, tiny: it runs
    and reports what it measured."""
    import subprocess
    import sys
    from conftest import cli_env
    proc = subprocess.run([sys.executable, "bench/bench_device.py", "--model=tiny",
                           "--seq_len=64", "--batch_size=2", "--dtype=float32"], cwd=REPO,
                          env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["attention"] == "blockwise" and result["tokens_per_s"] > 0
    assert result["params"] == 885888 and result["loss"] > 0


def test_bad_steps_between_logging_steps_are_each_reported_and_stop_the_run(tmp_path):
    """Metrics stay on the device until a logging step; then every step since the last
    log is read, so a streak of bad steps inside the window still stops the run."""
    proc = run_cli("train", *SMALL, "--steps=8", "--log_every=5", "--max_bad_steps=3",
                   "--debug_nan_steps=2,3,4", f"--output_dir={tmp_path / 'run'}", check=False)
    assert proc.returncode == 1, proc.stderr
    for step, streak in ((2, 1), (3, 2), (4, 3)):
        assert f"step {step}: skipped the update (loss nan, grad_norm nan); {streak} bad in a " \
               "row" in proc.stdout
    assert "error: 3 bad steps in a row at step 4 " in proc.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 5]
