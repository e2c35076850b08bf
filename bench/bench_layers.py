"""Scanned versus unrolled layers (--scan_layers): compile time and step time, side by side.

    python bench/bench_layers.py --layers=8,32

Both are meshlm's model on one device, taking the loss and its gradients for one batch
of the `small` config widths: unrolled runs one Block per layer in the program, scanned
runs the layers as one lax.scan over their stacked weights (model.Transformer).
"""

import argparse
import statistics
import sys
import time

import jax
import numpy as np

from trainer.families import ModelConfig
from trainer.model import batch_loss, build_model


def config(layers):
    return ModelConfig(vocab_size=320, hidden_size=256, intermediate_size=688,
                       num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8)


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
    tokens = np.random.default_rng(0).integers(0, 320, (8, 257)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "loss_mask": np.ones((8, 256), np.float32)}
    for layers in map(int, args.layers.split(",")):
        unrolled = build_model(config(layers))
        params = unrolled.init(jax.random.PRNGKey(0), batch["inputs"][:1, :8])["params"]
        results = [timed(jax.grad(lambda p, m=model: batch_loss(m, p, batch)[0]), params)
                   for model in (unrolled, unrolled.clone(scan_layers=True))]
        (unrolled_c, unrolled_t), (scan_c, scan_t) = results
        print(f"| {layers} | {unrolled_c:.1f} | {scan_c:.1f} | {unrolled_t * 1e3:.0f} | "
              f"{scan_t * 1e3:.0f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
