"""The HTTP server, started for real on a free loopback port."""

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from conftest import REPO, cli_env, run_cli


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("serve_run")
    run_cli("train", "--steps=2", "--seq_len=32", "--batch_size=8", "--model.num_hidden_layers=1",
            "--eval_batches=1", f"--output_dir={run_dir}")
    proc = subprocess.Popen([sys.executable, "-m", "trainer.serve", f"--checkpoint={run_dir}",
                             "--port=0", "--max_new_tokens=16"], cwd=REPO, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()  # "serving ... on http://127.0.0.1:PORT/"
        assert "http://127.0.0.1:" in line, line
        yield line.split()[-1].rstrip("/")
    finally:
        proc.kill()
        proc.wait(timeout=30)


def call(url, payload=None, raw=None):
    data = raw if raw is not None else (json.dumps(payload).encode() if payload else None)
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            body = response.read().decode()
            return response.status, body
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_completions_and_chat(server):
    status, body = call(server + "/v1/completions",
                        {"prompt": ["ab", "cde"], "max_tokens": 5, "temperature": 0})
    result = json.loads(body)
    assert status == 200 and result["object"] == "text_completion"
    assert len(result["choices"]) == 2 and result["usage"]["prompt_tokens"] == 2 + 3 + 2
    assert all(c["finish_reason"] in ("stop", "length") for c in result["choices"])
    # Greedy decoding is deterministic.
    assert json.loads(call(server + "/v1/completions", {"prompt": ["ab", "cde"], "max_tokens": 5,
                                                        "temperature": 0})[1])["choices"] == \
        result["choices"]

    status, body = call(server + "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    result = json.loads(body)
    assert status == 200 and result["choices"][0]["message"]["role"] == "assistant"


def test_models_page_and_errors(server):
    status, body = call(server + "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["object"] == "model"
    status, body = call(server + "/")
    assert status == 200 and "/v1/chat/completions" in body
    status, body = call(server + "/v1/completions", raw=b"{not json")
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"]
    status, body = call(server + "/v1/chat/completions", {"messages": [{"role": "robot"}]})
    assert status == 400 and "messages" in json.loads(body)["error"]["message"]
    status, body = call(server + "/v1/completions", {"prompt": "a", "max_tokens": 999})
    assert status == 400 and "max_tokens" in json.loads(body)["error"]["message"]
    assert call(server + "/nope")[0] == 404
