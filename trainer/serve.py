"""python -m trainer.serve --checkpoint=C: an OpenAI-compatible HTTP API and a chat page.

FastAPI on uvicorn, bound to 127.0.0.1 unless --host says otherwise. Endpoints:
GET / (the chat page, trainer/chat.html), GET /health, GET /v1/models,
POST /v1/completions and POST /v1/chat/completions (with `stream`, `n`, `stop`, `seed`,
`usage`). Requests run on trainer.generate.Engine: continuous batching over --slots rows.

This module is the HTTP side only: it checks requests (every bad one gets a 4xx with an
OpenAI-style error body), turns them into engine requests and their tokens into
responses or server-sent events. A full queue answers 429 at once.
"""

import asyncio
import contextlib
import json
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Literal, Optional, Union

from absl import logging as absl_logging

from trainer import generate as gen
from trainer import loading
from trainer.config import Dtype
from trainer.errors import UserError
from trainer.flags import flag, parse_or_exit

@dataclass(frozen=True)
class ServeFlags:
    checkpoint: str = flag("", "meshlm checkpoint (run dir, checkpoints/ or checkpoints/<step>) "
                           "or HF dir")
    host: str = flag("127.0.0.1", "address to bind")
    port: int = flag(8000, "port to bind (0: any free port; the first line printed names it)")
    tokenizer: str = flag("", "override the checkpoint's tokenizer")
    dtype: Dtype = flag("float32", "compute dtype")
    mesh: str = flag("", "dp,fsdp,tp over all devices, as in training (-1 takes the rest); "
                     "empty: one device")
    slots: int = flag(8, "decode slots: requests generated at once (continuous batching)")
    max_len: int = flag(2048, "context: prompt + reply tokens per request (at most the model's "
                        "max_position_embeddings); the KV cache holds slots x max_len")
    max_new_tokens: int = flag(512, "upper bound on max_tokens per request")
    max_queue: int = flag(64, "requests that may wait for a slot; more get HTTP 429")
    max_body_bytes: int = flag(1_000_000, "largest request body; larger gets HTTP 413")
    api_key: str = flag("", "require 'Authorization: Bearer KEY' on /v1/* (empty: open)")
    model_name: str = flag("", "the model id the API reports (empty: the checkpoint path)")


# ------------------------------------------------------------------ request bodies
def _schemas():
    """Pydantic models of the two request bodies: unknown fields and wrong types are
    errors (strict: "1" is not a number, true is not an int)."""
    from pydantic import BaseModel, ConfigDict, Field

    class Body(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        model: Optional[str] = None
        max_tokens: Optional[int] = None
        temperature: float = Field(1.0, ge=0.0, le=2.0)
        top_p: float = Field(1.0, gt=0.0, le=1.0)
        top_k: int = Field(0, ge=0)
        n: int = Field(1, ge=1, le=16)
        seed: Optional[int] = Field(None, ge=0, lt=2 ** 32)
        stop: Union[str, list[str], None] = None
        stream: bool = False
        stream_options: Optional[dict[Literal["include_usage"], bool]] = None
        user: Optional[str] = None
        presence_penalty: float = Field(0.0, ge=0.0, le=0.0)  # not supported: 0 only
        frequency_penalty: float = Field(0.0, ge=0.0, le=0.0)
        logit_bias: Optional[dict[str, float]] = Field(None, max_length=0)

    class Completion(Body):
        prompt: Union[str, list[str]]
        echo: Literal[False] = False
        logprobs: Literal[None] = None
        best_of: Optional[Literal[1]] = None
        suffix: Literal[None] = None

    class TextPart(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        type: Literal["text"]
        text: str

    class Message(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        role: Literal["system", "developer", "user", "assistant"]
        content: Union[str, list[TextPart]]  # a string, or text parts (joined)
        name: Optional[str] = None

    class Chat(Body):
        messages: list[Message] = Field(min_length=1)
        max_completion_tokens: Optional[int] = None
        logprobs: Literal[False, None] = None

    return Completion, Chat


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, type, the offending field."""

    def __init__(self, status, message, kind="invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (status, message, kind,
                                                                       param, code)

    def body(self):
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def _validation_message(error):
    """pydantic's first complaint as one line naming the field."""
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "body"
    if first["type"] == "extra_forbidden":
        return f"unknown field '{where}'", where
    if first["type"] == "missing":
        return f"missing required field '{where}'", where
    if first["type"] == "literal_error" and first["loc"][-1] == "role":
        return (f"unknown role {first['input']!r} in '{where}': use system, user or "
                f"assistant", where)
    return f"'{where}': {first['msg']} (got {json.dumps(first.get('input'))[:80]})", where


# ------------------------------------------------------------------ the service
class Service:
    """The engine, the tokenizer and the rules for turning a request into engine work."""

    def __init__(self, engine, tokenizer, name, max_new_tokens, max_body_bytes=1_000_000):
        self.engine, self.tokenizer, self.name = engine, tokenizer, name
        self.max_new_tokens, self.max_body_bytes = max_new_tokens, max_body_bytes
        self.Completion, self.Chat = _schemas()

    def parse(self, raw, chat):
        from pydantic import ValidationError
        try:
            data = json.loads(raw or b"")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({getattr(e, 'msg', e)})")
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        try:
            return (self.Chat if chat else self.Completion).model_validate(data)
        except ValidationError as e:
            message, param = _validation_message(e)
            raise ApiError(400, message, param=param)

    def prompts(self, body, chat):
        if chat:
            messages = [{"role": "system" if m.role == "developer" else m.role,
                         "content": m.content if isinstance(m.content, str)
                         else "".join(part.text for part in m.content)}
                        for m in body.messages]
            return [self.tokenizer.apply_chat_template(messages)]
        texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not texts:
            raise ApiError(400, "'prompt' must not be an empty list", param="prompt")
        return self.tokenizer.encode_texts(texts)

    def requests(self, body, prompts, chat, emit):
        """One engine request per (prompt, choice); emit(choice index, event)."""
        asked = (body.max_completion_tokens if chat and body.max_completion_tokens is not None
                 else body.max_tokens)
        context = self.engine.max_len
        if asked is not None and not 1 <= asked <= self.max_new_tokens:
            raise ApiError(400, f"max_tokens={asked} must be between 1 and "
                           f"{self.max_new_tokens}", param="max_tokens")
        stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        if len(stops) > 4:
            raise ApiError(400, "'stop' takes at most 4 strings", param="stop")
        out = []
        for p, prompt in enumerate(prompts):
            room = context - len(prompt)
            if room < 1:
                raise ApiError(400, f"the prompt is {len(prompt)} tokens, longer than the "
                               f"context of {context} tokens; shorten it", param="messages" if chat
                               else "prompt", code="context_length_exceeded")
            if asked is not None and asked > room:
                raise ApiError(400, f"the prompt ({len(prompt)} tokens) + max_tokens={asked} "
                               f"exceeds the context of {context} tokens; lower max_tokens",
                               param="max_tokens", code="context_length_exceeded")
            max_new = asked if asked is not None else min(self.max_new_tokens, room)
            for c in range(body.n):
                index = p * body.n + c
                out.append(gen.Request(
                    prompt, max_new, body.temperature, body.top_k, body.top_p,
                    seed=body.seed if body.seed is not None else int.from_bytes(os.urandom(3),
                                                                                "little"),
                    stream=c, stop_ids=self.tokenizer.stop_ids,
                    emit=lambda event, i=index: emit(i, event)))
        return out, stops


def build_app(service, api_key=""):
    """The FastAPI application around a Service."""
    from fastapi import FastAPI, Request
    from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="meshlm", docs_url=None, redoc_url=None, openapi_url=None)
    page = open(os.path.join(os.path.dirname(__file__), "chat.html"), encoding="utf-8").read()

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        message = (f"no route {request.method} {request.url.path}" if e.status_code in (404, 405)
                   else str(e.detail))
        return JSONResponse(ApiError(e.status_code, message).body(), status_code=e.status_code)

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                e = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                             kind="authentication_error", code="invalid_api_key")
                return JSONResponse(e.body(), status_code=401)
        return await call_next(request)

    @app.get("/", response_class=HTMLResponse)
    async def chat_page():
        return page

    @app.get("/health")
    async def health():
        active, waiting = service.engine.load()
        return {"status": "ok", "model": service.name, "active": active, "waiting": waiting,
                "slots": service.engine.slots}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.name, "object": "model",
                                            "created": 0, "owned_by": "meshlm"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, chat=True)

    async def _read_body(request):
        limit = service.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"the request body is {declared} bytes; the limit is {limit}")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise ApiError(413, f"the request body is over the limit of {limit} bytes")
        return bytes(raw)

    async def _generate(request, chat):
        body = service.parse(await _read_body(request), chat)
        prompts = service.prompts(body, chat)
        loop = asyncio.get_running_loop()
        events = asyncio.Queue()
        reqs, stops = service.requests(
            body, prompts, chat, lambda i, e: loop.call_soon_threadsafe(events.put_nowait, (i, e)))
        try:
            service.engine.submit(*reqs)
        except gen.QueueFull as e:
            raise ApiError(429, str(e), kind="rate_limit_error", code="queue_full")
        except UserError as e:
            raise ApiError(400, str(e))
        run = Run(service, body, prompts, reqs, stops, events, chat)
        if body.stream:
            return StreamingResponse(run.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        result = await run.complete_unless_gone(request)
        # 499: nginx's "client closed request", for the log; no one reads it.
        return JSONResponse(result) if result is not None else Response(status_code=499)

    return app


class Run:
    """One HTTP request's engine requests, their text streams and their response."""

    def __init__(self, service, body, prompts, reqs, stops, events, chat):
        self.service, self.body, self.reqs, self.events, self.chat = (service, body, reqs,
                                                                      events, chat)
        self.streams = [gen.TextStream(service.tokenizer, stops) for _ in reqs]
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.finish = [None] * len(reqs)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    async def deltas(self):
        """(choice, new text, finish reason or None) as tokens come; ends when all finish."""
        try:
            while None in self.finish:
                i, event = await self.events.get()
                if self.finish[i] is not None:
                    continue  # a choice already ended by a stop string
                stream = self.streams[i]
                if isinstance(event, int):
                    text = stream.add(event)
                    if stream.stopped:
                        self.reqs[i].cancel()
                        self.finish[i] = "stop"
                    yield i, text, self.finish[i]
                elif event.startswith("error"):
                    raise ApiError(500, f"generation failed: {event}", kind="server_error")
                else:
                    self.finish[i] = "stop" if event == "cancelled" else event
                    yield i, stream.finish(), self.finish[i]
        finally:
            for r in self.reqs:  # a client that went away frees its slots
                r.cancel()

    def usage(self):
        completion = sum(len(s.ids) for s in self.streams)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def _envelope(self, choices, chunk=False):
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else \
            "text_completion"
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.service.name, "choices": choices}

    async def complete(self):
        async for _ in self.deltas():
            pass
        texts = [s.text() for s in self.streams]  # not the deltas: streaming is tested on it
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": t},
                        "logprobs": None, "finish_reason": f}
                       for i, (t, f) in enumerate(zip(texts, self.finish))]
        else:
            choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": f}
                       for i, (t, f) in enumerate(zip(texts, self.finish))]
        return {**self._envelope(choices), "usage": self.usage()}

    async def complete_unless_gone(self, request):
        """complete(), or None once the client disconnects first: a plain response only
        notices a gone client when it writes, so without this the slots would run on."""
        async def client_gone():  # the body is read: what comes next is the client leaving
            while (await request.receive())["type"] != "http.disconnect":
                pass
        task, gone = asyncio.ensure_future(self.complete()), asyncio.ensure_future(client_gone())
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            gone.cancel()
            return task.result()
        task.cancel()  # deltas() then cancels the engine requests
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None

    async def sse(self):
        def event(payload):
            return f"data: {json.dumps(payload)}\n\n"
        if self.chat:
            yield event(self._envelope([{"index": i, "delta": {"role": "assistant",
                                                                "content": ""},
                                         "logprobs": None, "finish_reason": None}
                                        for i in range(len(self.reqs))], chunk=True))
        try:
            async for i, text, finish in self.deltas():
                if not text and finish is None:
                    continue
                if self.chat:
                    choice = {"index": i, "delta": {"content": text} if text else {},
                              "logprobs": None, "finish_reason": finish}
                else:
                    choice = {"index": i, "text": text, "logprobs": None, "finish_reason": finish}
                yield event(self._envelope([choice], chunk=True))
        except ApiError as e:
            yield event(e.body())
        else:
            if (self.body.stream_options or {}).get("include_usage"):
                yield event({**self._envelope([], chunk=True), "usage": self.usage()})
        yield "data: [DONE]\n\n"


# ------------------------------------------------------------------ command line
def listen(host, port):
    """A listening socket on host:port (0: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return sock


def main(argv=None):
    absl_logging.set_verbosity(absl_logging.ERROR)
    cfg = parse_or_exit("trainer.serve", ServeFlags, argv)
    try:
        import uvicorn
        sock = listen(cfg.host, cfg.port)  # first: a taken port fails before the model loads
        model_cfg, _ = loading.model_source(cfg.checkpoint, cfg.tokenizer) if cfg.checkpoint \
            else (None, None)
        mesh = gen.mesh_from_flag(cfg.mesh, model_cfg)
        model, params, tokenizer = loading.load_model(cfg.checkpoint, cfg.tokenizer, cfg.dtype,
                                                      mesh=mesh)
        engine = gen.Engine(model, params, cfg.slots, cfg.max_len, mesh, cfg.max_queue)
        service = Service(engine, tokenizer, cfg.model_name or cfg.checkpoint.rstrip("/"),
                          min(cfg.max_new_tokens, engine.max_len - 1), cfg.max_body_bytes)
        warm = gen.Request([tokenizer.eos_id], 2)  # compile decode_step before the first user
        engine.submit(warm)
        list(warm)
    except UserError as e:
        sys.exit(f"error: {e}")
    except OSError as e:
        sys.exit(f"error: cannot listen on {cfg.host}:{cfg.port} ({e.strerror}); "
                 "pick another --port")
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    print(f"serving {cfg.checkpoint} on http://{host}:{sock.getsockname()[1]}/", flush=True)
    server = uvicorn.Server(uvicorn.Config(build_app(service, cfg.api_key), log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=1))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
