"""Every fast path equals its reference, forward and gradients: the attention kernels
(causal masks, sliding windows, segment ids of packed documents, GQA), the chunked loss,
and layers under scan (bench/bench_layers.py) against unrolled ones."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer import attention, sharding
from trainer.families import FAMILIES, ModelConfig
from trainer.model import build_model, cross_entropy

B, T, D = 2, 300, 16  # T: two full query blocks of 128 and a ragged one


def qkv(heads, kv_heads, seed=0, t=T):
    r = np.random.default_rng(seed)
    return tuple(jnp.asarray(r.standard_normal((B, t, n, D), np.float32))
                 for n in (heads, kv_heads, kv_heads))


def segments(t=T):
    """Three documents in row 0, one in row 1."""
    ids = np.zeros((B, t), np.int32)
    ids[0, 90:] = 1
    ids[0, 200:] = 2
    return jnp.asarray(ids)


def numpy_attention(q, k, v, scale, window, segment_ids):
    """The oracle: loops over queries in float64, seeing only what the mask allows."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    G = q.shape[2] // k.shape[2]
    out = np.zeros_like(q)
    seg = None if segment_ids is None else np.asarray(segment_ids)
    for b in range(q.shape[0]):
        for i in range(q.shape[1]):
            js = [j for j in range(i + 1) if (window is None or i - j < window)
                  and (seg is None or seg[b, j] == seg[b, i])]
            for h in range(q.shape[2]):
                s = np.array([q[b, i, h] @ k[b, j, h // G] for j in js]) * scale
                p = np.exp(s - s.max())
                out[b, i, h] = (p / p.sum()) @ v[b, js, h // G]
    return out


CASES = [(None, False), (50, False), (None, True), (50, True)]


@pytest.mark.parametrize("window,packed", CASES)
def test_reference_matches_numpy(window, packed):
    q, k, v = qkv(4, 2, t=40)
    seg = segments(40)[:, :40] if packed else None
    slots = jnp.arange(40)
    ours = attention.reference(q, k, v, scale=0.25, mask=attention._mask(
        slots, slots, window and 10, seg, seg))
    np.testing.assert_allclose(ours, numpy_attention(q, k, v, 0.25, window and 10, seg),
                               atol=1e-5)


@pytest.mark.parametrize("impl", ["blockwise-64", "blockwise-128", "splash"])
@pytest.mark.parametrize("window,packed", CASES)
def test_fast_paths_equal_the_reference_forward_and_backward(impl, window, packed):
    """GQA (8 query heads on 2 kv heads); the splash kernel runs in Pallas' interpreter."""
    q, k, v = qkv(8, 2, seed=1, t=256 if impl == "splash" else T)
    seg = segments(q.shape[1]) if packed else None
    run = {"blockwise-64": lambda *a: attention._blockwise(*a[:5], 64, a[5]),
           "blockwise-128": lambda *a: attention._blockwise(*a[:5], 128, a[5]),
           "splash": functools.partial(attention._splash, interpret=True)}[impl]
    slots = jnp.arange(q.shape[1])
    mask = attention._mask(slots, slots, window, seg, seg)

    def loss(f, q, k, v):
        return jnp.sum(jnp.sin(f(q, k, v)))  # an uneven cotangent
    fast = lambda q, k, v: run(q, k, v, 0.25, window, seg)  # noqa: E731
    slow = lambda q, k, v: attention.reference(q, k, v, scale=0.25, mask=mask)  # noqa: E731
    np.testing.assert_allclose(fast(q, k, v), slow(q, k, v), atol=2e-6)
    for a, b in zip(jax.grad(functools.partial(loss, fast), argnums=(0, 1, 2))(q, k, v),
                    jax.grad(functools.partial(loss, slow), argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(a, b, atol=2e-5)


def test_splash_runs_per_device_under_a_mesh():
    """On a mesh, splash runs under shard_map on each device's batch rows and heads."""
    q, k, v = qkv(4, 2, seed=2, t=128)
    seg = segments(128)
    slots = jnp.arange(128)
    want = attention.reference(q, k, v, scale=0.25, mask=attention._mask(slots, slots, None,
                                                                         seg, seg))
    mesh = sharding.make_mesh("1,2,2", devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        got = jax.jit(lambda q, k, v, s: attention._splash(q, k, v, 0.25, None, s,
                                                           interpret=True))(q, k, v, seg)
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_auto_picks_by_backend_and_dtype():
    choose = attention.choose
    assert choose("auto", jnp.float32, 2048, 128, "cpu") == "blockwise"
    assert choose("auto", jnp.bfloat16, 2048, 128, "gpu") == "cudnn"
    assert choose("auto", jnp.float32, 2048, 128, "gpu") == "blockwise"  # cuDNN: 16-bit only
    assert choose("auto", jnp.bfloat16, 2048, 128, "tpu") == "splash"
    assert choose("auto", jnp.bfloat16, 2000, 128, "tpu") == "blockwise"  # 128-multiples only
    assert choose("reference", jnp.bfloat16, 2048, 128, "gpu") == "reference"


def test_packed_rows_equal_their_documents_run_alone():
    """Through the whole model: logits of a document packed among others (segment ids,
    positions restarting at 0) equal its logits run alone."""
    cfg = ModelConfig(model_type="llama", **FAMILIES["llama"].presets["tiny"])
    model = build_model(cfg)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    docs = [np.random.default_rng(i).integers(0, 300, n) for i, n in enumerate((70, 150, 36))]
    tokens = jnp.asarray(np.concatenate(docs))[None]
    seg = jnp.asarray(np.concatenate([np.full(len(d), i) for i, d in enumerate(docs)]))[None]
    pos = jnp.asarray(np.concatenate([np.arange(len(d)) for d in docs]))[None]
    packed = model.apply({"params": params}, tokens, positions=pos, segment_ids=seg)
    start = 0
    for d in docs:
        alone = model.apply({"params": params}, jnp.asarray(d)[None])
        np.testing.assert_allclose(packed[:, start:start + len(d)], alone, atol=1e-5)
        start += len(d)

    # Gradients too: the packed row's summed loss is the sum of the documents' own.
    def loss(p, inputs, targets, **row):
        return model.apply({"params": p}, inputs[None], targets=targets[None],
                           loss_mask=jnp.ones((1, len(inputs))), **row)[0]
    joined = lambda parts: jnp.asarray(np.concatenate(parts))[None]  # noqa: E731
    grad = jax.jit(jax.grad(loss))
    packed_grads = grad(params, joined([d[:-1] for d in docs])[0],
                                  joined([d[1:] for d in docs])[0],
                                  positions=joined([np.arange(len(d) - 1) for d in docs]),
                                  segment_ids=joined([np.full(len(d) - 1, i)
                                                      for i, d in enumerate(docs)]))
    alone_grads = [grad(params, jnp.asarray(d[:-1]), jnp.asarray(d[1:]))
                   for d in docs]
    summed = jax.tree.map(lambda *g: sum(g), *alone_grads)
    for a, b in zip(jax.tree.leaves(packed_grads), jax.tree.leaves(summed)):
        np.testing.assert_allclose(a, b, atol=2e-5)


# ------------------------------------------------------------------ chunked loss
def test_chunked_loss_equals_the_full_one_and_so_do_its_gradients():
    cfg = ModelConfig(model_type="gemma3_text", vocab_size=1000, hidden_size=64,
                      intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, final_logit_softcapping=30.0,
                      tie_word_embeddings=True)
    tokens = np.random.default_rng(0).integers(0, 1000, (2, 65)).astype(np.int32)
    mask = (np.random.default_rng(1).random((2, 64)) > 0.3).astype(np.float32)
    full, chunked = build_model(cfg), build_model(cfg, loss_chunk=16)
    params = full.init(jax.random.PRNGKey(0), tokens[:, :8])["params"]

    def loss(model, p):
        s, n = model.apply({"params": p}, tokens[:, :-1], targets=tokens[:, 1:], loss_mask=mask)
        return s / n
    reference = lambda p: cross_entropy(full.apply({"params": p}, tokens[:, :-1]),  # noqa: E731
                                        tokens[:, 1:], mask)[0] / mask.sum()
    (a, ga), (b, gb), (c, gc) = (jax.value_and_grad(f)(params) for f in (
        functools.partial(loss, full), functools.partial(loss, chunked), reference))
    assert abs(float(a) - float(c)) < 1e-6 and abs(float(b) - float(c)) < 1e-6
    for x, y in zip(jax.tree.leaves(gb), jax.tree.leaves(gc)):
        np.testing.assert_allclose(x, y, atol=1e-6)


def test_chunked_loss_halves_the_step_memory_at_a_128k_vocab():
    """The compiled train step's temporaries at vocab 128,256, seq 2,048: the chunked loss
    needs at most half of what full logits do."""
    from trainer import config, flags, train
    argv = ["--model.vocab_size=128256", "--model.hidden_size=64", "--model.intermediate_size=128",
            "--model.num_hidden_layers=1", "--model.max_position_embeddings=2048",
            "--seq_len=2048", "--batch_size=1", "--mesh=1,1,1"]
    temps = {}
    for chunk in (2048, 0):  # 2048: one chunk, full logits; 0: auto
        cfg = flags.parse(config.TrainConfig, argv + [f"--loss_chunk={chunk}"])
        mesh = sharding.make_mesh(cfg.mesh, cfg.model, 1, devices=jax.devices()[:1])
        trainer = train.Trainer(cfg, mesh)
        batch = {k: jax.ShapeDtypeStruct((1, 2048), d, sharding=trainer.batch_sharding)
                 for k, d in (("inputs", jnp.int32), ("targets", jnp.int32),
                              ("loss_mask", jnp.float32))}
        with jax.set_mesh(mesh):
            compiled = trainer.step_fn.lower(trainer.abstract_state, batch).compile()
        temps[chunk] = compiled.memory_analysis().temp_size_in_bytes
    print(f"temporaries: full logits {temps[2048] / 2**20:.0f} MiB, chunked "
          f"{temps[0] / 2**20:.0f} MiB")
    assert temps[0] <= 0.5 * temps[2048]
