"""Train-step throughput of a ~1B LLaMA on one accelerator, in bf16: tokens/s, MFU, peak
memory and the attention kernel that ran. scripts/bench_device.sh runs it.

    python bench/bench_device.py --model=llama3.2_1b --seq_len=2048 --batch_size=8

Extra train flags pass through (--remat=full, --attention=blockwise, ...). The last line
printed is JSON.
"""

import json
import os
import statistics
import sys
import time

import jax
import numpy as np

from trainer import attention, config, flags, sharding, train
from trainer.model import DTYPES


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    defaults = ["--model=llama3.2_1b", "--seq_len=2048", "--batch_size=8", "--dtype=bfloat16",
                "--mesh=1,1,1", "--steps=100"]
    given = flags.given(argv)
    cfg = flags.parse(config.TrainConfig, [a for a in defaults
                                           if a[2:].split("=")[0] not in given] + argv)
    jax.config.update("jax_threefry_partitionable", True)
    device = jax.devices()[0]
    mesh = sharding.make_mesh(cfg.mesh, cfg.model, cfg.batch_size, devices=jax.devices()[:1])
    trainer = train.Trainer(cfg, mesh)
    B, T, V = cfg.batch_size, cfg.seq_len, cfg.model.vocab_size
    tokens = np.random.default_rng(0).integers(0, V, (B, T + 1), dtype=np.int32)
    with jax.set_mesh(mesh):
        state = trainer.fresh_state()
        batch = jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                                "loss_mask": np.ones((B, T), np.float32)}, trainer.batch_sharding)
        t = time.perf_counter()
        step = trainer.step_fn.lower(state, batch).compile()
        compile_s = time.perf_counter() - t
        for _ in range(3):  # warm-up
            state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times = []
        for _ in range(10):
            t = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t)
    seconds = statistics.median(times)
    tokens_per_s = B * T / seconds
    flops = cfg.model.flops_per_token(T) * tokens_per_s
    peak = train.peak_tflops(cfg) * 1e12
    stats = device.memory_stats() or {}
    result = {
        "device": device.device_kind, "model": cfg.model.model_type,
        "params": cfg.model.num_params(), "seq_len": T, "batch_size": B, "dtype": cfg.dtype,
        "remat": cfg.remat,
        "attention": attention.choose(cfg.attention, DTYPES[cfg.dtype], T, cfg.model.head_dim),
        "step_s": seconds, "tokens_per_s": tokens_per_s, "tflops": flops / 1e12,
        "mfu": flops / peak if peak else None, "compile_s": compile_s,
        "peak_memory_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
        "loss": float(metrics["loss"]),
    }
    print(f"{result['device']}: {result['params'] / 1e9:.2f}B params, seq {T} x batch {B}, "
          f"{cfg.dtype}, attention {result['attention']}: {tokens_per_s:,.0f} tokens/s, "
          f"{result['tflops']:.0f} TFLOP/s" + (f", MFU {result['mfu']:.1%}" if peak else "")
          + f", peak memory {result['peak_memory_gib']:.1f} GiB")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_device.json"), "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
