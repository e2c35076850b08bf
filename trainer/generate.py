"""python -m trainer.generate --checkpoint=C --prompt=...: sample text with a KV cache.

Prompts of different lengths are left-padded into one batch. One forward pass
fills the cache with the prompts (prefill); then each step feeds one token per
row and samples the next: greedy (temperature 0), temperature, top-k, top-p.
"""

import functools
import sys
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging as absl_logging

from trainer import loading
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
    tokenizer: str = flag("", "override the checkpoint's tokenizer")
    dtype: Dtype = flag("float32", "compute dtype")


def sample_token(logits, rng, temperature, top_p, top_k):
    """logits [B, V] -> next token ids [B]."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1)
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly likelier tokens
        cutoff = jnp.min(jnp.where(mass_before < top_p, sorted_logits, jnp.inf), axis=-1,
                         keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1)


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "temperature", "top_p",
                                             "top_k"))
def _generate(model, params, tokens, prompt_lens, rng, eos_id, *, max_new_tokens, temperature,
              top_p, top_k):
    """tokens [B, P] left-padded prompts -> new tokens [B, max_new_tokens] (eos_id after EOS)."""
    B, P = tokens.shape
    total = P + max_new_tokens
    pad = P - prompt_lens  # [B]
    slot = jnp.arange(total)
    key_mask = slot[None, :] >= pad[:, None]  # [B, total]: padding slots are never attended
    positions = jnp.maximum(jnp.arange(P)[None, :] - pad[:, None], 0)
    cache = init_kv_cache(model.cfg, B, total, model.dtype)
    logits, cache = model.apply({"params": params}, tokens, positions=positions, kv_cache=cache,
                                cache_index=0, key_mask=key_mask)

    def step(carry, i):
        cache, last_logits, done, rng = carry
        rng, sub = jax.random.split(rng)
        token = sample_token(last_logits, sub, temperature, top_p, top_k)
        token = jnp.where(done, eos_id, token)
        done = done | (token == eos_id)
        logits, cache = model.apply({"params": params}, token[:, None],
                                    positions=(prompt_lens + i)[:, None], kv_cache=cache,
                                    cache_index=P + i, key_mask=key_mask)
        return (cache, logits[:, -1], done, rng), token

    carry = (cache, logits[:, -1], jnp.zeros(B, bool), rng)
    _, new_tokens = jax.lax.scan(step, carry, jnp.arange(max_new_tokens))
    return new_tokens.T


def generate(model, params, prompts, eos_id, pad_id, max_new_tokens=128, temperature=0.8,
             top_p=0.95, top_k=0, seed=0):
    """prompts: lists of token ids -> lists of new token ids (cut at EOS)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("--prompt: every prompt needs at least one token")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > model.cfg.max_position_embeddings:
        raise ConfigError(
            f"prompt ({longest} tokens) + --max_new_tokens={max_new_tokens} exceeds the model's "
            f"max_position_embeddings={model.cfg.max_position_embeddings}")
    tokens = np.full((len(prompts), longest), pad_id, np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, longest - len(prompt):] = prompt
    out = _generate(model, params, jnp.asarray(tokens),
                    jnp.asarray([len(p) for p in prompts], jnp.int32), jax.random.PRNGKey(seed),
                    eos_id, max_new_tokens=max_new_tokens, temperature=float(temperature),
                    top_p=float(top_p), top_k=int(top_k))
    results = []
    for row in np.asarray(out).tolist():
        results.append(row[:row.index(eos_id)] if eos_id in row else row)
    return results


def main(argv=None):
    absl_logging.set_verbosity(absl_logging.ERROR)  # Orbax's read-only notices
    cfg = parse_or_exit("trainer.generate", GenerateFlags, argv)
    try:
        model, params, tokenizer = loading.load_model(cfg.checkpoint, cfg.tokenizer, cfg.dtype)
        texts = cfg.prompt.split(cfg.prompt_sep) if cfg.prompt_sep else [cfg.prompt]
        if cfg.chat:
            prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}])
                       for t in texts]
        else:
            prompts = tokenizer.encode_texts(texts)
        outputs = generate(model, params, prompts, tokenizer.eos_id, tokenizer.pad_id,
                           cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k, cfg.seed)
    except UserError as e:
        sys.exit(f"error: {e}")
    for text, new in zip(texts, outputs):
        print(text + tokenizer.decode(new))
        if len(outputs) > 1:
            print("-" * 40)


if __name__ == "__main__":
    main()
