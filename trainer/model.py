"""The decoder of every family in families.py (LLaMA 1-3, Mistral, Qwen2/3, Gemma 3), for
one device, in Flax Linen.

Read it like the paper: token embedding -> N x [RMSNorm -> grouped-query attention with
RoPE -> residual -> RMSNorm -> gated MLP -> residual] -> RMSNorm -> logits. A family's
`Switches` add what sets it apart, each at the one place the paper puts it: q/k norms,
(1 + w) norms, norms after attention and MLP too, scaled embeddings. Each layer is full or
sliding-window attention (`cfg.layer_types`), with its own RoPE. With a LoRA config, the
linear layers it names carry low-rank adapters beside their frozen kernels (`_adapter`).

Shapes: B batch, T query length, S key length, D hidden_size, H query heads,
K key/value heads, G = H // K queries per kv head, Dh head_dim, F intermediate, V vocab.

This file knows nothing about meshes, hosts or files. `constrain` names the logical axes
of an activation and `axis_size` says how many ways one is split; both do nothing
special unless a mesh is set. Parameter names follow Hugging Face
(`layers_3/self_attn/q_proj/kernel`), so the weight map is a rename and a transpose.
"""

import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from trainer import attention
from trainer.families import ACTIVATIONS, ModelConfig
from trainer.sharding import axis_size, constrain

# Every dtype name a flag accepts, once. numpy types: jax, numpy and safetensors all read them.
DTYPES = {"float32": np.float32, "fp32": np.float32, "bfloat16": ml_dtypes.bfloat16,
          "bf16": ml_dtypes.bfloat16, "float16": np.float16, "fp16": np.float16}

# Which intermediates a rematerialised block keeps for the backward pass. "offload" is
# "full" with each block's input (named BLOCK_INPUT in Block) kept in host memory instead
# of the accelerator's; backends without separate host memory (CPU) run it as "full".
BLOCK_INPUT = "block_input"
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[BLOCK_INPUT],
        offload_src="device", offload_dst="pinned_host"),
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


# ------------------------------------------------------------------ RoPE
def rope_frequencies(cfg: ModelConfig, layer_type):
    """(inv_freq [Dh/2] float32, cos/sin scale) of one kind of layer, as HF computes them."""
    theta, scaling = cfg.rope(layer_type)
    dim = cfg.head_dim
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    kind, factor = scaling.rope_type, scaling.factor
    old_len = scaling.original_max_position_embeddings or cfg.max_position_embeddings
    if kind == "linear":  # positions divided by factor
        return (inv_freq / factor).astype(np.float32), 1.0
    if kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between
        # blended smoothly (LLaMA 3.1's recipe for 128k context).
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = np.where(wavelen > low_wavelen, inv_freq / factor,
                            np.where(wavelen < high_wavelen, inv_freq, blended))
        return inv_freq.astype(np.float32), 1.0
    if kind == "yarn":
        # YaRN: dims that turn fewer than beta_slow times over the old context interpolate
        # (inv_freq / factor), dims that turn more than beta_fast times keep their frequency,
        # a linear ramp between; cos/sin are scaled up to keep attention entropy.
        def dim_of(rotations):
            return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
        if scaling.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # no division by zero
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
        return inv_freq.astype(np.float32), yarn_attention_factor(scaling)
    return inv_freq.astype(np.float32), 1.0


def yarn_attention_factor(scaling):
    """YaRN's cos/sin scale: given, DeepSeek's mscale ratio, or 0.1 ln(factor) + 1."""
    if scaling.attention_factor is not None:
        return scaling.attention_factor

    def mscale(factor, m=1.0):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor,
                                                               scaling.mscale_all_dim)
    return mscale(scaling.factor)


def apply_rope(x, positions, inv_freq, scale=1.0):
    """Rotate channel pairs (i, i + Dh/2) of x [B, T, heads, Dh] by positions [B, T] * inv_freq."""
    angles = positions[:, :, None].astype(jnp.float32) * inv_freq  # [B, T, Dh/2]
    cos = (jnp.cos(angles) * scale)[:, :, None, :]  # [B, T, 1, Dh/2]
    sin = (jnp.sin(angles) * scale)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


# ------------------------------------------------------------------ layers
class RMSNorm(nn.Module):
    eps: float
    plus_one: bool  # Gemma: scale by (1 + w) in float32, w starting at 0
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
        scale = self.param("scale", init, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.plus_one:
            return (x32 * (1.0 + scale.astype(jnp.float32))).astype(self.dtype)
        return scale.astype(self.dtype) * x32.astype(self.dtype)


@jax.custom_vjp
def project(x, w):
    """x [..., D] times w [D, *out] -> [..., *out]: a linear layer's matmul. Products
    accumulate in float32 whatever the inputs (on CPU, bf16 inputs with a float32 result
    also run about twice as fast as a bf16 result)."""
    return jnp.tensordot(x, w, axes=1, preferred_element_type=jnp.float32).astype(x.dtype)


def _project_fwd(x, w):
    return project(x, w), (x, w)


def _project_bwd(residuals, g):
    # Spelled out because XLA's CPU matmuls would otherwise copy the large [tokens, out]
    # gradient into a transposed layout for the weight gradient; transposing the input
    # x instead (D, the smaller side) makes the step about 15% faster on CPU.
    x, w = residuals
    out_dims = tuple(range(1, w.ndim))
    dx = jnp.tensordot(g, w, axes=(tuple(range(g.ndim - len(out_dims), g.ndim)), out_dims),
                       preferred_element_type=jnp.float32)
    x2 = x.reshape(-1, x.shape[-1])
    # (No float32 result here: XLA CPU runs this transposed product on its generic dot,
    # which has no bf16 x bf16 -> f32 kernel.)
    dw = jnp.tensordot(x2.T, g.reshape(x2.shape[0], *w.shape[1:]), axes=1)
    return dx.astype(x.dtype), dw.astype(w.dtype)


project.defvjp(_project_fwd, _project_bwd)


def _linear_params(module, in_features, features, use_bias, param_dtype):
    """A linear layer's parameters, as HF names them: `kernel` [in, out], optional `bias`."""
    kernel = module.param("kernel", nn.initializers.normal(0.02), (in_features, features),
                          param_dtype)
    bias = (module.param("bias", nn.initializers.zeros, (features,), param_dtype)
            if use_bias else None)
    return kernel, bias


def _adapter(module, in_features, features, lora, param_dtype):
    """LoRA's A [in, r] and B [r, out] beside this layer's kernel, when --lora.targets names
    the kernel's path; else None. A starts random and B at zero (as in the paper and peft),
    so an adapted model starts exactly as its base."""
    path = "/".join(module.scope.path) + "/kernel"
    if lora is None or not lora.rank or not re.search(lora.targets, path):
        return None
    a = module.param("lora_a", nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform"),
                     (in_features, lora.rank), param_dtype)  # peft's kaiming_uniform(a=sqrt 5)
    b = module.param("lora_b", nn.initializers.zeros, (lora.rank, features), param_dtype)
    return a, b


def _adapter_output(module, x, adapter, lora, dtype):
    """LoRA's low-rank update of a layer's output: dropout(x) A B * alpha / r. Dropout only
    when the caller passes a 'dropout' rng (the train step does; evaluation doesn't)."""
    a, b = adapter
    if lora.dropout and module.has_rng("dropout"):
        keep = jax.random.bernoulli(module.make_rng("dropout"), 1 - lora.dropout, x.shape)
        x = jnp.where(keep, x / (1 - lora.dropout), 0).astype(x.dtype)
    return project(project(x, a.astype(dtype)), b.astype(dtype)) * (lora.alpha / lora.rank)


class Dense(nn.Module):
    features: int
    use_bias: bool
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    lora: object = None  # config.LoraConfig: rank, alpha, dropout, targets

    @nn.compact
    def __call__(self, x):
        kernel, bias = _linear_params(self, x.shape[-1], self.features, self.use_bias,
                                      self.param_dtype)
        adapter = _adapter(self, x.shape[-1], self.features, self.lora, self.param_dtype)
        x = x.astype(self.dtype)
        y = project(x, kernel.astype(self.dtype))
        if adapter is not None:
            y = y + _adapter_output(self, x, adapter, self.lora, self.dtype)
        return y if bias is None else y + bias.astype(self.dtype)


class LinearParams(nn.Module):
    """A linear layer's parameters, not applied: MLP stacks gate and up into one matmul.
    Returns (kernel, bias, adapter); bias and adapter may be None."""
    features: int
    use_bias: bool
    param_dtype: jnp.dtype
    lora: object = None

    @nn.compact
    def __call__(self, in_features):
        return (*_linear_params(self, in_features, self.features, self.use_bias,
                                self.param_dtype),
                _adapter(self, in_features, self.features, self.lora, self.param_dtype))


def _dense(features, use_bias, dtype, param_dtype, name, lora=None):
    return Dense(features, use_bias, dtype, param_dtype, lora, name=name)


def _norm(cfg, dtype, param_dtype, name):
    return RMSNorm(cfg.rms_norm_eps, cfg.switches.norm_plus_one, dtype, param_dtype, name=name)


def kv_repeats(num_kv_heads, tp):
    """How many copies of each kv head make their count divisible by tp (MaxText-style
    replication when tp exceeds the kv heads): lcm(K, tp) / K."""
    return math.lcm(num_kv_heads, tp) // num_kv_heads


def _cache_write(cache, x, index):
    """Write x [B, T, K, Dh] into cache [B, S, K, Dh] at slot `index`: one int for every
    row, or [B] ints, each row at its own slot (continuous batching)."""
    x = x.astype(cache.dtype)
    if jnp.ndim(index) == 0:
        return jax.lax.dynamic_update_slice(cache, x, (0, index, 0, 0))
    return jax.vmap(lambda c, r, i: jax.lax.dynamic_update_slice(c, r, (i, 0, 0)))(
        cache, x, index)


class Attention(nn.Module):
    cfg: ModelConfig
    layer_type: str  # "full_attention" | "sliding_attention"
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    attention_impl: str = "auto"  # one of attention.IMPLEMENTATIONS
    lora: object = None

    @nn.compact
    def __call__(self, x, positions, q_slots, segment_ids=None, key_mask=None, kv_cache=None,
                 cache_index=None):
        cfg, switches = self.cfg, self.cfg.switches
        B, T, _ = x.shape
        H, K, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv_bias = switches.qkv_bias or cfg.attention_bias
        dense = lambda n, name, bias: _dense(n, bias, self.dtype, self.param_dtype, name,  # noqa
                                             self.lora)

        q = dense(H * Dh, "q_proj", qkv_bias)(x).reshape(B, T, H, Dh)
        k = dense(K * Dh, "k_proj", qkv_bias)(x).reshape(B, T, K, Dh)
        v = dense(K * Dh, "v_proj", qkv_bias)(x).reshape(B, T, K, Dh)
        if switches.qk_norm:  # per head, over Dh
            q = _norm(cfg, self.dtype, self.param_dtype, "q_norm")(q)
            k = _norm(cfg, self.dtype, self.param_dtype, "k_norm")(k)

        inv_freq, scale = rope_frequencies(cfg, self.layer_type)
        q = apply_rope(q, positions, inv_freq, scale)
        k = apply_rope(k, positions, inv_freq, scale)

        new_cache = None
        if kv_cache is not None:
            # Decoding: write this chunk's keys/values at cache_index, attend over the cache.
            k, v = (_cache_write(kv_cache[n], x, cache_index) for n, x in (("k", k), ("v", v)))
            new_cache = {"k": k, "v": v}

        # tp splits whole heads. When it exceeds the kv heads, each kv head is repeated so
        # that every tp shard holds the one its queries read; without a mesh, r = 1.
        r = kv_repeats(K, axis_size("heads"))
        if r > 1:
            k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)  # [B, S, K*r, Dh]
        q = constrain(q, ("batch", "seq", "heads", None))
        k = constrain(k, ("batch", "seq", "heads", None))
        v = constrain(v, ("batch", "seq", "heads", None))

        scale = 1.0 / math.sqrt(cfg.query_pre_attn_scalar or Dh)
        window = cfg.sliding_window if self.layer_type == "sliding_attention" else None
        if kv_cache is None:
            out = attention.self_attention(q, k, v, scale=scale, window=window,
                                           segment_ids=segment_ids,
                                           implementation=self.attention_impl)
        else:
            out = attention.cached_attention(q, k, v, scale=scale, q_slots=q_slots,
                                             window=window, key_mask=key_mask)
        out = constrain(out.reshape(B, T, H, Dh), ("batch", "seq", "heads", None))
        out = dense(cfg.hidden_size, "o_proj", cfg.attention_bias)(out.reshape(B, T, H * Dh))
        return out, new_cache


class MLP(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    lora: object = None

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        F = cfg.intermediate_size
        (wg, bg, ag), (wu, bu, au) = (
            LinearParams(F, cfg.mlp_bias, self.param_dtype, self.lora, name=name)(x.shape[-1])
            for name in ("gate_proj", "up_proj"))
        x = x.astype(self.dtype)
        # Gate and up in one matmul: their kernels stacked, [D, 2, F] (F stays split over tp).
        gate_up = project(x, jnp.stack([wg, wu], axis=1).astype(self.dtype))
        if cfg.mlp_bias:
            gate_up = gate_up + jnp.stack([bg, bu]).astype(self.dtype)
        gate, up = gate_up[..., 0, :], gate_up[..., 1, :]  # [B, T, F] each
        if ag is not None:
            gate = gate + _adapter_output(self, x, ag, self.lora, self.dtype)
        if au is not None:
            up = up + _adapter_output(self, x, au, self.lora, self.dtype)
        hidden = ACTIVATIONS[cfg.hidden_act](gate) * up  # gated: SwiGLU or GeGLU, [B, T, F]
        hidden = constrain(hidden, ("batch", "seq", "mlp"))
        return _dense(cfg.hidden_size, cfg.mlp_bias, self.dtype, self.param_dtype,
                      "down_proj", self.lora)(hidden)


class Block(nn.Module):
    cfg: ModelConfig
    layer_type: str
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    attention_impl: str = "auto"
    lora: object = None

    @nn.compact
    def __call__(self, x, positions, q_slots, segment_ids=None, key_mask=None, kv_cache=None,
                 cache_index=None):
        # Named inside the rematerialised function: the backward pass then recomputes from
        # this copy, which an offload policy may place in host memory, not from x itself.
        x = checkpoint_name(x, BLOCK_INPUT)
        norm = lambda name: _norm(self.cfg, self.dtype, self.param_dtype, name)  # noqa: E731
        sandwich = self.cfg.switches.sandwich_norms  # Gemma: the branch output is normed too
        h, new_cache = Attention(self.cfg, self.layer_type, self.dtype, self.param_dtype,
                                 self.attention_impl, self.lora, name="self_attn")(
            norm("input_layernorm")(x), positions, q_slots, segment_ids, key_mask, kv_cache,
            cache_index)
        if sandwich:
            h = norm("post_attention_layernorm")(h)
        x = x + h
        h = norm("pre_feedforward_layernorm" if sandwich else "post_attention_layernorm")(x)
        h = MLP(self.cfg, self.dtype, self.param_dtype, self.lora, name="mlp")(h)
        if sandwich:
            h = norm("post_feedforward_layernorm")(h)
        x = x + h
        return constrain(x, ("batch", "seq", "embed")), new_cache


class Transformer(nn.Module):
    """tokens [B, T] -> logits [B, T, V] (float32); with targets and loss_mask [B, T],
    the summed loss and target count instead (chunked_cross_entropy), per row with per_row.

    segment_ids [B, T] (packed rows): tokens attend only within their own segment.
    For decoding, pass kv_cache (one {'k', 'v'} of [B, S, K, Dh] per layer, from
    `init_kv_cache`) and cache_index (where these T tokens go: one int, or [B] ints when
    each row is at its own place); it returns the updated cache as well. key_mask [B, S]
    marks cache slots that hold real tokens.
    """

    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    remat: str = "none"
    attention_impl: str = "auto"  # one of attention.IMPLEMENTATIONS
    loss_chunk: int = 0  # sequence positions per loss chunk (0: no chunks)
    lora: object = None  # config.LoraConfig: adapters on the layers --lora.targets names
    scan_layers: bool = False

    def _scanned_blocks(self, x, positions, q_slots, segment_ids):
        """The layers as one lax.scan, for training. Unrolled, XLA may gather every layer's
        weights and hold every layer's full-size gradients at once; in a loop it can only
        work on one layer at a time, so the step's memory follows one layer plus the block
        inputs that remat keeps. Layers repeat with a period (Gemma: five sliding, one
        full); the scan runs over whole periods, and leftover layers run after it."""
        cfg, n = self.cfg, self.cfg.num_hidden_layers
        period = layer_period(cfg.layer_types)
        params = [self.variables["params"][f"layers_{i}"] for i in range(n)]
        rngs = (list(jax.random.split(self.make_rng("dropout"), n))
                if self.has_rng("dropout") else [None] * n)
        blocks = [Block(cfg, layer_type, self.dtype, self.param_dtype, self.attention_impl,
                        self.lora, parent=None) for layer_type in cfg.layer_types[:period]]

        def layer(block, x, layer_params, rng):
            return block.apply({"params": layer_params}, x, positions, q_slots, segment_ids,
                               rngs={} if rng is None else {"dropout": rng})[0]
        if self.remat != "none":
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[self.remat], static_argnums=0,
                                   prevent_cse=False)

        def one_period(x, period_params):
            for block, (layer_params, rng) in zip(blocks, period_params):
                x = layer(block, x, layer_params, rng)
            return x, None

        scanned = n // period * period
        stacked = [jax.tree.map(lambda *leaves: jnp.stack(leaves),
                                *[(params[i], rngs[i]) for i in range(j, scanned, period)])
                   for j in range(period)]
        x, _ = jax.lax.scan(one_period, x, stacked)
        for i in range(scanned, n):
            x = layer(blocks[i % period], x, params[i], rngs[i])
        return x

    @nn.compact
    def __call__(self, tokens, positions=None, segment_ids=None, kv_cache=None, cache_index=0,
                 key_mask=None, targets=None, loss_mask=None, per_row=False):
        cfg = self.cfg
        B, T = tokens.shape
        q_slots = jnp.arange(T) + jnp.asarray(cache_index)[..., None]  # [T], or [B, T]
        if positions is None:
            positions = jnp.broadcast_to(q_slots, (B, T))

        embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype,
                         param_dtype=self.param_dtype,
                         embedding_init=nn.initializers.normal(0.02), name="embed_tokens")
        # The head scores each device's own rows of the vocab (split over every weight axis),
        # so the whole table and its gradient never sit on one device. The lookup does the
        # same while that moves less than the table would: each device then adds up
        # partial rows for every token of its dp replica ([B/dp, T, D]); with more tokens
        # than vocab rows per tp shard, it gathers the table (split over tp only) instead.
        table = embed.embedding.astype(self.dtype)  # [V, D]
        tokens_per_replica = B // axis_size("replica_batch") * T
        by_rows = tokens_per_replica <= cfg.vocab_size // axis_size("vocab")
        x = jnp.take(constrain(table, ("vocab_rows" if by_rows else "vocab", None)), tokens,
                     axis=0)
        if cfg.switches.scale_embeddings:  # sqrt(D), rounded to the weights' dtype as in HF
            x = x * jnp.asarray(math.sqrt(cfg.hidden_size), self.param_dtype).astype(self.dtype)
        x = constrain(x, ("batch", "seq", "embed"))  # [B, T, D]

        new_cache = []
        if self.scan_layers and kv_cache is None and not self.is_initializing():
            x = self._scanned_blocks(x, positions, q_slots, segment_ids)
        else:
            block_cls = Block
            if self.remat != "none" and kv_cache is None:
                block_cls = nn.remat(Block, policy=REMAT_POLICIES[self.remat])
            for i, layer_type in enumerate(cfg.layer_types):
                layer_cache = kv_cache[i] if kv_cache is not None else None
                x, layer_cache = block_cls(cfg, layer_type, self.dtype, self.param_dtype,
                                           self.attention_impl, self.lora, name=f"layers_{i}")(
                    x, positions, q_slots, segment_ids, key_mask, layer_cache, cache_index)
                new_cache.append(layer_cache)

        x = _norm(cfg, self.dtype, self.param_dtype, "norm")(x)
        if cfg.tie_word_embeddings:
            head = constrain(table, ("vocab_rows", None)).T  # [D, V]
        else:
            head, _, _ = LinearParams(cfg.vocab_size, False, self.param_dtype, name="lm_head")(
                cfg.hidden_size)
            head = constrain(head.astype(self.dtype), (None, "vocab_rows"))

        def logits_of(h):  # [B, C, D] -> [B, C, V] float32
            h = constrain(h, ("replica_batch", "seq", "embed"))
            logits = project(h, head).astype(jnp.float32)
            if cfg.final_logit_softcapping:  # Gemma: squash logits smoothly into (-cap, cap)
                cap = cfg.final_logit_softcapping
                logits = jnp.tanh(logits / cap) * cap
            return constrain(logits, ("replica_batch", "seq", "vocab_rows"))

        if targets is not None:
            return chunked_cross_entropy(logits_of, x, targets, loss_mask, self.loss_chunk,
                                         per_row)
        if kv_cache is not None:
            return logits_of(x), new_cache
        return logits_of(x)


def layer_period(layer_types):
    """The shortest p such that the layer types repeat every p layers (1: all alike)."""
    n = len(layer_types)
    return next(p for p in range(1, n + 1)
                if all(layer_types[i] == layer_types[i % p] for i in range(n)))


def chunked_cross_entropy(logits_of, x, targets, mask, chunk, per_row=False):
    """cross_entropy over sequence chunks of `chunk` positions, each chunk's logits made,
    used and dropped in turn (and made again in the backward pass), so that the full
    [B, T, V] logits never exist: at a 128k vocab they are the largest activation.
    per_row: sums per row ([B] each; DPO scores whole sequences), not over the batch."""
    B, T, _ = x.shape
    loss_of = row_cross_entropy if per_row else cross_entropy
    if not chunk or chunk >= T:
        return loss_of(logits_of(x), targets, mask)
    if T % chunk:
        raise ValueError(f"loss chunk {chunk} must divide the sequence length {T}")

    @jax.checkpoint
    def chunk_loss(carry, part):
        h, t, m = part
        loss, count = loss_of(logits_of(h), t, m)
        return (carry[0] + loss, carry[1] + count), None

    split = lambda a: a.reshape(B, T // chunk, chunk, *a.shape[2:]).swapaxes(0, 1)  # noqa: E731
    zero = jnp.zeros((B,) if per_row else (), jnp.float32)
    (loss, count), _ = jax.lax.scan(chunk_loss, (zero, zero),
                                    (split(x), split(targets), split(mask)))
    return loss, count


def loss_chunk_for(batch_size, seq_len, vocab_size, budget=2 ** 24):
    """Sequence positions per loss chunk: whole rows while the batch's logits stay within
    `budget` entries (64 MB in float32), else the largest divisor of seq_len that does."""
    if batch_size * seq_len * vocab_size <= budget:
        return seq_len
    fits = max(1, budget // (batch_size * vocab_size))
    return max(d for d in range(1, min(fits, seq_len) + 1) if seq_len % d == 0)


def build_model(model_cfg: ModelConfig, dtype="float32", param_dtype="float32", remat="none",
                attention_impl="auto", loss_chunk=0, lora=None, scan_layers=False):
    """The Transformer for a model config, computing in `dtype`, storing `param_dtype`;
    lora (config.LoraConfig with rank > 0) adds adapters."""
    return Transformer(model_cfg, dtype=DTYPES[dtype], param_dtype=DTYPES[param_dtype],
                       remat=remat, attention_impl=attention_impl, loss_chunk=loss_chunk,
                       lora=lora if lora is not None and lora.rank else None,
                       scan_layers=scan_layers)


def init_kv_cache(cfg: ModelConfig, batch_size, max_len, dtype=jnp.float32):
    shape = (batch_size, max_len, cfg.num_key_value_heads, cfg.head_dim)
    return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
            for _ in range(cfg.num_hidden_layers)]


def batch_loss(model, params, batch, dropout_rng=None, per_row=False):
    """Summed loss and target count of a batch {'inputs', 'targets', 'loss_mask'}, with
    'positions' and 'segment_ids' where rows pack several documents; per_row: [B] each.
    dropout_rng: LoRA dropout's randomness (training only)."""
    return model.apply({"params": params}, batch["inputs"], positions=batch.get("positions"),
                       segment_ids=batch.get("segment_ids"), targets=batch["targets"],
                       loss_mask=batch["loss_mask"], per_row=per_row,
                       rngs={"dropout": dropout_rng} if dropout_rng is not None else {})


def cross_entropy(logits, targets, mask):
    """Summed next-token loss over positions where mask is 1, and how many there were.

    Sums, not means, so that micro-batches and hosts add up to the exact full-batch mean."""
    loss, count = row_cross_entropy(logits, targets, mask)
    return jnp.sum(loss), jnp.sum(count)


def row_cross_entropy(logits, targets, mask):
    """cross_entropy per row: logits [B, T, V] -> (loss sums [B], target counts [B])."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    token_loss = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    mask = mask.astype(jnp.float32)
    return jnp.sum(token_loss * mask, axis=-1), jnp.sum(mask, axis=-1)
