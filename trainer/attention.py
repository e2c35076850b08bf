"""Scaled dot-product attention: one call, an implementation per backend.

A query at slot i sees key slot j when j <= i (causal), i - j < window (sliding layers),
both carry the same segment id (documents packed into one row never see each other), and
the key slot holds a real token (key_mask, for decode caches).

Implementations (`--attention`; `auto` picks by backend, dtype and shape):
  reference  dense scores over every key slot, masked, softmax in float32. The oracle the
             others are tested against, and the KV-cache decoding path.
  blockwise  (CPU, and the fallback) flash-style: queries in blocks of 64 or 128, each
             multiplying only the keys its causal / window mask can reach, head-first so
             that every product is a plain batched matmul; a hand-written backward pass
             recomputes each block from its log-sum-exp. Exact, and no [T, S] tensor
             outlives its block.
  cudnn      (GPU, bf16/fp16) jax.nn.dot_product_attention's cuDNN flash kernel.
  splash     (TPU, sequences a multiple of 128) the Pallas splash-attention kernel, which
             skips fully masked blocks; run per device under shard_map.
Shapes: q [B, T, H, Dh], k and v [B, S, K, Dh] (K divides H: grouped-query attention),
segment_ids [B, T] int, key_mask [B, S] bool; the result is [B, T, H, Dh].
"""

import functools

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("auto", "reference", "blockwise", "cudnn", "splash")


def unsupported(implementation, dtype, seq_len, head_dim, backend=None):
    """Why an implementation can't run here (None when it can): cuDNN needs a GPU, 16-bit
    compute and head_dim <= 128; splash needs a TPU (or Pallas' interpreter) and a
    sequence length that is a multiple of 128."""
    backend = backend or jax.default_backend()
    if implementation == "cudnn":
        if backend != "gpu":
            return f"cudnn needs a GPU, and this backend is {backend}"
        if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
            return "cudnn needs --dtype=bfloat16 or float16"
        if head_dim > 128:
            return f"cudnn needs head_dim <= 128, and the model has {head_dim}"
    if implementation == "splash":
        if backend != "tpu":
            return f"splash needs a TPU, and this backend is {backend}"
        if seq_len % 128:
            return f"splash needs --seq_len to be a multiple of 128, got {seq_len}"
    return None


def choose(implementation, dtype, seq_len, head_dim, backend=None):
    """The implementation `auto` stands for on this backend (others are taken as given)."""
    if implementation != "auto":
        return implementation
    for fast in ("cudnn", "splash"):
        if not unsupported(fast, dtype, seq_len, head_dim, backend):
            return fast
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
    return _blockwise(q, k, v, scale, window, block_size(q.shape[1]), segment_ids)


def cached_attention(q, k, v, *, scale, q_slots, window=None, key_mask=None):
    """Attention of T new tokens at q_slots [T] (or [B, T]: each row at its own slots)
    over a cache of S slots (decoding)."""
    mask = _mask(q_slots, jnp.arange(k.shape[1]), window)
    if key_mask is not None:
        mask = mask & key_mask[:, None, :]
    return reference(q, k, v, scale=scale, mask=mask)


def _mask(q_slots, k_slots, window=None, q_segments=None, k_segments=None):
    """[1 or B, T, S] bool: which key slots each query may see; q_slots [T] or [B, T]."""
    mask = k_slots <= q_slots[..., None]
    if window is not None:
        mask &= k_slots > q_slots[..., None] - window
    if mask.ndim == 2:
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


def block_size(seq_len):
    """Query rows per block: 64 for short sequences, else 128 (the faster of the two in
    bench/bench_train.py's configs on CPU; smaller blocks waste less of the causal square,
    larger ones make fuller matmuls)."""
    return 64 if seq_len <= 256 else 128


def _blocks(T, block, window):
    """(start, end, low) per query block: its rows, and the first key any of them sees."""
    for start in range(0, T, block):
        end = min(start + block, T)
        yield start, end, 0 if window is None else max(0, start - window + 1)


def _to_rows(x, K):
    """[B, T, H, Dh] -> [B, K, T*G, Dh]: each kv head's G query heads of each position
    side by side, so a block of positions is a contiguous run of rows."""
    B, T, H, D = x.shape
    return x.reshape(B, T, K, H // K, D).transpose(0, 2, 1, 3, 4).reshape(B, K, T * H // K, D)


def _from_rows(x, T):
    """The inverse of _to_rows: [B, K, T*G, Dh] -> [B, T, H, Dh]."""
    B, K, TG, D = x.shape
    G = TG // T
    return x.reshape(B, K, T, G, D).transpose(0, 2, 1, 3, 4).reshape(B, T, K * G, D)


def _to_heads(q, k, v, scale):
    """Layouts in which every product below is a plain batched matmul over (B, K): q as
    rows [B, K, T*G, Dh] (scaled), k as [B, K, Dh, S], v as [B, K, S, Dh]."""
    qr = _to_rows(q * jnp.asarray(scale, q.dtype), k.shape[2])
    return qr, k.astype(q.dtype).transpose(0, 2, 3, 1), v.astype(q.dtype).transpose(0, 2, 1, 3)


def _block_scores(qr, kT, G, start, end, low, window, segment_ids):
    """(query rows [B, K, t*G, Dh], masked scores [B, K, t*G, keys] float32) of one block."""
    rows = qr[:, :, start * G:end * G]
    scores = jnp.matmul(rows, kT[..., low:end], preferred_element_type=jnp.float32)
    seg = (lambda a, b: None) if segment_ids is None else (lambda a, b: segment_ids[:, a:b])
    mask = _mask(jnp.arange(start, end), jnp.arange(low, end), window, seg(start, end),
                 seg(low, end))  # [1 or B, t, keys]
    mask = jnp.repeat(mask, G, axis=1)[:, None]  # [1 or B, 1, t*G, keys]
    return rows, jnp.where(mask, scores, -jnp.inf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _blockwise(q, k, v, scale, window, block, segment_ids=None):
    """Flash-style attention by query blocks: each block multiplies only the keys its
    causal / window mask can reach. The backward pass recomputes each block's
    probabilities from the saved log-sum-exp, so no [T, S] tensor outlives its block,
    and it is written out (not autodiffed) so that no large product needs a transpose."""
    return _blockwise_fwd(q, k, v, scale, window, block, segment_ids)[0]


def _blockwise_fwd(q, k, v, scale, window, block, segment_ids=None):
    T, G = q.shape[1], q.shape[2] // k.shape[2]
    qr, kT, vh = _to_heads(q, k, v, scale)
    outs, lses = [], []
    for start, end, low in _blocks(T, block, window):
        _, s = _block_scores(qr, kT, G, start, end, low, window, segment_ids)
        m = jnp.max(s, axis=-1, keepdims=True)  # finite: a query always sees itself
        p = jnp.exp(s - m)
        total = jnp.sum(p, axis=-1, keepdims=True)
        outs.append(jnp.matmul((p / total).astype(q.dtype), vh[:, :, low:end],
                               preferred_element_type=jnp.float32).astype(q.dtype))
        lses.append(m + jnp.log(total))
    o = jnp.concatenate(outs, axis=2)  # [B, K, T*G, Dh]
    return _from_rows(o, T), (q, k, v, o, jnp.concatenate(lses, axis=2), segment_ids)


def _blockwise_bwd(scale, window, block, residuals, g):
    q, k, v, o, lse, segment_ids = residuals
    T, G = q.shape[1], q.shape[2] // k.shape[2]
    f32 = jnp.float32
    qr, kT, vh = _to_heads(q, k, v, scale)
    do = _to_rows(g.astype(q.dtype), k.shape[2])  # [B, K, T*G, Dh]
    delta = jnp.sum(do.astype(f32) * o.astype(f32), axis=-1, keepdims=True)  # rowsum(dO * O)
    vT, kh = vh.swapaxes(2, 3), kT.swapaxes(2, 3)  # [B, K, Dh, S], [B, K, S, Dh]
    dq_blocks = []
    dkT = jnp.zeros(kT.shape, f32)  # gradients of k and v in k's [B, K, Dh, S] layout
    dvT = jnp.zeros(kT.shape, f32)
    for start, end, low in _blocks(T, block, window):
        a, b = start * G, end * G
        rows, s = _block_scores(qr, kT, G, start, end, low, window, segment_ids)
        p = jnp.exp(s - lse[:, :, a:b])  # this block's probabilities, again
        do_b = do[:, :, a:b]
        dvT = dvT.at[..., low:end].add(jnp.matmul(do_b.swapaxes(2, 3), p.astype(q.dtype),
                                                  preferred_element_type=f32))
        dp = jnp.matmul(do_b, vT[..., low:end], preferred_element_type=f32)
        ds = (p * (dp - delta[:, :, a:b])).astype(q.dtype)  # d(scores)
        dq_blocks.append(jnp.matmul(ds, kh[:, :, low:end], preferred_element_type=f32))
        dkT = dkT.at[..., low:end].add(jnp.matmul(rows.swapaxes(2, 3), ds,
                                                  preferred_element_type=f32))
    dq = _from_rows(jnp.concatenate(dq_blocks, axis=2), T) * scale
    return (dq.astype(q.dtype), dkT.transpose(0, 3, 1, 2).astype(k.dtype),
            dvT.transpose(0, 3, 1, 2).astype(v.dtype), None)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


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
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, ids if segment_ids
                                                     is not None else None),
                         out_specs=spec, check_vma=False)(q, k, v, segment_ids)
