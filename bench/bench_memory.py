"""Per-device train-state memory of full fine-tuning against LoRA, from the compiled step.

    python bench/bench_memory.py                                  # llama3.2_1b and llama3_8b
    python bench/bench_memory.py --models=llama3.2_1b --seq_len=2048

Compiles the train step with abstract shapes on 8 virtual CPU devices (mesh 1,8,1, bf16
compute, one row per device): no weights are made. XLA's memory_analysis() of the compiled
step gives its argument bytes per device, which are the train state (params, optimizer
state, counters) plus the batch; the batch's own bytes are taken off. Temporaries are
printed too, but they are the CPU backend's buffer assignment (issue "memory that follows
the math" is about them); the state column is what the README's table quotes.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

GiB = 2 ** 30
SETUPS = {  # name -> extra train flags
    "full": [],
    "lora16": ["--lora.rank=16", "--lora.base_dtype=bfloat16"],
}


def state_bytes(model, setup, seq_len):
    from trainer import config, flags, lora, sharding, train
    argv = [f"--model={model}", "--mesh=1,8,1", "--batch_size=8", f"--seq_len={seq_len}",
            "--dtype=bfloat16", "--remat=full", *SETUPS[setup]]
    cfg = flags.parse(config.TrainConfig, argv)
    mesh = sharding.make_mesh(cfg.mesh, cfg.model, cfg.batch_size, devices=jax.devices()[:8])
    trainer = train.Trainer(cfg, mesh)
    batch = {k: jax.ShapeDtypeStruct((8, seq_len), dtype, sharding=trainer.batch_sharding)
             for k, dtype in (("inputs", np.int32), ("targets", np.int32),
                              ("loss_mask", np.float32))}
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = trainer.step_fn.lower(trainer.abstract_state, batch).compile()
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    batch_per_device = seq_len * (4 + 4 + 4)  # one row of each key
    trainable = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(
        lora.split(trainer.abstract_state["params"], trainer.trainable)[0]))
    return (memory.argument_size_in_bytes - batch_per_device, memory.temp_size_in_bytes,
            trainable, seconds)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="llama3.2_1b,llama3_8b")
    parser.add_argument("--seq_len", type=int, default=256)
    args = parser.parse_args()
    print(f"mesh 1,8,1 on {jax.device_count()} CPU devices, bf16 compute, remat full, "
          f"batch 8, seq {args.seq_len}; per-device bytes from the compiled step")
    print(f"{'model':<13} {'setup':<8} {'trainable':>14} {'state':>10} {'LoRA/full':>10} "
          f"{'temp (CPU)':>11} {'compile':>8}")
    for model in args.models.split(","):
        full_state = None
        for setup in SETUPS:
            state, temp, trainable, seconds = state_bytes(model, setup, args.seq_len)
            full_state = full_state or state
            print(f"{model:<13} {setup:<8} {trainable:>14,} {state / GiB:>8.2f} G "
                  f"{state / full_state:>9.1%} {temp / GiB:>9.2f} G {seconds:>7.0f}s",
                  flush=True)


if __name__ == "__main__":
    main()
