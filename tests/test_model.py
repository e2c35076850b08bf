"""The model against independent oracles: numpy RoPE, causality, the KV cache, sliding
windows, param counts."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.families import FAMILIES, PRESETS, ModelConfig, RopeScaling
from trainer.generate import generate
from trainer.model import apply_rope, build_model, cross_entropy, init_kv_cache, rope_frequencies


def tiny(**overrides):
    """The tiny preset with some fields changed (derived fields follow them)."""
    fields = {"model_type": "llama", **FAMILIES["llama"].presets["tiny"], **overrides}
    return ModelConfig(**fields)


def init(cfg, seq_len=16, **kw):
    model = build_model(cfg, **kw)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, seq_len), jnp.int32))["params"]
    return model, params


def numpy_rope(x, positions, theta):
    """Rotary embedding as complex multiplication of channel pairs (i, i + d/2)."""
    d = x.shape[-1]
    freqs = np.array([theta ** (-2 * i / d) for i in range(d // 2)])
    z = x[..., : d // 2] + 1j * x[..., d // 2:]
    z = z * np.exp(1j * positions[:, :, None, None] * freqs)
    return np.concatenate([z.real, z.imag], axis=-1)


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rope_matches_numpy(theta):
    cfg = tiny(rope_theta=theta)
    x = np.random.default_rng(0).standard_normal((2, 7, 3, 32)).astype(np.float32)
    positions = np.array([np.arange(7), np.arange(100, 107)])
    ours = apply_rope(jnp.asarray(x), jnp.asarray(positions),
                      rope_frequencies(cfg, "full_attention")[0])
    np.testing.assert_allclose(np.asarray(ours), numpy_rope(x, positions, theta), atol=2e-4)


def test_llama3_rope_scaling_matches_formula():
    cfg = tiny(head_dim=64, rope_theta=500000.0, rope_scaling=RopeScaling(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))
    ours, scale = rope_frequencies(cfg, "full_attention")
    assert scale == 1.0
    for i, base in enumerate(500000.0 ** (-np.arange(0, 64, 2) / 64)):
        wavelength = 2 * math.pi / base
        if wavelength < 64 / 4.0:  # high frequencies: unchanged
            expected = base
        elif wavelength > 64 / 1.0:  # low frequencies: slowed by the factor
            expected = base / 8.0
        else:
            smooth = (64 / wavelength - 1.0) / (4.0 - 1.0)
            expected = (1 - smooth) * base / 8.0 + smooth * base
        assert ours[i] == pytest.approx(expected, rel=1e-5)
    assert ours[0] == pytest.approx(1.0) and ours[-1] < 500000.0 ** (-62 / 64)


def test_causality():
    """Changing token t never changes the logits before t."""
    model, params = init(tiny())
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, 300)
    base = model.apply({"params": params}, tokens)
    for t in (0, 5, 15):
        changed = tokens.at[:, t].set((tokens[:, t] + 7) % 300)
        out = model.apply({"params": params}, changed)
        np.testing.assert_array_equal(np.asarray(out[:, :t]), np.asarray(base[:, :t]))
        assert np.abs(np.asarray(out[:, t:] - base[:, t:])).max() > 1e-4


def test_gqa_equals_repeated_kv_heads():
    """Grouped-query attention equals full multi-head attention with each K/V head repeated."""
    gqa_cfg = tiny(num_attention_heads=4, num_key_value_heads=2)
    model, params = init(gqa_cfg)
    mha_model, _ = init(tiny(num_attention_heads=4, num_key_value_heads=4))
    mha_params = jax.tree.map(lambda x: x, params)
    for i in range(gqa_cfg.num_hidden_layers):
        attn = mha_params[f"layers_{i}"]["self_attn"]
        for name in ("k_proj", "v_proj"):
            kernel = attn[name]["kernel"].reshape(128, 2, 1, 32)
            attn[name]["kernel"] = jnp.repeat(kernel, 2, axis=2).reshape(128, 128)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 12), 0, 300)
    np.testing.assert_allclose(model.apply({"params": params}, tokens),
                               mha_model.apply({"params": mha_params}, tokens), atol=1e-5)


def test_kv_cache_matches_full_forward():
    """Prefill + one-token decode steps through the cache give the full-sequence logits."""
    cfg = tiny()
    model, params = init(cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 10), 0, 300)
    full = model.apply({"params": params}, tokens)
    cache = init_kv_cache(model.cfg, 2, 16)
    logits, cache = model.apply({"params": params}, tokens[:, :6], kv_cache=cache, cache_index=0)
    steps = [logits]
    for t in range(6, 10):
        logits, cache = model.apply({"params": params}, tokens[:, t:t + 1], kv_cache=cache,
                                    cache_index=t)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-5)


def test_batched_greedy_generation_matches_recompute():
    """Left-padded batched KV-cache decoding equals greedy decoding by full recomputation."""
    model, params = init(tiny())
    prompts = [[5, 6, 7, 8, 9, 10], [42, 43]]
    out = generate(model, params, prompts, eos_id=257, pad_id=258, max_new_tokens=8,
                   temperature=0)
    # Right-padding to one fixed length is harmless under a causal mask: one compile.
    forward = jax.jit(lambda tokens: model.apply({"params": params}, tokens))
    for prompt, new in zip(prompts, out):
        seq = list(prompt)
        for _ in range(8):
            logits = forward(jnp.asarray([seq + [0] * (16 - len(seq))]))
            nxt = int(jnp.argmax(logits[0, len(seq) - 1]))
            if nxt == 257:
                break
            seq.append(nxt)
        assert new == seq[len(prompt):]


@pytest.mark.parametrize("name,published", [
    ("llama2_7b", 6.74e9), ("llama3_8b", 8.03e9), ("llama3.2_1b", 1.24e9),
    ("mistral_7b", 7.25e9), ("phi3_mini", 3.82e9), ("qwen2.5_0.5b", 0.494e9), ("qwen3_0.6b", 0.44e9),
    ("gemma3_1b", 1.0e9)])
def test_preset_shapes_have_published_sizes(name, published):
    cfg = PRESETS[name]
    shapes = jax.eval_shape(lambda: build_model(cfg).init(
        jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32)))["params"]
    actual = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    assert actual == cfg.num_params()
    if name == "qwen3_0.6b":  # published as 0.44B without the (tied) embedding
        actual -= cfg.vocab_size * cfg.hidden_size
    assert actual == pytest.approx(published, rel=0.01)


def test_all_presets_listed():
    assert set(PRESETS) >= {"tiny", "llama2_7b", "llama3_8b", "llama3.2_1b", "mistral_7b",
                            "qwen2.5_0.5b", "qwen3_0.6b", "gemma3_1b"}


def test_qwen_bias_and_tied_embeddings():
    cfg = tiny(model_type="qwen2", tie_word_embeddings=True)
    _, params = init(cfg)
    attn = params["layers_0"]["self_attn"]
    assert "bias" in attn["q_proj"] and "bias" not in attn["o_proj"]
    assert "lm_head" not in params


def test_remat_and_bf16():
    """Rematerialisation changes memory, not math; bf16 compute stays close to fp32."""
    cfg = tiny()
    tokens = jax.random.randint(jax.random.PRNGKey(4), (2, 16), 0, 300)

    def loss_and_grad(model, params):
        f = lambda p: cross_entropy(model.apply({"params": p}, tokens[:, :-1]), tokens[:, 1:],
                                    jnp.ones((2, 15)))[0]
        return jax.jit(jax.value_and_grad(f))(params)

    model, params = init(cfg)
    base_loss, base_grads = loss_and_grad(model, params)
    for policy in ("full", "dots_no_batch"):
        loss, grads = loss_and_grad(build_model(cfg, remat=policy), params)
        assert float(loss) == pytest.approx(float(base_loss), rel=1e-6)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(base_grads)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    bf16_loss, _ = loss_and_grad(build_model(cfg, dtype="bfloat16"), params)
    assert float(bf16_loss) == pytest.approx(float(base_loss), rel=2e-2)


SLIDING = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")


def test_sliding_window_limits_what_each_layer_sees():
    """With every layer sliding over W tokens (its own included), token 0 reaches at most
    L*(W-1) positions ahead: the logits after that are exactly unchanged."""
    cfg = tiny(sliding_window=4)  # every layer slides (the llama family's default pattern)
    assert cfg.layer_types == ("sliding_attention",) * 4
    model, params = init(cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(5), (1, 20), 0, 300)
    base = model.apply({"params": params}, tokens)
    out = model.apply({"params": params}, tokens.at[:, 0].set((tokens[0, 0] + 1) % 300))
    reach = cfg.num_hidden_layers * (cfg.sliding_window - 1)  # 12
    np.testing.assert_array_equal(np.asarray(out[:, reach + 1:]), np.asarray(base[:, reach + 1:]))
    assert np.abs(np.asarray(out[:, reach] - base[:, reach])).max() > 1e-6


def test_sliding_window_kv_cache_decoding_matches_full_recompute():
    """Past the window, one-token decoding through the cache equals the full forward pass,
    with sliding and full layers mixed."""
    cfg = tiny(sliding_window=4, layer_types=SLIDING)
    model, params = init(cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(6), (2, 14), 0, 300)
    full = model.apply({"params": params}, tokens)
    cache = init_kv_cache(cfg, 2, 16)
    logits, cache = model.apply({"params": params}, tokens[:, :3], kv_cache=cache, cache_index=0)
    steps = [logits]
    for t in range(3, 14):  # the cache grows to 14 > window 4
        logits, cache = model.apply({"params": params}, tokens[:, t:t + 1], kv_cache=cache,
                                    cache_index=t)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-5)
    # ... and batched greedy generation (left padding) equals greedy full recomputation.
    prompts = [[5, 6, 7, 8, 9, 10, 11], [42, 43]]
    out = generate(model, params, prompts, eos_id=257, pad_id=258, max_new_tokens=9,
                   temperature=0)
    forward = jax.jit(lambda t: model.apply({"params": params}, t))
    for prompt, new in zip(prompts, out):
        seq = list(prompt)
        while len(seq) < len(prompt) + 9:
            nxt = int(jnp.argmax(forward(jnp.asarray([seq + [0] * (16 - len(seq))]))[0, len(seq) - 1]))
            if nxt == 257:
                break
            seq.append(nxt)
        assert new == seq[len(prompt):]


def test_gemma_switches_change_the_structure():
    """Gemma's switches add parameters where the paper puts them, (1 + w) norms start at 0."""
    cfg = tiny(model_type="gemma3_text", hidden_act="gelu_pytorch_tanh", sliding_window=4)
    assert cfg.layer_types == ("sliding_attention",) * 4  # 4 layers: Gemma's 6-pattern never
    _, params = init(cfg)
    layer = params["layers_0"]
    assert set(layer) == {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm",
                          "pre_feedforward_layernorm", "post_feedforward_layernorm"}
    assert {"q_norm", "k_norm"} <= set(layer["self_attn"])
    assert float(jnp.abs(layer["input_layernorm"]["scale"]).max()) == 0.0
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params()
