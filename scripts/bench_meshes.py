"""Tokens/s of one training setup on several dp,fsdp,tp meshes, side by side.

  python scripts/bench_meshes.py                      # tiny model, 8 virtual CPU devices
  python scripts/bench_meshes.py --devices=0 --meshes 1,-1,1 -1,1,1 1,-1,4 -- --model=llama3.2_1b
                                                      # the real accelerators; extra train flags

Each mesh runs `python -m trainer.train` in a fresh process, one after the other, with
--log_every=1; the table shows medians over the steps of metrics.jsonl, the first step left
out. On virtual CPU devices every "device" shares the same few cores: the numbers show the
overhead of each layout, not how it scales; a mesh without -1 gets exactly dp*fsdp*tp of
them (1,1,1 runs on one).
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(mesh, args, extra, workdir):
    out = os.path.join(workdir, mesh.replace(",", "_").replace("-", "m"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    if args.devices:  # a mesh without -1 gets exactly its dp*fsdp*tp virtual devices
        dims = [int(d) for d in mesh.split(",")]
        env["JAX_NUM_CPU_DEVICES"] = str(args.devices if -1 in dims else math.prod(dims))
        env["JAX_PLATFORMS"] = "cpu"
    command = [sys.executable, "-m", "trainer.train", f"--mesh={mesh}", f"--model={args.model}",
               f"--steps={args.steps}", f"--batch_size={args.batch_size}",
               f"--seq_len={args.seq_len}", "--log_every=1", "--eval_every=0",
               "--eval_batches=1", f"--output_dir={out}", "--resume=never", *extra]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": last}
    records = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if l.strip()]
    steps = [r for r in records if "tokens_per_sec" in r and r["step"] > 1]
    tps = statistics.median(r["tokens_per_sec"] for r in steps)
    return {"tokens_per_sec": tps, "ms_per_step": 1000 * args.batch_size * args.seq_len / tps,
            "tflops_per_device": statistics.median(r["tflops_per_device"] for r in steps),
            "wall": wall}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--meshes", nargs="+",
                        default=["1,1,1", "8,1,1", "1,8,1", "1,2,4", "2,2,2"])
    parser.add_argument("--devices", type=int, default=8,
                        help="virtual CPU devices (0: the machine's real devices)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=128)
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if args.model == "tiny" and not any("num_key_value_heads" in a for a in extra):
        extra.append("--model.num_key_value_heads=4")  # so that tp=4 splits whole kv heads

    print(f"model {args.model}, batch {args.batch_size} x seq {args.seq_len}, {args.steps} steps, "
          + (f"{args.devices} virtual CPU devices" if args.devices else "real devices")
          + (f", flags {' '.join(extra)}" if extra else ""))
    print("\n| mesh dp,fsdp,tp | tokens/s | ms/step | TFLOP/s per device | wall s (incl. compile) |")
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as workdir:
        for mesh in args.meshes:
            r = bench(mesh, args, extra, workdir)
            if "error" in r:
                print(f"| {mesh} | failed: {r['error']} | | | |", flush=True)
                continue
            print(f"| {mesh} | {r['tokens_per_sec']:,.0f} | {r['ms_per_step']:.1f} | "
                  f"{r['tflops_per_device']:.4f} | {r['wall']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
