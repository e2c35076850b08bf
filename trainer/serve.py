"""python -m trainer.serve --checkpoint=C: an OpenAI-compatible HTTP API and a chat page.

Endpoints: GET / (chat page), GET /v1/models, POST /v1/completions,
POST /v1/chat/completions. Requests are served one at a time (one model, one
device); it binds 127.0.0.1 unless --host says otherwise.
"""

import json
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from absl import logging as absl_logging

from trainer import loading
from trainer.config import Dtype
from trainer.errors import UserError
from trainer.flags import flag, parse_or_exit
from trainer.generate import generate

@dataclass(frozen=True)
class ServeFlags:
    checkpoint: str = flag("", "meshlm checkpoint (run dir, checkpoints/ or checkpoints/<step>) "
                           "or HF dir")
    host: str = flag("127.0.0.1", "address to bind")
    port: int = flag(8000, "port to bind")
    tokenizer: str = flag("", "override the checkpoint's tokenizer")
    dtype: Dtype = flag("float32", "compute dtype")
    max_new_tokens: int = flag(256, "upper bound on max_tokens per request")


CHAT_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>meshlm chat</title>
<style>body{font-family:sans-serif;max-width:720px;margin:2em auto}#log div{margin:.5em 0;
white-space:pre-wrap}.user{color:#036}.assistant{color:#060}textarea{width:100%}</style></head>
<body><h1>meshlm chat</h1><div id="log"></div><textarea id="box" rows="3"></textarea>
<button id="send">Send</button> temperature <input id="temp" value="0.7" size="4">
<script>
const messages = [];
function show(role, text) {
  const d = document.createElement('div'); d.className = role;
  d.textContent = role + ': ' + text; document.getElementById('log').appendChild(d);
}
document.getElementById('send').onclick = async () => {
  const box = document.getElementById('box'); const text = box.value.trim();
  if (!text) return; box.value = ''; messages.push({role: 'user', content: text}); show('user', text);
  const r = await fetch('/v1/chat/completions', {method: 'POST', headers: {'Content-Type':
    'application/json'}, body: JSON.stringify({messages, max_tokens: 200,
    temperature: parseFloat(document.getElementById('temp').value)})});
  const j = await r.json();
  const reply = j.choices ? j.choices[0].message.content : ('error: ' + j.error.message);
  messages.push({role: 'assistant', content: reply}); show('assistant', reply);
};
</script></body></html>"""


class RequestError(ValueError):
    """A bad request; answered with HTTP 400 and an OpenAI-style error body."""


class Server:
    """The model, its tokenizer, and a lock: requests run one at a time."""

    def __init__(self, model, params, tokenizer, name, max_new_tokens):
        self.model, self.params, self.tokenizer = model, params, tokenizer
        self.name, self.max_new_tokens = name, max_new_tokens
        self.lock = threading.Lock()

    def _sample(self, prompts, body):
        max_tokens = int(body.get("max_tokens", 64))
        if not 1 <= max_tokens <= self.max_new_tokens:
            raise RequestError(f"max_tokens must be between 1 and {self.max_new_tokens}")
        with self.lock:
            outputs = generate(self.model, self.params, prompts, self.tokenizer.eos_id,
                               self.tokenizer.pad_id, max_tokens,
                               float(body.get("temperature", 1.0)), float(body.get("top_p", 1.0)),
                               0, int(body.get("seed", 0)))
        return [(self.tokenizer.decode(o), "stop" if len(o) < max_tokens else "length",
                 len(o)) for o in outputs]

    def completions(self, body):
        prompt = body.get("prompt")
        texts = [prompt] if isinstance(prompt, str) else prompt
        if not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError("'prompt' must be a string or a list of strings")
        prompts = self.tokenizer.encode_texts(texts)
        results = self._sample(prompts, body)
        choices = [{"index": i, "text": text, "finish_reason": reason, "logprobs": None}
                   for i, (text, reason, _) in enumerate(results)]
        return self._response("text_completion", choices, prompts, results)

    def chat(self, body):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role")
                in ("system", "user", "assistant") for m in messages):
            raise RequestError("'messages' must be a list of {role, content} with role "
                               "system, user or assistant")
        prompts = [self.tokenizer.apply_chat_template(messages)]
        results = self._sample(prompts, body)
        choices = [{"index": 0, "message": {"role": "assistant", "content": results[0][0]},
                    "finish_reason": results[0][1]}]
        return self._response("chat.completion", choices, prompts, results)

    def _response(self, kind, choices, prompts, results):
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(n for _, _, n in results)
        return {"id": f"cmpl-{uuid.uuid4().hex[:12]}", "object": kind, "created": int(time.time()),
                "model": self.name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}


def make_handler(server):
    class Handler(BaseHTTPRequestHandler):
        def _send(self, status, payload, content_type="application/json"):
            body = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status, message):
            self._send(status, {"error": {"message": message, "type": "invalid_request_error"}})

        def do_GET(self):
            if self.path == "/":
                self._send(200, CHAT_PAGE, "text/html; charset=utf-8")
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [
                    {"id": server.name, "object": "model", "owned_by": "meshlm"}]})
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self):
            routes = {"/v1/completions": server.completions,
                      "/v1/chat/completions": server.chat}
            if self.path not in routes:
                return self._error(404, f"no route {self.path}")
            try:
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                if not isinstance(body, dict):
                    raise RequestError("the request body must be a JSON object")
                if body.get("stream"):
                    raise RequestError("stream=true is not supported")
                self._send(200, routes[self.path](body))
            except json.JSONDecodeError as e:
                self._error(400, f"the request body is not valid JSON ({e.msg})")
            except (RequestError, UserError, ValueError, TypeError) as e:
                self._error(400, str(e))

        def log_message(self, fmt, *args):  # one short line per request on stderr
            sys.stderr.write(f"{self.address_string()} {fmt % args}\n")

    return Handler


def main(argv=None):
    absl_logging.set_verbosity(absl_logging.ERROR)
    cfg = parse_or_exit("trainer.serve", ServeFlags, argv)
    try:
        model, params, tokenizer = loading.load_model(cfg.checkpoint, cfg.tokenizer, cfg.dtype)
        server = Server(model, params, tokenizer, cfg.checkpoint.rstrip("/"), cfg.max_new_tokens)
        httpd = ThreadingHTTPServer((cfg.host, cfg.port), make_handler(server))
    except UserError as e:
        sys.exit(f"error: {e}")
    except OSError as e:
        sys.exit(f"error: cannot listen on {cfg.host}:{cfg.port} ({e.strerror}); "
                 "pick another --port")
    print(f"serving {cfg.checkpoint} on http://{cfg.host}:{httpd.server_address[1]}/", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
