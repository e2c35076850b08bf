"""trainer.eval: perplexity with chat masks against transformers, and lm-eval-harness tasks
through meshlm's adapter (trainer/harness.py) against lm-eval's own `hf` model.

The tasks are local YAML tasks over local JSONL (tests/tasks/; no network): multiple choice,
generate_until and loglikelihood_rolling, on a random tiny HF Llama from tests/tiny_hf.py.
"""

import json
import math
import os
import re
import sys

import numpy as np
import pytest
import torch

from conftest import REPO
from tiny_hf import make_hf_dir, torch_logits
from trainer.generate import buckets

TASKS = os.path.join(REPO, "tests", "tasks")
STOP_ID = 52  # "P" in tiny_hf's BPE vocabulary


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    import transformers
    path = str(tmp_path_factory.mktemp("hf") / "llama")
    make_hf_dir(path, "llama_gqa")  # BPE tokenizer that puts <s> first, context 256
    # Several end tokens, as Llama 3 Instruct's generation_config.json lists them: "P", which
    # these random weights generate, ends a generation too.
    config = transformers.GenerationConfig.from_pretrained(path)
    config.eos_token_id = [config.eos_token_id, STOP_ID]
    config.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    """tests/tasks with absolute data paths (the committed YAMLs name them from the repo root,
    where the README's command runs)."""
    out = tmp_path_factory.mktemp("tasks")
    for name in os.listdir(TASKS):
        text = open(os.path.join(TASKS, name)).read()
        (out / name).write_text(text.replace("tests/tasks/", TASKS + "/"))
    return str(out)


def hf_results(hf_dir, tasks, manager, **kwargs):
    """lm-eval's own `hf` model (transformers on torch CPU) on the tasks: the oracle."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    return lm_eval.simple_evaluate(model=HFLM(pretrained=hf_dir, device="cpu", batch_size=8),
                                   tasks=tasks.split(","), task_manager=manager, **kwargs)


def assert_same_metrics(ours, theirs, rtol=1e-6):
    for task, metrics in theirs["results"].items():
        for key, value in metrics.items():
            if "," in key and isinstance(value, float):
                assert math.isclose(ours["results"][task][key], value, rel_tol=rtol,
                                    abs_tol=1e-9), (task, key)


def test_adapter_matches_lm_eval_hf(hf_dir, tasks_dir):
    """Multiple choice, generate_until and rolling log-likelihood: the same scores and the
    same per-document log-likelihoods / generations as lm-eval's hf model; scoring compiles
    once per length bucket."""
    from trainer import harness, loading
    tasks = "meshlm_choice,meshlm_gen,meshlm_text"
    manager = harness.task_manager(tasks, tasks_dir)
    # Stops these random weights do produce, so cutting at stop strings is compared too.
    until = {"until": ["\n", ".", "t", "l"]}
    model, params, tok = loading.load_model(hf_dir)
    lm = harness.MeshLM(model, params, tok, batch_size=3)  # odd: partial, padded batches
    harness._token_scores.clear_cache()  # count this run's compilations only
    ours = harness.run_tasks(lm, tasks, manager, gen_kwargs=until, log_samples=True)
    theirs = hf_results(hf_dir, tasks, manager, gen_kwargs=until, log_samples=True)

    assert_same_metrics(ours, theirs)
    samples = {t: [(a, b) for a, b in zip(ours["samples"][t], theirs["samples"][t])]
               for t in tasks.split(",")}
    assert [len(s) for s in samples.values()] == [12, 8, 4]
    worst = 0.0
    for a, b in samples["meshlm_choice"]:
        assert a["doc_id"] == b["doc_id"] and len(a["resps"]) == 4
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip(*(
                [r[0] for r in s["resps"]] for s in (a, b))):
            assert abs(ll_a - ll_b) < 1e-4 and greedy_a == greedy_b
            worst = max(worst, abs(ll_a - ll_b))
    print(f"multiple choice: largest log-likelihood difference {worst:.1e}")
    generated = [(a["resps"][0][0], b["resps"][0][0]) for a, b in samples["meshlm_gen"]]
    print("generated:", generated)
    assert all(x == y for x, y in generated)
    assert min(len(x) for x, _ in generated) < 4 < max(len(x) for x, _ in generated)
    assert lm.tok.decode([STOP_ID]) == "P" and STOP_ID in lm.stop_ids
    ended = [x for x, _ in generated if "P" in x]
    assert ended and all(x.endswith("P") for x in ended)  # the extra end token ended them
    for a, b in samples["meshlm_text"]:
        # A document's sum over ~600 tokens, accumulated in float32 by transformers.
        ll_a, ll_b = a["resps"][0][0], b["resps"][0][0]
        assert abs(ll_a - ll_b) <= 1e-6 * abs(ll_b), (ll_a, ll_b)
        print(f"rolling: {ll_a:.4f} vs hf {ll_b:.4f}")
    longest = max(len(lm.tok_encode(json.loads(line)["text"]))
                  for line in open(os.path.join(TASKS, "text.jsonl")))
    assert longest > 2 * lm.max_length  # several rolling windows per document

    # Every scored row fell in a bucket (a power of two, or the context): few compilations.
    assert harness._token_scores._cache_size() <= len(buckets(256))


def test_chat_template_prompts_match_lm_eval_hf(hf_dir, tasks_dir):
    """--apply_chat_template: few-shot turns as a conversation in the tokenizer's template,
    the same prompts and scores as lm-eval's hf model."""
    from trainer import harness, loading
    tasks = "meshlm_choice,meshlm_gen"
    manager = harness.task_manager(tasks, tasks_dir)
    lm = harness.MeshLM(*loading.load_model(hf_dir), batch_size=4)
    kwargs = dict(apply_chat_template=True, num_fewshot=2, limit=4, log_samples=True)
    ours = harness.run_tasks(lm, tasks, manager, **kwargs)
    theirs = hf_results(hf_dir, tasks, manager, **kwargs)
    assert_same_metrics(ours, theirs)
    for task in tasks.split(","):
        for a, b in zip(ours["samples"][task], theirs["samples"][task]):
            assert a["arguments"] == b["arguments"]
            assert "<|im_start|>assistant" in a["arguments"][0][0]
            if task == "meshlm_gen":
                assert a["resps"] == b["resps"]
            else:
                assert np.allclose([r[0][0] for r in a["resps"]], [r[0][0] for r in b["resps"]],
                                   rtol=0, atol=1e-4)


def test_eval_cli_runs_readme_tasks_on_a_checkpoint(hf_dir, tmp_path, cli):
    """The README's lm-eval command on a meshlm checkpoint: lm-eval's table, then a JSON last
    line with the scores lm-eval's hf model gives the HF dir it was converted from."""
    from lm_eval.tasks import TaskManager
    readme = open(os.path.join(REPO, "README.md")).read()
    (command,) = re.findall(r"^python -m trainer\.eval (--checkpoint=\S+ --tasks=.*--include_path"
                            r"=tests/tasks.*)$", readme, re.M)
    ckpt = str(tmp_path / "ckpt")
    cli("convert", f"--input={hf_dir}", f"--output={ckpt}")
    args = [re.sub("^--checkpoint=.*", f"--checkpoint={ckpt}", a) for a in command.split()]
    args += [f"--output_path={tmp_path / 'out'}", "--log_samples"]
    out = cli("eval", *args).stdout.strip().splitlines()
    scores = json.loads(out[-1])
    assert any(line.startswith("|meshlm_choice|") for line in out)
    assert any(line.startswith("|meshlm_gen") for line in out)

    flags = dict(a[2:].split("=", 1) for a in command.split())
    manager = TaskManager(include_path=TASKS, include_defaults=False)
    cwd = os.getcwd()
    os.chdir(REPO)  # the committed task YAMLs name their data from the repo root
    try:
        theirs = hf_results(hf_dir, flags["tasks"], manager, limit=int(flags["limit"]),
                            num_fewshot=int(flags["num_fewshot"]))
    finally:
        os.chdir(cwd)
    assert set(scores) == set(theirs["results"]) == set(flags["tasks"].split(","))
    for task, metrics in theirs["results"].items():
        want = {k: v for k, v in metrics.items() if "," in k}
        assert want.keys() == scores[task].keys()
        for k, v in want.items():
            assert math.isclose(scores[task][k], v, rel_tol=1e-6, abs_tol=1e-9), (task, k)
    samples = [f for f in os.listdir(next((tmp_path / "out").iterdir()))
               if f.startswith("samples_meshlm_choice")]
    assert len(samples) == 1


@pytest.mark.parametrize("argv, message", [
    (["--tasks=no_such_task_xyz"], "--tasks: no task 'no_such_task_xyz' in lm-eval"),
    (["--tasks=meshlm_choice", "--data=x.jsonl"], "--data and --tasks are two modes"),
    (["--tasks=meshlm_choice", "--log_samples"], "pass --output_path=DIR too"),
    (["--tasks=meshlm_choice", "--include_path=/no/such/dir"], "/no/such/dir: no such directory"),
    # Run elsewhere than the repo root, the committed tasks' data paths lead nowhere.
    (["--tasks=meshlm_choice", f"--include_path={TASKS}"],
     "cannot load a task's data: Unable to find"),
])
def test_task_errors_are_one_line(hf_dir, argv, message, tmp_path, monkeypatch):
    from trainer import eval as eval_cli
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        eval_cli.main([f"--checkpoint={hf_dir}", *argv])
    assert str(e.value.code).startswith("error: ") and message in str(e.value.code)
    assert "\n" not in str(e.value.code)


def test_tasks_without_lm_eval_say_how_to_install(hf_dir, monkeypatch):
    from trainer import eval as eval_cli
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    monkeypatch.delitem(sys.modules, "trainer.harness", raising=False)
    monkeypatch.delitem(sys.modules, "lm_eval.utils", raising=False)
    with pytest.raises(SystemExit) as e:
        eval_cli.main([f"--checkpoint={hf_dir}", "--tasks=hellaswag"])
    assert str(e.value.code) == ("error: --tasks needs lm-eval-harness (lm_eval is not "
                                 'installed): pip install -e ".[eval]"')


# ---------------------------------------------------------------- perplexity with masks

# The tiny models' ChatML, with {% generation %} around what an assistant turn learns: its
# content and end token. transformers' assistant mask from it is the oracle's mask.
CHATML_TAGGED = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>"
    "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}{{ '\n' }}"
    "{% endfor %}")
CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "It is 5."}],
    [{"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue, like the sea."}],
    [{"role": "user", "content": "Say something"}, {"role": "assistant", "content": "Something."},
     {"role": "user", "content": "Thanks"}],
]


def test_chat_perplexity_scores_assistant_tokens_only(hf_dir, tmp_path, capsys):
    """eval --format=chat == transformers' loss over the assistant tokens (the mask from
    transformers' own assistant_masks), and differs from the loss over every token."""
    import transformers
    from trainer import eval as eval_cli
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    eval_cli.main([f"--checkpoint={hf_dir}", f"--data={data}", "--format=chat", "--seq_len=128",
                   "--batch_size=2", f"--cache_dir={tmp_path / 'cache'}"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    total, count, every = 0.0, 0, 0.0
    for conv in CONVERSATIONS:
        enc = tok.apply_chat_template(conv, chat_template=CHATML_TAGGED, tokenize=True,
                                      return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = enc["input_ids"], np.asarray(enc["assistant_masks"][1:], bool)
        assert len(ids) <= 129  # one row each
        logp = torch.log_softmax(torch.tensor(torch_logits(model, [ids])[0], dtype=torch.float64),
                                 -1)
        nll = -logp[np.arange(len(ids) - 1), ids[1:]].numpy()  # token t+1 given tokens <= t
        total, count, every = total + nll[mask].sum(), count + mask.sum(), every + nll.mean()
    print(f"chat loss {result['loss']:.6f} vs transformers {total / count:.6f}")
    assert result["tokens"] == count
    assert abs(result["loss"] - total / count) < 1e-5
    assert abs(result["loss"] - every / len(CONVERSATIONS)) > 1e-2  # the mask mattered
