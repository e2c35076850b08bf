"""A LLaMA-family decoder (LLaMA 1-3, Mistral, Qwen2) for one device, in Flax Linen.

Read it like the paper: token embedding -> N x [RMSNorm -> grouped-query attention
with RoPE -> residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> logits.

Shapes: B batch, T query length, S key length, D hidden_size, H query heads,
K key/value heads, G = H // K queries per kv head, Dh head_dim, F intermediate, V vocab.

This file knows nothing about meshes, hosts or files. `constrain` names the
logical axes of an activation; it does nothing unless a mesh is set.
Parameter names follow Hugging Face (`layers_3/self_attn/q_proj/kernel`), so the
weight mapping in hf.py is a transpose at most.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ml_collections import FrozenConfigDict

from trainer.sharding import constrain

DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16,
          "bf16": jnp.bfloat16, "float16": jnp.float16, "fp16": jnp.float16}

# Which intermediates a rematerialised block keeps for the backward pass.
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def head_dim(cfg):
    return cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads


def rope_inv_freq(cfg):
    """The RoPE rotation frequency of each channel pair, [Dh/2], with LLaMA-3 scaling."""
    dim = head_dim(cfg)
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = cfg.rope_scaling
    if scaling.rope_type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between
        # blended smoothly (LLaMA 3.1's recipe for 128k context).
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        inv_freq = np.where(wavelen > low_wavelen, inv_freq / scaling.factor,
                            np.where(wavelen < high_wavelen, inv_freq, blended))
    elif scaling.rope_type != "default":
        raise ValueError(f"--model.rope_scaling.rope_type: unsupported '{scaling.rope_type}'; "
                         "use default or llama3")
    return inv_freq.astype(np.float32)


def apply_rope(x, positions, inv_freq):
    """Rotate channel pairs (i, i + Dh/2) of x [B, T, heads, Dh] by positions [B, T] * inv_freq."""
    angles = positions[:, :, None].astype(jnp.float32) * inv_freq  # [B, T, Dh/2]
    cos = jnp.cos(angles)[:, :, None, :]  # [B, T, 1, Dh/2]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale.astype(self.dtype) * x32.astype(self.dtype)


def _dense(features, use_bias, cfg_dtype, param_dtype, name):
    return nn.Dense(features, use_bias=use_bias, dtype=cfg_dtype, param_dtype=param_dtype,
                    kernel_init=nn.initializers.normal(0.02), name=name)


class Attention(nn.Module):
    cfg: object
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, positions, q_slots, k_slots, key_mask=None, kv_cache=None,
                 cache_index=None):
        cfg = self.cfg
        B, T, _ = x.shape
        H, K, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg)
        G = H // K
        qkv_bias = cfg.qkv_bias or cfg.attention_bias

        q = _dense(H * Dh, qkv_bias, self.dtype, self.param_dtype, "q_proj")(x)
        k = _dense(K * Dh, qkv_bias, self.dtype, self.param_dtype, "k_proj")(x)
        v = _dense(K * Dh, qkv_bias, self.dtype, self.param_dtype, "v_proj")(x)
        q = constrain(q.reshape(B, T, H, Dh), ("batch", "seq", "heads", None))
        k = constrain(k.reshape(B, T, K, Dh), ("batch", "seq", "heads", None))
        v = constrain(v.reshape(B, T, K, Dh), ("batch", "seq", "heads", None))

        inv_freq = rope_inv_freq(cfg)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)

        new_cache = None
        if kv_cache is not None:
            # Decoding: write this chunk's keys/values at cache_index, attend over the cache.
            k = jax.lax.dynamic_update_slice(kv_cache["k"], k.astype(kv_cache["k"].dtype),
                                             (0, cache_index, 0, 0))
            v = jax.lax.dynamic_update_slice(kv_cache["v"], v.astype(kv_cache["v"].dtype),
                                             (0, cache_index, 0, 0))
            new_cache = {"k": k, "v": v}

        # Grouped-query attention without copying K/V: queries are grouped per kv head.
        q = q.reshape(B, T, K, G, Dh)
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k.astype(q.dtype),
                            preferred_element_type=jnp.float32) / math.sqrt(Dh)
        mask = k_slots[None, :] <= q_slots[:, None]  # causal, [T, S]
        mask = mask[None, None, None]  # [1, 1, 1, T, S]
        if key_mask is not None:  # padding in a decode cache, [B, S]
            mask = mask & key_mask[:, None, None, None, :]
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(self.dtype))
        out = constrain(out.reshape(B, T, H, Dh), ("batch", "seq", "heads", None))
        out = _dense(cfg.hidden_size, cfg.attention_bias, self.dtype, self.param_dtype,
                     "o_proj")(out.reshape(B, T, H * Dh))
        return out, new_cache


class MLP(nn.Module):
    cfg: object
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        gate = _dense(cfg.intermediate_size, cfg.mlp_bias, self.dtype, self.param_dtype,
                      "gate_proj")(x)
        up = _dense(cfg.intermediate_size, cfg.mlp_bias, self.dtype, self.param_dtype,
                    "up_proj")(x)
        hidden = constrain(nn.silu(gate) * up, ("batch", "seq", "mlp"))  # SwiGLU, [B, T, F]
        return _dense(cfg.hidden_size, cfg.mlp_bias, self.dtype, self.param_dtype,
                      "down_proj")(hidden)


class Block(nn.Module):
    cfg: object
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, positions, q_slots, k_slots, key_mask=None, kv_cache=None,
                 cache_index=None):
        norm = lambda name: RMSNorm(self.cfg.rms_norm_eps, self.dtype, self.param_dtype, name=name)
        attn_out, new_cache = Attention(self.cfg, self.dtype, self.param_dtype, name="self_attn")(
            norm("input_layernorm")(x), positions, q_slots, k_slots, key_mask, kv_cache,
            cache_index)
        x = x + attn_out
        x = x + MLP(self.cfg, self.dtype, self.param_dtype, name="mlp")(
            norm("post_attention_layernorm")(x))
        return constrain(x, ("batch", "seq", "embed")), new_cache


class Transformer(nn.Module):
    """tokens [B, T] -> logits [B, T, V] (float32).

    For decoding, pass kv_cache (one {'k', 'v'} of [B, S, K, Dh] per layer, from
    `init_kv_cache`) and cache_index (where these T tokens go); it returns the
    updated cache as well. key_mask [B, S] marks cache slots that hold real tokens.
    """

    cfg: object
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    remat: str = "none"

    @nn.compact
    def __call__(self, tokens, positions=None, kv_cache=None, cache_index=0, key_mask=None):
        cfg = self.cfg
        B, T = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T) + cache_index, (B, T))
        q_slots = jnp.arange(T) + cache_index
        k_slots = jnp.arange(kv_cache[0]["k"].shape[1]) if kv_cache is not None else q_slots

        embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype,
                         param_dtype=self.param_dtype,
                         embedding_init=nn.initializers.normal(0.02), name="embed_tokens")
        # Look rows up in a table split over vocab only: gathered over fsdp like any FSDP
        # weight, so XLA need not copy the whole [B, T, D] lookup onto every device.
        table = constrain(embed.embedding, ("vocab", None))  # [V, D]
        x = jnp.take(table, tokens, axis=0).astype(self.dtype)
        x = constrain(x, ("batch", "seq", "embed"))  # [B, T, D]

        block_cls = Block
        if self.remat != "none" and kv_cache is None:
            if self.remat not in REMAT_POLICIES:
                raise ValueError(f"--remat: unknown policy '{self.remat}'; choose none, "
                                 + ", ".join(REMAT_POLICIES))
            block_cls = nn.remat(Block, policy=REMAT_POLICIES[self.remat])
        new_cache = []
        for i in range(cfg.num_hidden_layers):
            layer_cache = kv_cache[i] if kv_cache is not None else None
            x, layer_cache = block_cls(cfg, self.dtype, self.param_dtype, name=f"layers_{i}")(
                x, positions, q_slots, k_slots, key_mask, layer_cache, cache_index)
            new_cache.append(layer_cache)

        x = RMSNorm(cfg.rms_norm_eps, self.dtype, self.param_dtype, name="norm")(x)
        if cfg.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = _dense(cfg.vocab_size, False, self.dtype, self.param_dtype, "lm_head")(x)
        logits = constrain(logits.astype(jnp.float32), ("batch", "seq", "vocab"))
        if kv_cache is not None:
            return logits, new_cache
        return logits


def build_model(model_cfg, dtype="float32", param_dtype="float32", remat="none"):
    """The Transformer for a model config (a dict or ConfigDict with HF field names)."""
    return Transformer(FrozenConfigDict(model_cfg), dtype=DTYPES[dtype],
                       param_dtype=DTYPES[param_dtype], remat=remat)


def init_kv_cache(cfg, batch_size, max_len, dtype=jnp.float32):
    shape = (batch_size, max_len, cfg.num_key_value_heads, head_dim(cfg))
    return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
            for _ in range(cfg.num_hidden_layers)]


def count_params(cfg):
    """Parameter count from the config alone (embeddings included)."""
    D, F, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    H, K, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg)
    qkv_bias = cfg.qkv_bias or cfg.attention_bias
    attn = D * H * Dh + 2 * D * K * Dh + H * Dh * D + qkv_bias * (H + 2 * K) * Dh
    attn += cfg.attention_bias * D
    mlp = 3 * D * F + cfg.mlp_bias * (2 * F + D)
    per_layer = attn + mlp + 2 * D
    head = 0 if cfg.tie_word_embeddings else D * V
    return V * D + L * per_layer + D + head


def flops_per_token(cfg, seq_len):
    """Training FLOPs per token (forward + backward = 3x forward), PaLM-style:
    6 x (non-embedding matmul params + lm head) plus causal attention scores."""
    D, L, V = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    H, Dh = cfg.num_attention_heads, head_dim(cfg)
    matmul_params = count_params(cfg) - V * D  # the embedding lookup is no matmul...
    if cfg.tie_word_embeddings:
        matmul_params += V * D  # ...but a tied embedding still does the lm-head matmul
    attention = 2 * 2 * L * H * Dh * seq_len  # QK^T and PV, forward, full (unmasked) square
    return 6 * matmul_params + 3 * attention


def batch_loss(model, params, batch):
    """Summed loss and target count of a batch {'inputs', 'targets', 'loss_mask'}."""
    logits = model.apply({"params": params}, batch["inputs"])
    return cross_entropy(logits, batch["targets"], batch["loss_mask"])


def cross_entropy(logits, targets, mask):
    """Summed next-token loss over positions where mask is 1, and how many there were.

    Sums, not means, so that micro-batches and hosts add up to the exact full-batch mean."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    token_loss = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    mask = mask.astype(jnp.float32)
    return jnp.sum(token_loss * mask), jnp.sum(mask)
