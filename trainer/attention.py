"""Scaled dot-product attention: one call, an implementation per backend.

A query at slot i sees key slot j when j <= i (causal), i - j < window (sliding layers),
both carry the same segment id (documents packed into one row never see each other), and
the key slot holds a real token (key_mask, for decode caches).

Implementations (`--attention`; `auto` picks by backend, dtype and shape):
  reference  dense scores over every key slot, masked, softmax in float32. The oracle the
             others are tested against, and the KV-cache decoding path.
  blockwise  (CPU, and the fallback) queries in blocks of 128; each block multiplies only
             the keys its causal / window mask can reach, head-first so that every product
             is a plain batched matmul. Exact, and about 2.5x the reference on CPU.
  cudnn      (GPU, bf16/fp16) jax.nn.dot_product_attention's cuDNN flash kernel.
  splash     (TPU, sequences a multiple of 128) the Pallas splash-attention kernel, which
             skips fully masked blocks; run per device under shard_map.
Shapes: q [B, T, H, Dh], k and v [B, S, K, Dh] (K divides H: grouped-query attention),
segment_ids [B, T] int, key_mask [B, S] bool; the result is [B, T, H, Dh].
"""

import math

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("auto", "reference", "blockwise", "cudnn", "splash")
BLOCK = 128  # query rows per block: small enough for cache, large enough for the matmul units


def choose(implementation, dtype, seq_len, head_dim, backend=None):
    """The implementation `auto` stands for on this backend (others are taken as given)."""
    if implementation != "auto":
        return implementation
    backend = backend or jax.default_backend()
    if backend == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim <= 128:
        return "cudnn"
    if backend == "tpu" and seq_len % 128 == 0:
        return "splash"
    return "blockwise"


def self_attention(q, k, v, *, scale, window=None, segment_ids=None, implementation="auto"):
    """Causal self-attention of a whole sequence (training and evaluation: slots 0..T-1)."""
    impl = choose(implementation, q.dtype, q.shape[1], q.shape[-1])
    if impl == "cudnn":
        return _cudnn(q, k, v, scale, window, segment_ids)
    if impl == "splash":
        return _splash(q, k, v, scale, window, segment_ids)
    if impl == "reference":
        slots = jnp.arange(q.shape[1])
        return reference(q, k, v, scale=scale, mask=_mask(slots, slots, window, segment_ids,
                                                           segment_ids))
    return _blockwise(q, k, v, scale, window, segment_ids)


def cached_attention(q, k, v, *, scale, q_slots, window=None, key_mask=None):
    """Attention of T new tokens at q_slots [T] over a cache of S slots (decoding)."""
    mask = _mask(q_slots, jnp.arange(k.shape[1]), window)
    if key_mask is not None:
        mask = mask & key_mask[:, None, :]
    return reference(q, k, v, scale=scale, mask=mask)


def _mask(q_slots, k_slots, window=None, q_segments=None, k_segments=None):
    """[1 or B, T, S] bool: which key slots each query may see."""
    mask = k_slots[None, :] <= q_slots[:, None]
    if window is not None:
        mask &= k_slots[None, :] > q_slots[:, None] - window
    mask = mask[None]
    if q_segments is not None:
        mask = mask & (q_segments[:, :, None] == k_segments[:, None, :])
    return mask


def reference(q, k, v, *, scale, mask):
    """Dense masked attention; mask [B or 1, T, S]. Queries are grouped per kv head, so K/V
    are never copied."""
    B, T, H, D = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, H // K, D)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(q.dtype),
                        preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(q.dtype))
    return out.reshape(B, T, H, D)


def _blockwise(q, k, v, scale, window, segment_ids, block=BLOCK):
    B, T, H, D = q.shape
    K = k.shape[2]
    G = H // K
    # Head-first, a kv head's G queries side by side: every product below is a batched
    # [rows, D] x [D, keys] matmul over (B, K), the layout CPU matmul kernels want.
    qh = (q * jnp.asarray(scale, q.dtype)).reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4)
    kh = k.astype(q.dtype).transpose(0, 2, 3, 1)  # [B, K, D, S]
    vh = v.astype(q.dtype).transpose(0, 2, 1, 3)  # [B, K, S, D]
    outs = []
    for start in range(0, T, block):
        end = min(start + block, T)
        low = 0 if window is None else max(0, start - window + 1)  # the first key it can see
        rows = qh[:, :, :, start:end].reshape(B, K, G * (end - start), D)
        scores = jnp.matmul(rows, kh[..., low:end], preferred_element_type=jnp.float32)
        scores = scores.reshape(B, K, G, end - start, end - low)
        mask = _mask(jnp.arange(start, end), jnp.arange(low, end), window,
                     None if segment_ids is None else segment_ids[:, start:end],
                     None if segment_ids is None else segment_ids[:, low:end])
        scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
        out = jnp.matmul(probs.reshape(B, K, G * (end - start), end - low), vh[:, :, low:end])
        outs.append(out.reshape(B, K, G, end - start, D))
    out = jnp.concatenate(outs, axis=3)  # [B, K, G, T, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)


def _cudnn(q, k, v, scale, window, segment_ids):
    mask = None
    if segment_ids is not None:  # [B, 1, T, S]; the causal part stays cuDNN's own
        mask = (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    return jax.nn.dot_product_attention(
        q, k.astype(q.dtype), v.astype(q.dtype), mask=mask, scale=scale, is_causal=True,
        local_window_size=None if window is None else (window - 1, 0), implementation="cudnn")


def _splash(q, k, v, scale, window, segment_ids, interpret=False):
    """Pallas splash attention on TPU, per device: q/k/v arrive [B, T, heads, Dh] and the
    kernel wants one example's [heads, T, Dh]; batch and heads stay split as the mesh has
    them (shard_map), so each device runs the kernel on its own shard."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash, splash_attention_mask as masks)
    from jax.experimental.shard_map import shard_map
    from jax.sharding import PartitionSpec as P

    from trainer.sharding import LOGICAL_AXES

    def local(q, k, v, segment_ids):
        B, T, H, D = q.shape
        shape = (T, T)
        one = (masks.CausalMask(shape) if window is None else
               masks.LocalMask(shape, window_size=(window - 1, 0), offset=0))
        kernel = splash.make_splash_mha(masks.MultiHeadMask([one] * H), head_shards=1,
                                        q_seq_shards=1, interpret=interpret)
        K = k.shape[2]
        rep = lambda x: jnp.repeat(x, H // K, axis=2)  # noqa: E731 (the kernel wants H kv heads)
        qh, kh, vh = ((x * s).transpose(0, 2, 1, 3) for x, s in
                      ((q, scale), (rep(k), 1), (rep(v), 1)))
        if segment_ids is None:
            out = jax.vmap(kernel)(qh, kh, vh)
        else:
            ids = splash.SegmentIds(q=segment_ids, kv=segment_ids)
            out = jax.vmap(lambda a, b, c, s: kernel(a, b, c, segment_ids=s))(qh, kh, vh, ids)
        return out.transpose(0, 2, 1, 3)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return local(q, k, v, segment_ids)
    batch, heads = LOGICAL_AXES["batch"], LOGICAL_AXES["heads"]
    spec, ids = P(batch, None, heads, None), P(batch, None)
    return shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, ids if segment_ids is not None
                                                 else None),
                     out_specs=spec, check_rep=False)(q, k, v, segment_ids)
