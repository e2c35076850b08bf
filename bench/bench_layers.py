"""Layer scan versus unrolled layers: compile time and step time, side by side.

    python bench/bench_layers.py --layers=8,32

Unrolled is meshlm's model as it is: one Block per layer in the program. Scan runs the
same Block once under lax.scan over the layers' parameters stacked on a leading axis
(stacked here, outside the timed step, as a scanned model would store them). Both take
the loss and its gradients for one batch of the `small` config widths.
"""

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from trainer.families import ModelConfig
from trainer.model import Block, build_model, cross_entropy


def config(layers):
    return ModelConfig(vocab_size=320, hidden_size=256, intermediate_size=688,
                       num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8)


def scanned_loss(model, params, stacked, tokens, targets, mask):
    """The model's forward pass with its blocks under lax.scan."""
    cfg = model.cfg
    B, T = tokens.shape
    x = jnp.take(params["embed_tokens"]["embedding"], tokens, axis=0)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    block = Block(cfg, "full_attention", jnp.float32, jnp.float32)

    def body(x, layer):
        return block.apply({"params": layer}, x, positions, jnp.arange(T))[0], None
    x, _ = jax.lax.scan(body, x, stacked)
    # The final RMSNorm and the lm head, as model.py computes them.
    x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps)
    x = x * params["norm"]["scale"]
    return cross_entropy(x @ params["lm_head"]["kernel"], targets, mask)[0]


def timed(fn, *args, steps=5):
    t = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t)
    return compile_s, statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="8,32")
    args = parser.parse_args(argv)
    print("| layers | unrolled compile s | scan compile s | unrolled step ms | scan step ms |")
    print("|---|---|---|---|---|")
    for layers in map(int, args.layers.split(",")):
        cfg = config(layers)
        model = build_model(cfg)
        tokens = np.random.default_rng(0).integers(0, 320, (8, 257)).astype(np.int32)
        inputs, targets, mask = tokens[:, :-1], tokens[:, 1:], np.ones((8, 256), np.float32)
        params = model.init(jax.random.PRNGKey(0), inputs[:1, :8])["params"]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs),
                               *[params[f"layers_{i}"] for i in range(layers)])

        def unrolled(p):
            return model.apply({"params": p}, inputs, targets=targets, loss_mask=mask)[0]
        unrolled_c, unrolled_t = timed(jax.grad(unrolled), params)
        scan_c, scan_t = timed(jax.grad(lambda p, s: scanned_loss(
            model, p, s, inputs, targets, mask), argnums=(0, 1)), params, stacked)
        print(f"| {layers} | {unrolled_c:.1f} | {scan_c:.1f} | {unrolled_t * 1e3:.0f} | "
              f"{scan_t * 1e3:.0f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
