"""Seconds from launch to the first logged train step, with a cold and a warm compilation cache.

    python bench/bench_startup.py               # the default tiny run, 3 rounds
    python bench/bench_startup.py --rounds=5 -- --model.num_hidden_layers=8

Each round launches `python -m trainer.train` (the default tiny run, plus any flags after
`--`) twice: first with an empty --compile_cache (cold: XLA compiles every program), then
with the cache that run filled (warm). The clock stops when metrics.jsonl gets its first
line with a training loss; the process is then stopped. The tokenized corpus is cached
before the first round, so both cases read it from disk. Medians are printed.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def seconds_to_first_step(flags, output_dir, cache_dir, timeout=600):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["PYTHONPATH"] = REPO
    metrics = os.path.join(output_dir, "metrics.jsonl")
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "trainer.train", f"--output_dir={output_dir}",
                             f"--compile_cache={cache_dir}", *flags], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while time.perf_counter() - start < timeout:
            if os.path.exists(metrics):
                with open(metrics) as f:
                    if any("loss" in json.loads(line) for line in f if line.strip()):
                        return time.perf_counter() - start
            if proc.poll() is not None:
                raise RuntimeError(f"train exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"no step logged within {timeout} s")
    finally:
        proc.kill()
        proc.wait()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("flags", nargs="*", help="train flags (after --)")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="meshlm-startup-")
    try:
        # Fill the token cache (and warm the OS file cache) once, outside the timings.
        seconds_to_first_step(args.flags, os.path.join(root, "prime"), os.path.join(root, "p"))
        times = {"cold": [], "warm": []}
        for r in range(args.rounds):
            cache = os.path.join(root, f"cache{r}")
            for kind in ("cold", "warm"):
                out = os.path.join(root, f"{kind}{r}")
                times[kind].append(seconds_to_first_step(args.flags, out, cache))
                print(f"round {r + 1}: {kind} {times[kind][-1]:.1f} s", flush=True)
        cold, warm = (statistics.median(times[k]) for k in ("cold", "warm"))
        print(f"launch to first logged step (median of {args.rounds}): cold cache {cold:.1f} s, "
              f"warm cache {warm:.1f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
