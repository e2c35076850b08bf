"""Data at scale: tokenization throughput and training memory against corpus size.

For each corpus size (synthetic JSONL text, several files): tokenize it with
`python -m trainer.tokenize` (bytes tokenizer; --workers=1 and --workers=2 on the first
size), then train 20 steps with `--data.path=SHARDS` and report the training process's
peak RSS. Resident memory must not grow with the corpus: the shards are memory-mapped and
each step reads only its rows. Everything is written under --workdir and deleted after.
Wall-clock throughput depends on what else runs on the machine; tokens per CPU second
(the command's and its workers' user + system time) does not.

    python bench/bench_data.py                       # 100 MB and 2 GB (needs ~13 GB of disk)
    python bench/bench_data.py --sizes_mb=20,200     # a quick look
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the of and to in is was for on that with as by at from his an were are which this be "
         "or has had not first one their its new after who they have her she two been other when "
         "there all during into school time may years more most only over city some world would "
         "where later up such used many can state about national out known university united then").split()


def write_corpus(root, size_mb, files=8):
    """~size_mb of JSONL ({"text": ...}, documents of 20-400 words) in `files` files. A pool of
    distinct documents is written over and over (tokenizing costs the same)."""
    rng = np.random.default_rng(0)
    pool = []
    for _ in range(4000):
        words = rng.choice(WORDS, rng.integers(20, 400))
        pool.append(json.dumps({"text": " ".join(words)}) + "\n")
    block = "".join(pool).encode()
    per_file = size_mb * 2 ** 20 // files
    os.makedirs(root, exist_ok=True)
    for i in range(files):
        with open(os.path.join(root, f"part{i:02d}.jsonl"), "wb") as f:
            written = 0
            while written < per_file:
                f.write(block)
                written += len(block)
    return sum(os.path.getsize(os.path.join(root, n)) for n in os.listdir(root))


def run(args, env=None):
    """Run a command; (seconds, peak RSS in MB of it and its children, CPU seconds, stdout)."""
    code = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
            "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
            "r = resource.getrusage(resource.RUSAGE_CHILDREN); "
            "print(time.perf_counter() - t, r.ru_maxrss, r.ru_utime + r.ru_stime); "
            "sys.stderr.write(p.stderr[-3000:] if p.returncode else ''); sys.stdout.write(p.stdout); "
            "sys.exit(p.returncode)")
    p = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, env=env)
    if p.returncode:
        raise SystemExit(f"failed: {' '.join(args)}\n{p.stderr}")
    first, _, rest = p.stdout.partition("\n")
    seconds, rss_kb, cpu = first.split()
    return float(seconds), int(rss_kb) / 1024, float(cpu), rest


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes_mb", default="100,2048")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    work = a.workdir or tempfile.mkdtemp(prefix="meshlm-bench-data-")
    py = sys.executable
    rows = []
    try:
        for n, size in enumerate(int(s) for s in a.sizes_mb.split(",")):
            corpus, shards = os.path.join(work, f"corpus{size}"), os.path.join(work, f"shards{size}")
            nbytes = write_corpus(corpus, size)
            throughput, per_cpu = {}, {}
            for workers in ((1, 2) if n == 0 else (2,)):
                shutil.rmtree(shards, ignore_errors=True)
                secs, _, cpu, out = run([py, "-m", "trainer.tokenize", f"--data.path={corpus}/*.jsonl",
                                    f"--output={shards}", f"--workers={workers}", "--progress=false"])
                summary = json.loads(out.strip().splitlines()[-1])
                throughput[workers] = summary["tokens"] / secs
                per_cpu[workers] = summary["tokens"] / cpu
            shutil.rmtree(corpus)
            secs, rss, _, _ = run([py, "-m", "trainer.train", f"--data.path={shards}", f"--steps={a.steps}",
                                "--log_every=10", "--eval_every=0", "--eval_batches=2", "--compile_cache=",
                                f"--output_dir={work}/run{size}", f"--data.cache_dir={work}/cache"])
            rows.append((size, nbytes, summary["tokens"], throughput, rss, secs))
            print("  tokens per CPU second (machine load aside): "
                  + ", ".join(f"{w} worker(s) {t / 1e6:.2f}M" for w, t in per_cpu.items()), flush=True)
            shutil.rmtree(shards)
            shutil.rmtree(f"{work}/run{size}")
            print(f"{size} MB: {summary['tokens']:,} tokens; tokenize "
                  + ", ".join(f"{w} worker(s) {t / 1e6:.2f}M tokens/s" for w, t in throughput.items())
                  + f"; train {a.steps} steps: peak RSS {rss:,.0f} MB ({secs:.0f} s)", flush=True)
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print("\n| corpus | tokens | tokenize tokens/s (1 worker) | (2 workers) | train peak RSS |")
    print("|---|---|---|---|---|")
    for size, nbytes, tokens, tp, rss, _ in rows:
        print(f"| {nbytes / 2**20:,.0f} MB | {tokens:,} | {tp.get(1, float('nan')) / 1e6:.2f}M | "
              f"{tp[2] / 1e6:.2f}M | {rss:,.0f} MB |")
    if len(rows) > 1:
        print(f"peak RSS ratio, largest / smallest corpus: {rows[-1][4] / rows[0][4]:.3f}")


if __name__ == "__main__":
    main()
