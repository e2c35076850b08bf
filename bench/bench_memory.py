"""The README's memory table: `trainer.plan` over models, sequence lengths, full fine-tuning
against LoRA, and remat none against full.

    python bench/bench_memory.py                                   # the README's grid
    python bench/bench_memory.py --models=llama3.2_1b --seqs=2048 --remats=full

Each cell compiles the train step with abstract shapes on 8 virtual CPU devices (mesh
1,8,1, bf16 compute, AdamW, one row per device): no weights are made. The figures are
per device, from XLA's compiled memory analysis: the train state (params, optimizer
state, counters) and the step's temporaries. Temporaries are the CPU backend's buffer
assignment; a GPU or TPU compiler assigns buffers its own way.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

from trainer import plan, sharding, train  # noqa: E402

GiB = 2 ** 30
SETUPS = {  # name -> extra train flags
    "full": [],
    "LoRA 16": ["--lora.rank=16", "--lora.base_dtype=bfloat16"],
}


def measure(model, setup, seq_len, remat):
    cfg = train.resolve_config([f"--model={model}", "--mesh=1,8,1", "--batch_size=8",
                                f"--seq_len={seq_len}", "--dtype=bfloat16", f"--remat={remat}",
                                f"--model.max_position_embeddings={max(seq_len, 8192)}",
                                *SETUPS[setup]])
    mesh = sharding.make_mesh(cfg.mesh, cfg.model, cfg.batch_size, devices=jax.devices()[:8])
    return plan.plan(cfg, mesh, out=lambda *a: None)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="llama3.2_1b,llama3_8b")
    # (At 8192, XLA CPU logs that its algebraic simplifier "is likely stuck": it is noise.)
    parser.add_argument("--seqs", default="2048,8192")
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--remats", default="none,full")
    args = parser.parse_args()
    print("| model | seq | setup | remat | state | temporaries (CPU) | total | plan time |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        for seq in map(int, args.seqs.split(",")):
            for setup in args.setups.split(","):
                for remat in args.remats.split(","):
                    start = time.perf_counter()
                    r = measure(model, setup, seq, remat)
                    print(f"| `{model}` | {seq} | {setup} | {remat} | {r['state'] / GiB:.2f} GiB "
                          f"| {r['temp'] / GiB:.2f} GiB | {r['total'] / GiB:.2f} GiB | "
                          f"{time.perf_counter() - start:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
