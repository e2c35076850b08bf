"""Serving throughput: generated tokens/s for 1, 4 and 16 concurrent clients, against
requests sent one at a time, on the same model.

    python bench/bench_serve.py                      # a 1-step tiny checkpoint, made here
    python bench/bench_serve.py --checkpoint=runs/tiny --max_tokens=128
    python bench/bench_serve.py -- --model.num_hidden_layers=8 --model.hidden_size=256

Starts `python -m trainer.serve` (continuous batching, --slots=16) on a free port and
drives it over HTTP: each client sends greedy /v1/completions requests back to back, each
with its own prompt. Tokens are the replies' `usage.completion_tokens`; the clock runs
from the first request to the last reply. "one at a time" is one client. The same is done
against a --slots=1 server (no batching; nothing computed for empty slots), for the
baseline an engine without continuous batching gives. Medians of --rounds rounds.
Without --checkpoint, the model is `trainer.train --steps=1` with the flags after `--`.
"""

import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env():
    e = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    e["PYTHONPATH"] = REPO
    return e


def start_server(checkpoint, slots, max_len):
    proc = subprocess.Popen([sys.executable, "-m", "trainer.serve", f"--checkpoint={checkpoint}",
                             "--port=0", f"--slots={slots}", f"--max_len={max_len}",
                             "--max_queue=256"], cwd=REPO, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if "http://" not in line:
        proc.kill()
        raise RuntimeError(f"the server did not start: {line!r}")
    return proc, line.split()[-1].rstrip("/")


def complete(url, prompt, max_tokens):
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())["usage"]["completion_tokens"]


def tokens_per_second(url, clients, requests, max_tokens, round_):
    """`clients` threads share `requests` requests, each sending its next when one ends."""
    prompts = [f"Request {round_}.{i}: tell me about item number {i * 7}" for i in range(requests)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(lambda p: complete(url, p, max_tokens), prompts))
    return tokens / (time.perf_counter() - start)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="", help="model to serve (default: made here)")
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=32, help="requests per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("flags", nargs="*", help="train flags for the made-up model (after --)")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="meshlm-bench-serve-")
    try:
        checkpoint = args.checkpoint
        if not checkpoint:
            checkpoint = os.path.join(root, "run")
            subprocess.run([sys.executable, "-m", "trainer.train", "--steps=1", "--eval_every=0",
                            f"--output_dir={checkpoint}", *args.flags], cwd=REPO, env=env(),
                           check=True, capture_output=True)
        rows = []
        for slots, client_counts in ((1, (1,)), (16, (1, 4, 16))):
            proc, url = start_server(checkpoint, slots, max_len=256)
            try:
                complete(url, "warm up", args.max_tokens)
                for clients in client_counts:
                    rates = [tokens_per_second(url, clients, args.requests if clients > 1
                                               else max(4, args.requests // 4),
                                               args.max_tokens, r) for r in range(args.rounds)]
                    rows.append((slots, clients, statistics.median(rates)))
                    print(f"slots={slots:2d} clients={clients:2d}: "
                          f"{statistics.median(rates):8.1f} tokens/s", file=sys.stderr)
            finally:
                proc.kill()
                proc.wait()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = next(rate for slots, clients, rate in rows if slots == 16 and clients == 1)
    one_slot = next(rate for slots, clients, rate in rows if slots == 1)
    print(f"| server | clients | tokens/s (median of {args.rounds}) | vs one at a time | "
          "vs --slots=1 |")
    print("|---|---|---|---|---|")
    for slots, clients, rate in rows:
        print(f"| --slots={slots} | {clients}{' (one at a time)' if clients == 1 else ''} | "
              f"{rate:.0f} | {rate / base:.2f}x | {rate / one_slot:.2f}x |")


if __name__ == "__main__":
    main()
