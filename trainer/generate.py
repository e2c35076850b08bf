"""python -m trainer.generate --checkpoint=C --prompt=...: sample text with a KV cache.

Generation is two compiled functions over a KV cache, and loops over them:
- `prefill`: right-padded prompts [B, P] -> the cache and each row's last logits;
- `decode_step`: one token per row, each row at its own cache slot -> cache and logits.
Sampling (greedy at temperature 0, temperature, top-k, top-p, seed) is per row and traced,
so no setting compiles anything new. Prompt lengths and cache sizes are rounded up to a few
`buckets` (powers of two), so a server compiles a bounded number of programs; each
compilation is logged on stderr.

Three loops use them: `generate` (a batch of prompts, to the end), `Engine` (continuous
batching: requests join and leave fixed decode slots between steps; trainer/serve.py puts
HTTP in front of it) and `TextStream` (detokenizing and stop strings, for streaming).
The engine lives here rather than in serve.py because nothing in it is HTTP: the
benchmark and the tests drive it directly, and serve.py stays one concern (the API).

With a mesh (`--mesh=dp,fsdp,tp`), weights are sharded by the training rules
(trainer/sharding.py) and the cache's rows over dp*fsdp and its kv heads over tp.
"""

import functools
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging as absl_logging
from jax.sharding import NamedSharding, PartitionSpec as P

from trainer import loading, sharding
from trainer.config import Dtype
from trainer.errors import UserError
from trainer.flags import ConfigError, flag, parse_or_exit
from trainer.model import init_kv_cache

@dataclass(frozen=True)
class GenerateFlags:
    checkpoint: str = flag("", "meshlm checkpoint (run dir, checkpoints/ or checkpoints/<step>) "
                           "or HF dir")
    prompt: str = flag("", "the prompt; separate several prompts with --prompt_sep to batch them")
    prompt_sep: str = flag("", "split --prompt on this string into a batch of prompts (empty: one)")
    chat: bool = flag(False, "wrap the prompt as a user message in the tokenizer's chat template")
    max_new_tokens: int = flag(128, "tokens to sample after the prompt")
    temperature: float = flag(0.8, "0: greedy")
    top_p: float = flag(0.95, "nucleus sampling: keep the smallest set of tokens with this much "
                        "mass")
    top_k: int = flag(0, "keep only the k most likely tokens (0: off)")
    seed: int = flag(0, "sampling seed")
    stop: str = flag("", "stop each reply before this string (empty: only at EOS)")
    tokenizer: str = flag("", "override the checkpoint's tokenizer")
    dtype: Dtype = flag("float32", "compute dtype")
    mesh: str = flag("", "dp,fsdp,tp over all devices, as in training (-1 takes the rest); "
                     "empty: one device")


# ------------------------------------------------------------------ buckets
def buckets(max_len, smallest=16):
    """The lengths prompts and caches are rounded up to: powers of two, then max_len."""
    out, n = [], smallest
    while n < max_len:
        out.append(n)
        n *= 2
    return out + [max_len]


def bucket(n, max_len):
    """The smallest bucket that holds n (n <= max_len)."""
    return next(b for b in buckets(max_len) if b >= n)


COMPILES = []  # (function, shapes) of every program compiled, in order; tests count them
_SEEN = set()


def _log_compile(name, key, seconds):
    COMPILES.append((name, key))
    print(f"compiled {name} for {key} in {seconds:.1f} s", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ sampling
def sample(logits, temperature, top_k, top_p, keys):
    """logits [B, V] -> token ids [B]. Per row: temperature (0: greedy), top_k (0: off),
    top_p (1: off) and a PRNG key; all traced."""
    V = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def filtered(x):  # top-k, then top-p, over the sorted vocabulary
        ordered = jnp.sort(x, axis=-1)[:, ::-1]  # [B, V], likeliest first
        kth = jnp.take_along_axis(ordered, jnp.clip(top_k - 1, 0, V - 1)[:, None], axis=-1)
        kth = jnp.where(top_k[:, None] > 0, kth, -jnp.inf)
        x = jnp.where(x < kth, -jnp.inf, x)
        ordered = jnp.where(ordered < kth, -jnp.inf, ordered)
        probs = jax.nn.softmax(ordered, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly likelier tokens
        cutoff = jnp.min(jnp.where(mass_before < top_p[:, None], ordered, jnp.inf), axis=-1,
                         keepdims=True)
        return jnp.where((top_p[:, None] < 1.0) & (x < cutoff), -jnp.inf, x)

    def sampled():
        x = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        # The sort costs as much as a tiny model's step: only when some row filters.
        x = jax.lax.cond(jnp.any((top_k > 0) | (top_p < 1.0)), filtered, lambda x: x, x)
        out = jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)
        return jnp.where(temperature > 0, out, greedy)

    return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda: greedy)


@dataclass
class Sampling:
    """Per-row sampling settings as arrays [B]. A row's key for its token number `step` is
    fold_in(fold_in(PRNGKey(seed), stream), step): its own, whatever batch it runs in."""
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    seed: np.ndarray
    stream: np.ndarray
    step: np.ndarray

    @classmethod
    def rows(cls, n, temperature=0.0, top_k=0, top_p=1.0, seed=0, stream=None):
        full = lambda v, dt: np.full(n, v, dt)  # noqa: E731
        return cls(full(temperature, np.float32), full(top_k, np.int32), full(top_p, np.float32),
                   full(seed, np.uint32),
                   np.arange(n, dtype=np.int32) if stream is None else full(stream, np.int32),
                   full(0, np.int32))

    def set_row(self, i, other, j):
        for name in vars(self):
            getattr(self, name)[i] = getattr(other, name)[j]

    def arrays(self):
        return tuple(vars(self).values())


def _sample_rows(logits, temperature, top_k, top_p, seed, stream, step, greedy=False):
    if greedy:  # every row greedy, known before compiling: argmax only, a smaller program
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    keys = jax.vmap(lambda s, r, t: jax.random.fold_in(
        jax.random.fold_in(jax.random.PRNGKey(s), r), t))(seed, stream, step)
    return sample(logits, temperature, top_k, top_p, keys)


# ------------------------------------------------------------------ prefill and decode
@functools.partial(jax.jit, static_argnames=("model", "cache_len"))
def prefill(model, params, tokens, lengths, cache_len):
    """tokens [B, P] right-padded prompts of `lengths` [B] -> (cache of cache_len slots
    holding them, logits [B, V] after each prompt's last token). Padding writes cache
    slots past a prompt's end; decoding overwrites each before any query can see it."""
    B, _ = tokens.shape
    cache = init_kv_cache(model.cfg, B, cache_len, model.dtype)
    logits, cache = model.apply({"params": params}, tokens, kv_cache=cache, cache_index=0)
    return cache, logits[jnp.arange(B), lengths - 1]


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("cache",))
def decode_step(model, params, cache, tokens, index):
    """tokens [B] go to cache slots index [B] (each row its own) -> (cache, logits [B, V])."""
    logits, cache = model.apply({"params": params}, tokens[:, None], kv_cache=cache,
                                cache_index=index)
    return cache, logits[:, -1]


@functools.partial(jax.jit, static_argnames=("model", "cache_len", "greedy"))
def _prefill_sample(model, params, tokens, lengths, sampling, cache_len, greedy=False):
    cache, logits = prefill(model, params, tokens, lengths, cache_len)
    return cache, _sample_rows(logits, *sampling, greedy=greedy)


@functools.partial(jax.jit, static_argnames=("model", "greedy"), donate_argnames=("cache",))
def _decode_sample(model, params, cache, tokens, index, sampling, greedy=False):
    cache, logits = decode_step(model, params, cache, tokens, index)
    return cache, _sample_rows(logits, *sampling, greedy=greedy)


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("cache",))
def _prefill_into(model, params, cache, tokens, lengths, slots, sampling):
    """Prefill rows and write them into the engine's cache at rows `slots` (a slot out of
    range, for padding rows, writes nothing) -> (cache, first sampled tokens)."""
    rows, first = _prefill_sample(model, params, tokens, lengths, sampling, tokens.shape[1])
    cache = [{n: c[n].at[slots, :tokens.shape[1]].set(r[n], mode="drop") for n in c}
             for c, r in zip(cache, rows)]
    return cache, first


class Compiled:
    """Calls to one jitted function, logging the first call of each shape (a compilation)."""

    def __init__(self, name, fn, model, mesh):
        self.name, self.fn, self.model, self.mesh = name, fn, model, mesh

    def __call__(self, key, *args, **kwargs):
        start = time.perf_counter()
        with jax.set_mesh(self.mesh):
            out = self.fn(self.model, *args, **kwargs)
        seen = (self.name, self.model, self.mesh, key)
        if seen not in _SEEN:
            jax.block_until_ready(out)
            _SEEN.add(seen)
            _log_compile(self.name, key, time.perf_counter() - start)
        return out


def one_device_mesh():
    return sharding.make_mesh("1,1,1", devices=jax.devices()[:1])


def mesh_from_flag(text, model_cfg):
    """--mesh: empty for one device, else dp,fsdp,tp over every device."""
    return sharding.make_mesh(text, model_cfg) if text else one_device_mesh()


def batch_rows(mesh):
    """How many ways the batch is split: rows come in multiples of this."""
    return mesh.shape["dp"] * mesh.shape["fsdp"]


def cache_sharding(mesh, model_cfg, rows):
    """Cache [rows, S, K, Dh]: rows over dp*fsdp, kv heads over tp where they divide."""
    batch = sharding.BATCH_AXES if rows % batch_rows(mesh) == 0 else None
    heads = "tp" if model_cfg.num_key_value_heads % mesh.shape["tp"] == 0 else None
    return NamedSharding(mesh, P(batch, None, heads, None))


def _check_prompts(prompts, max_new_tokens, max_len):
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("--prompt: every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens={max_new_tokens} must be at least 1")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > max_len:
        raise ConfigError(f"prompt ({longest} tokens) + --max_new_tokens={max_new_tokens} "
                          f"exceeds the model's context of {max_len} tokens")


def generate(model, params, prompts, eos_id, pad_id, max_new_tokens=128, temperature=0.8,
             top_p=0.95, top_k=0, seed=0, mesh=None, stop_ids=()):
    """prompts: lists of token ids -> lists of new token ids (cut at EOS or a stop id).
    Row i samples with seed `seed`, stream i. mesh: the one params are sharded on."""
    max_len = model.cfg.max_position_embeddings
    _check_prompts(prompts, max_new_tokens, max_len)
    mesh = mesh or one_device_mesh()
    n = len(prompts)
    rows = -(-n // batch_rows(mesh)) * batch_rows(mesh)
    P_ = bucket(max(len(p) for p in prompts), max_len)
    S = bucket(max(len(p) for p in prompts) + max_new_tokens, max_len)
    tokens = np.full((rows, P_), pad_id, np.int32)
    lengths = np.ones(rows, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)], lengths[i] = p, len(p)
    s = Sampling.rows(rows, temperature, top_k, top_p, seed)
    stops = {eos_id, *stop_ids}
    prefill_ = Compiled("prefill", _prefill_sample, model, mesh)
    decode_ = Compiled("decode_step", _decode_sample, model, mesh)
    greedy = temperature == 0
    cache, token = prefill_((rows, P_, S, greedy), params, tokens, lengths, s.arrays(),
                            cache_len=S, greedy=greedy)
    out = [[] for _ in range(n)]
    done = np.zeros(n, bool)
    for i in range(max_new_tokens):
        host = np.asarray(token)
        for r in range(n):
            if not done[r]:
                if host[r] in stops:
                    done[r] = True
                else:
                    out[r].append(int(host[r]))
        if done.all() or i + 1 == max_new_tokens:
            break
        s.step[:] = i + 1
        cache, token = decode_((rows, S, greedy), params, cache, token, lengths + i,
                               s.arrays(), greedy=greedy)
    return out


# ------------------------------------------------------------------ text
def cut_at_stops(text, stops):
    """The text before the first occurrence of any (non-empty) stop string."""
    return text[:min([text.find(s) for s in stops if s and s in text], default=len(text))]


class TextStream:
    """Token ids in, text out as it becomes final: held back while it may still be the
    start of a stop string or of an unfinished UTF-8 character. `stopped` turns True when
    a stop string appears; the text ends before it."""

    def __init__(self, tokenizer, stop=()):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.ids, self.sent, self.stopped = [], "", False

    def add(self, token):
        """-> the new final text (maybe empty)."""
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids)
        hits = [text.find(s) for s in self.stop if s in text]
        if hits:
            self.stopped = True
            return self._send(text[:min(hits)])
        hold = max([k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])],
                   default=0)
        text = text[:len(text) - hold]
        return self._send(text.rstrip("\ufffd"))

    def finish(self):
        """-> the text held back, at the end of generation (no stop string came)."""
        return "" if self.stopped else self._send(self.tokenizer.decode(self.ids))

    def text(self):
        """The whole reply, decoded at once and cut before the first stop string."""
        text = self.tokenizer.decode(self.ids)
        return cut_at_stops(text, self.stop)

    def _send(self, text):
        if not text.startswith(self.sent):  # a later token changed earlier text: wait
            return ""
        new, self.sent = text[len(self.sent):], text
        return new


# ------------------------------------------------------------------ continuous batching
class QueueFull(Exception):
    """The engine's request queue is full; try again later."""


class Request:
    """One sequence to generate. The engine calls `emit` with each new token id, then once
    with the finish reason: "stop" (a stop id), "length" (max_new_tokens), "cancelled", or
    "error: ...". By default events go to `events`, a queue; iterate for the tokens."""

    def __init__(self, prompt, max_new_tokens, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                 stream=0, stop_ids=(), emit=None):
        self.prompt, self.max_new_tokens = list(prompt), max_new_tokens
        self.sampling = Sampling.rows(1, temperature, top_k, top_p, seed, stream)
        self.stop_ids = set(stop_ids)
        self.events = queue.Queue()
        self.emit = emit or self.events.put
        self.cancelled, self.finish_reason, self.generated = False, None, 0

    def cancel(self):
        """Stop generating (the client went away, or a stop string came); the slot frees
        at the next step."""
        self.cancelled = True

    def __iter__(self):
        while True:
            event = self.events.get()
            if isinstance(event, str):
                self.finish_reason = event
                return
            yield event


class Engine:
    """Continuous batching over `slots` decode rows, in a background thread.

    Each step: waiting requests are prefilled into free slots (a few rows at a time, one
    prompt bucket per call), then one decode step advances every slot. A finished request
    frees its slot at once. The cache has max_len slots per row; rows and cache never
    change shape, so the engine compiles one decode step and one prefill per prompt
    bucket, and a request's tokens do not depend on what else runs beside it."""

    def __init__(self, model, params, slots=8, max_len=0, mesh=None, max_queue=64):
        self.model, self.params = model, params
        self.mesh = mesh or one_device_mesh()
        self.max_len = min(max_len or model.cfg.max_position_embeddings,
                           model.cfg.max_position_embeddings)
        self.group = batch_rows(self.mesh)
        if slots < 1 or slots % self.group:
            raise ConfigError(f"--slots={slots} must be a positive multiple of dp*fsdp = "
                              f"{self.group}")
        self.slots, self.max_queue = slots, max_queue
        self.cache = jax.jit(lambda: init_kv_cache(model.cfg, slots, self.max_len, model.dtype),
                             out_shardings=cache_sharding(self.mesh, model.cfg, slots))()
        self._prefill = Compiled("prefill", _prefill_into, model, self.mesh)
        self._decode = Compiled("decode_step", _decode_sample, model, self.mesh)
        self.active = [None] * slots  # the Request in each slot
        self.tokens = np.zeros(slots, np.int32)  # each slot's next input token
        self.index = np.zeros(slots, np.int32)  # ... and the cache slot it goes to
        self.sampling = Sampling.rows(slots)
        self.pending = []
        self.lock = threading.Condition()
        self.steps = 0  # decode steps run (the benchmark reads it)
        # Test aid: seconds to wait after each step, so that a browser can watch a tiny
        # model's tokens arrive one by one (tests/test_serve.py).
        self.step_delay = float(os.environ.get("MESHLM_DEBUG_STEP_SECONDS", "0"))
        threading.Thread(target=self._loop, daemon=True, name="meshlm-engine").start()

    def submit(self, *requests):
        """Queue requests, all or none; raises QueueFull when they would make more than
        max_queue wait, and ConfigError when one can't fit the context."""
        for r in requests:
            _check_prompts([r.prompt], r.max_new_tokens, self.max_len)
        with self.lock:
            if len(self.pending) + len(requests) > self.max_queue:
                raise QueueFull(f"the server is busy: {len(self.pending)} requests already "
                                f"wait for a decode slot (the limit is {self.max_queue}); "
                                "retry shortly")
            self.pending.extend(requests)
            self.lock.notify()
        return requests[0] if len(requests) == 1 else requests

    def load(self):
        """(requests decoding, requests waiting)."""
        with self.lock:
            return sum(r is not None for r in self.active), len(self.pending)

    def _loop(self):
        while True:
            with self.lock:
                while not self.pending and not any(self.active):
                    self.lock.wait()
            try:
                self._admit()
                if any(self.active):
                    self._step()
            except Exception as e:  # noqa: BLE001 -- fail the requests, keep serving
                reason = "error: " + " ".join(str(e).split())[:300]
                with self.lock:
                    failed, self.pending = self.pending, []
                for slot, r in enumerate(self.active):
                    if r is not None:
                        self._finish(slot, reason)
                for r in failed:
                    r.emit(reason)

    def _admit(self):
        """Prefill waiting requests into free slots, `group` rows per call."""
        while True:
            free = [i for i, r in enumerate(self.active) if r is None]
            with self.lock:
                self.pending = [r for r in self.pending if not self._dropped(r)]
                if not free or not self.pending:
                    return
                size = bucket(len(self.pending[0].prompt), self.max_len)
                batch = [r for r in self.pending
                         if bucket(len(r.prompt), self.max_len) == size][:min(len(free),
                                                                              self.group)]
                self.pending = [r for r in self.pending if r not in batch]
            tokens = np.zeros((self.group, size), np.int32)
            lengths = np.ones(self.group, np.int32)
            slots = np.full(self.group, self.slots, np.int32)  # out of range: written nowhere
            s = Sampling.rows(self.group)
            for row, r in enumerate(batch):
                tokens[row, :len(r.prompt)], lengths[row], slots[row] = r.prompt, len(
                    r.prompt), free[row]
                s.set_row(row, r.sampling, 0)
            try:
                self.cache, first = self._prefill((self.group, size), self.params, self.cache,
                                                  tokens, lengths, slots, s.arrays())
                first = np.asarray(first)
            except Exception:  # neither waiting nor in a slot: fail them here
                for r in batch:
                    r.emit("error: prefill failed")
                raise
            for row, r in enumerate(batch):
                slot = free[row]
                self.active[slot] = r
                self.sampling.set_row(slot, r.sampling, 0)
                self.index[slot] = len(r.prompt)
                self._take(slot, first[row])

    def _step(self):
        self.sampling.step[:] = [r.generated if r else 0 for r in self.active]
        self.cache, out = self._decode((self.slots, self.max_len), self.params, self.cache,
                                       self.tokens, self.index, self.sampling.arrays())
        out = np.asarray(out)
        self.steps += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        for slot, r in enumerate(self.active):
            if r is not None:
                self.index[slot] += 1
                self._take(slot, out[slot])

    def _take(self, slot, token):
        """A slot's newly sampled token: emit it, or finish the request."""
        r = self.active[slot]
        r.generated += 1
        if r.cancelled:
            return self._finish(slot, "cancelled")
        if int(token) in r.stop_ids:
            return self._finish(slot, "stop")
        r.emit(int(token))
        self.tokens[slot] = token
        if r.generated >= r.max_new_tokens:
            self._finish(slot, "length")

    def _finish(self, slot, reason):
        self.active[slot].emit(reason)
        self.active[slot] = None

    @staticmethod
    def _dropped(r):
        if r.cancelled:
            r.emit("cancelled")
        return r.cancelled


# ------------------------------------------------------------------ command line
def main(argv=None):
    absl_logging.set_verbosity(absl_logging.ERROR)  # Orbax's read-only notices
    cfg = parse_or_exit("trainer.generate", GenerateFlags, argv)
    try:
        model_cfg, _ = loading.model_source(cfg.checkpoint, cfg.tokenizer) if cfg.checkpoint \
            else (None, None)
        mesh = mesh_from_flag(cfg.mesh, model_cfg)
        model, params, tokenizer = loading.load_model(cfg.checkpoint, cfg.tokenizer, cfg.dtype,
                                                      mesh=mesh)
        texts = cfg.prompt.split(cfg.prompt_sep) if cfg.prompt_sep else [cfg.prompt]
        if cfg.chat:
            prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}])
                       for t in texts]
        else:
            prompts = tokenizer.encode_texts(texts)
        outputs = generate(model, params, prompts, tokenizer.eos_id, tokenizer.pad_id,
                           cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k, cfg.seed,
                           mesh=mesh, stop_ids=tokenizer.stop_ids)
    except UserError as e:
        sys.exit(f"error: {e}")
    for text, new in zip(texts, outputs):
        reply = tokenizer.decode(new)
        print(text + cut_at_stops(reply, [cfg.stop]))
        if len(outputs) > 1:
            print("-" * 40)


if __name__ == "__main__":
    main()
