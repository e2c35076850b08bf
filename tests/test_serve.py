"""The HTTP server, started for real on a free loopback port, driven the way users' tools
drive it: the official `openai` client, raw HTTP with bad requests and floods, and the
chat page in headless Chromium. Replies are checked against transformers' own greedy
generation on the same random tiny HF Llama."""

import concurrent.futures
import http.client
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch
import transformers

from conftest import REPO, cli_env
from tiny_hf import make_hf_dir

KEY = "test-key"
SLOTS, QUEUE, MAX_NEW, CONTEXT = 4, 20, 64, 128
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
PAGE_MESSAGE = {"role": "user", "content": "Hello there"}  # typed into the chat page


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base URL, torch model, HF tokenizer) of a server on a random tiny HF Llama."""
    root = tmp_path_factory.mktemp("serve")
    path = str(root / "llama")
    torch_model = make_hf_dir(path, "llama_gqa", seed=5)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    # A second end token, as Llama 3 Instruct's generation_config.json lists <|eot_id|>
    # beside EOS: a token that first appears a few tokens into the greedy chat reply (which
    # has no EOS), so that the reply ends there; not one of the chat page's reply, which
    # must stream in several pieces.
    config = torch_model.generation_config
    config.eos_token_id = tok.eos_token_id
    reply = greedy_ids(torch_model, chat_ids(tok, MESSAGES), 20)
    page_reply = greedy_ids(torch_model, chat_ids(tok, [PAGE_MESSAGE]), 12)
    assert len(reply) == 20
    config.eos_token_id = [tok.eos_token_id, next(
        t for i, t in enumerate(reply) if i >= 3 and t not in reply[:i] + page_reply)]
    config.save_pretrained(path)
    log = open(root / "server.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.serve", f"--checkpoint={path}", "--port=0",
         f"--slots={SLOTS}", f"--max_queue={QUEUE}", f"--max_new_tokens={MAX_NEW}",
         f"--max_len={CONTEXT}", "--max_body_bytes=100000", f"--api_key={KEY}",
         "--model_name=tiny"], cwd=REPO, stdout=subprocess.PIPE, stderr=log,
        # 10 ms a decode step: the tiny model's tokens arrive apart, as a real model's do,
        # so that the browser can watch them land one by one.
        env=cli_env(MESHLM_DEBUG_STEP_SECONDS="0.01"),
        text=True)
    try:
        line = proc.stdout.readline()  # "serving ... on http://127.0.0.1:PORT/"
        log.seek(0)
        assert line.startswith("serving ") and "http://127.0.0.1:" in line, line + log.read()
        yield line.split()[-1].rstrip("/"), torch_model, tok
    finally:
        proc.kill()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def chat_ids(tok, messages):
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def greedy_ids(model, ids, new):
    """transformers' greedy continuation of prompt ids, ending at (and without) any end
    token of the model's generation config."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                                                            dtype=torch.long),
                             max_new_tokens=new, do_sample=False, pad_token_id=0)
    new_ids = out[0, len(ids):].tolist()
    ends = model.generation_config.eos_token_id
    ends = ends if isinstance(ends, list) else [ends]
    return next((new_ids[:i] for i, t in enumerate(new_ids) if t in ends), new_ids)


def hf_reply(server, ids, new):
    """transformers' greedy continuation of prompt ids, decoded as the server decodes."""
    _, model, tok = server
    new_ids = greedy_ids(model, ids, new)
    return tok.decode(new_ids, skip_special_tokens=True), len(new_ids)


def call(url, payload=None, raw=None, key=KEY, method=None):
    data = raw if raw is not None else (json.dumps(payload).encode() if payload else None)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def test_openai_client_completions_chat_and_streaming(server, client):
    """Greedy replies equal transformers' greedy generation; streamed text equals the
    non-streamed text; usage, finish_reason, n and stop as OpenAI defines them."""
    _, _, tok = server
    prompt = "The with statement"
    want, count = hf_reply(server, tok(prompt)["input_ids"], 24)
    done = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    assert done.choices[0].text == want
    assert done.choices[0].finish_reason == ("length" if count == 24 else "stop")
    assert done.usage.prompt_tokens == len(tok(prompt)["input_ids"])
    assert done.usage.completion_tokens == count
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24,
                                            temperature=0, stream=True))
    assert len(chunks) > 3  # token by token, not one lump
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].choices[0].finish_reason == done.choices[0].finish_reason

    messages = MESSAGES
    ids = chat_ids(tok, messages)
    want, count = hf_reply(server, ids, 20)
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20,
                                          temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == want
    # It ended at the generation config's second end token, not at max_tokens.
    assert 3 <= count < 20 and chat.usage.completion_tokens == count
    assert chat.choices[0].finish_reason == "stop"
    assert chat.usage.prompt_tokens == len(ids)
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    assert client.chat.completions.create(model="tiny", messages=parts, max_tokens=20,
                                          temperature=0).choices[0].message.content == want
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

    two = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, n=2,
                                         temperature=1.0, seed=3)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].message.content != two.choices[1].message.content
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, n=2,
                                           temperature=1.0, seed=3)
    assert [c.message.content for c in again.choices] == [c.message.content
                                                          for c in two.choices]

    text = done.choices[0].text
    stop = next(text[i:i + 2] for i in range(3, len(text)) if text[i:i + 2].strip())
    cut = client.completions.create(model="tiny", prompt=prompt, max_tokens=24,
                                    temperature=0, stop=[stop])
    assert cut.choices[0].text == text.split(stop)[0]
    assert cut.choices[0].finish_reason == "stop"
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_twenty_concurrent_greedy_requests_each_equal_the_request_alone(server, client):
    prompts = [f"Request number {i}: " + "x" * (i * 3) for i in range(20)]

    def ask(p):
        return client.completions.create(model="tiny", prompt=p, max_tokens=12,
                                         temperature=0).choices[0].text
    alone = [ask(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        together = list(pool.map(ask, prompts))
    assert together == alone
    assert len(set(alone)) > 1
    status, health = call(server[0] + "/health")
    assert status == 200 and health["status"] == "ok" and health["slots"] == SLOTS


def test_bad_requests_get_openai_style_4xx_and_the_server_stays_up(server):
    url, _, tok = server
    completions, chat = url + "/v1/completions", url + "/v1/chat/completions"
    fits = next(t for t in (" ".join(map(str, range(n))) for n in range(200))
                if len(tok(t)["input_ids"]) > CONTEXT - MAX_NEW)  # alone it fits; + 64, not
    cases = [
        (completions, dict(raw=b"{not json"), 400, "not valid JSON"),
        (completions, dict(raw=b"[1, 2]"), 400, "must be a JSON object"),
        (completions, dict(payload={"prompt": "a", "colour": 1}), 400, "unknown field 'colour'"),
        (completions, dict(payload={"prompt": "a", "max_tokens": "5"}), 400, "'max_tokens'"),
        (completions, dict(payload={"prompt": "a", "temperature": "hot"}), 400, "'temperature'"),
        (completions, dict(payload={"prompt": 5}), 400, "'prompt"),
        (completions, dict(payload={"max_tokens": 5}), 400, "missing required field 'prompt'"),
        (completions, dict(payload={"prompt": "a " * 200}), 400, "longer than"),
        (completions, dict(payload={"prompt": "a", "max_tokens": -1}), 400, "max_tokens=-1"),
        (completions, dict(payload={"prompt": "a", "max_tokens": 10**6}), 400,
         "max_tokens=1000000"),
        (completions, dict(payload={"prompt": fits, "max_tokens": MAX_NEW}), 400,
         "exceeds the context"),
        (completions, dict(payload={"prompt": "a", "seed": -1}), 400, "'seed'"),
        (completions, dict(payload={"prompt": "a", "logprobs": 3}), 400, "'logprobs'"),
        (completions, dict(payload={"prompt": "a b c d e f", "max_tokens": MAX_NEW,
                                    "stream": True}), 200, None),
        (chat, dict(payload={"messages": [{"role": "robot", "content": "x"}]}), 400,
         "unknown role 'robot'"),
        (chat, dict(payload={"messages": []}), 400, "'messages'"),
        (chat, dict(payload={"messages": [{"role": "user"}]}), 400, "content"),
        (chat, dict(payload={"messages": [{"role": "user", "content": "x"}]}, key=""), 401,
         "API key"),
        (chat, dict(payload={"messages": [{"role": "user", "content": "x"}]}, key="wrong"), 401,
         "API key"),
        (completions, dict(raw=json.dumps({"prompt": "a" * 200_000}).encode()), 413, "limit"),
        (url + "/v1/nothing", dict(payload={}), 404, "no route"),
    ]
    for target, kwargs, status, message in cases:
        if message is None:  # a streamed reply through raw HTTP: ends with [DONE]
            request = urllib.request.Request(target, data=json.dumps(kwargs["payload"]).encode(),
                                             headers={"Authorization": f"Bearer {KEY}"})
            with urllib.request.urlopen(request, timeout=120) as response:
                text = response.read().decode()
            assert response.status == 200 and text.rstrip().endswith("data: [DONE]")
            continue
        got, body = call(target, **kwargs)
        assert got == status, (kwargs, body)
        error = body["error"]
        assert message in error["message"] and error["type"], (kwargs, error)
    assert call(url + "/health")[0] == 200


def test_a_client_that_hangs_up_frees_its_slot(server):
    """A non-streamed request stops generating when its client disconnects: its slot is free
    again long before the request alone would have finished."""
    url = server[0]
    payload = {"prompt": "Once upon a time", "max_tokens": MAX_NEW, "temperature": 0}
    body = json.dumps(payload).encode()
    host, port = url.split("//")[1].split(":")

    def send():
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        for _ in range(3000):
            if call(url + "/health")[1]["active"]:
                return sock, time.perf_counter()
            time.sleep(0.01)
        raise AssertionError(sock.recv(1 << 20))  # it never started: say why

    def until_idle(start):
        for _ in range(3000):
            if not call(url + "/health")[1]["active"]:
                return time.perf_counter() - start
            time.sleep(0.01)
        raise AssertionError("the slot is still busy after 30 s")

    sock, start = send()
    with sock:
        alone = until_idle(start)
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert json.loads(response.read())["choices"][0]["finish_reason"] == "length"
    sock, start = send()
    sock.close()
    hung_up = until_idle(start)
    assert hung_up < alone / 3, (hung_up, alone)


def test_a_flood_beyond_the_queue_gets_429_not_a_hang(server):
    url = server[0]
    payload = {"prompt": "flood", "max_tokens": 16, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda _: call(url + "/v1/completions", payload), range(64)))
    statuses = [s for s, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) > 0 and statuses.count(200) >= SLOTS
    busy = next(body for s, body in results if s == 429)
    assert "busy" in busy["error"]["message"] and busy["error"]["type"] == "rate_limit_error"
    answers = {body["choices"][0]["text"] for s, body in results if s == 200}
    assert len(answers) == 1  # every accepted one finished, with the one greedy answer
    status, health = call(url + "/health")
    assert status == 200 and health["waiting"] == 0
    assert call(url + "/v1/completions", payload)[0] == 200


def test_chat_page_streams_a_reply_in_headless_chromium(server, client, tmp_path_factory,
                                                         capsys):
    """Open /, type a message, watch the reply stream in, and check it is the API's greedy
    reply; the history survives a reload (it lives in the browser)."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("NOT TESTED IN A BROWSER: Debian's chromium is not installed here "
                    "(apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright
    url = server[0]
    expected = client.chat.completions.create(
        model="tiny", messages=[PAGE_MESSAGE], max_tokens=12,
        temperature=0).choices[0].message.content
    shot = tmp_path_factory.mktemp("browser") / "chat.png"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        try:
            page = browser.new_page()
            outside = []
            page.on("request", lambda r: outside.append(r.url)
                    if not r.url.startswith(url) else None)
            page.goto(url + "/")
            page.fill("#api_key", KEY)
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "12")
            page.evaluate("""() => { window.lengths = new Set();
                new MutationObserver(() => { const a = document.querySelector('.assistant');
                    if (a) window.lengths.add(a.textContent.length); })
                .observe(document.getElementById('log'),
                         {subtree: true, childList: true, characterData: true}); }""")
            page.fill("#box", PAGE_MESSAGE["content"])
            page.keyboard.press("Enter")
            page.wait_for_selector(".assistant")
            page.wait_for_function("() => !document.getElementById('send').disabled",
                                   timeout=60_000)
            reply = page.text_content(".assistant")
            page.screenshot(path=str(shot))
            assert reply == expected and reply
            assert page.evaluate("() => window.lengths.size") >= 4  # it grew piece by piece
            assert not outside  # nothing fetched from anywhere but the server
            page.reload()
            assert page.text_content(".user") == PAGE_MESSAGE["content"]
            assert page.text_content(".assistant") == expected

            # Stop: the reply ends where it was, and the server frees the slot.
            page.fill("#api_key", KEY)
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "40")
            page.fill("#box", "Tell me more")
            page.click("#send")
            try:
                page.wait_for_function("() => document.querySelectorAll('.assistant').length "
                                       "== 2 && document.querySelectorAll('.assistant')[1]"
                                       ".textContent")
            except Exception:
                raise AssertionError(page.inner_text("#log"))
            page.click("#stop")
            page.wait_for_function("() => !document.getElementById('send').disabled")
            partial = page.locator(".assistant").nth(1).text_content()
            full = client.chat.completions.create(model="tiny", max_tokens=40, messages=[
                {"role": "user", "content": "Hello there"},
                {"role": "assistant", "content": expected},
                {"role": "user", "content": "Tell me more"}], temperature=0).choices[0]
            assert partial and full.message.content.startswith(partial)
            assert len(partial) < len(full.message.content)
            for _ in range(100):  # the stopped request's slot is free again
                if call(url + "/health")[1]["active"] == 0:
                    break
                time.sleep(0.1)
            assert call(url + "/health")[1]["active"] == 0
        finally:
            browser.close()
    with capsys.disabled():
        print(f"\nchat page screenshot: {shot}")
