"""Train-step throughput: meshlm against Hugging Face transformers + torch AdamW, side by side.

    python bench/bench_train.py                      # tiny, small, small-bf16, medium
    python bench/bench_train.py --configs=small --rounds=7

Both trainers run the same model (LLaMA layout, random weights) on the same batch shapes,
with AdamW and global-norm clipping. They alternate in rounds within one process, so the
machine's noise hits both alike; each round times `--steps` steps after a warm-up, and the
table quotes medians. The matmul peak is XLA's own fp32 GEMM rate on this machine, measured
in the same run; "of peak" is meshlm's analytic training FLOP/s over it.
"""

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

CONFIGS = {  # name -> (model fields, seq_len, batch_size)
    "tiny": (dict(vocab_size=384, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2), 128, 16),
    "small": (dict(vocab_size=320, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=8), 256, 8),
    "medium": (dict(vocab_size=320, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=8), 512, 4),
}


def matmul_peak_gflops(n=2048, repeats=10):
    """XLA's fp32 GEMM rate here: the median of `repeats` n x n x n products."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), np.float32))
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n ** 3 / statistics.median(times) / 1e9


def meshlm_runner(fields, seq_len, batch_size, dtype, extra_flags=()):
    from trainer import config, flags, sharding, train
    argv = [f"--model.{k}={v}" for k, v in fields.items()] + [
        f"--seq_len={seq_len}", f"--batch_size={batch_size}", f"--dtype={dtype}",
        "--mesh=1,1,1", "--model.max_position_embeddings=4096", *extra_flags]
    cfg = flags.parse(config.TrainConfig, argv)
    mesh = sharding.make_mesh(cfg.mesh, cfg.model, cfg.batch_size, devices=jax.devices()[:1])
    trainer = train.Trainer(cfg, mesh)
    tokens = np.random.default_rng(0).integers(0, fields["vocab_size"], (batch_size, seq_len + 1),
                                               dtype=np.int32)
    with jax.set_mesh(mesh):
        state = trainer.fresh_state()
        batch = jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                                "loss_mask": np.ones((batch_size, seq_len), np.float32)},
                               trainer.batch_sharding)
        t = time.perf_counter()
        step = trainer.step_fn.lower(state, batch).compile()
        compile_s = time.perf_counter() - t
    holder = {"state": state}

    def run(n):
        with jax.set_mesh(mesh):
            for _ in range(n):
                holder["state"], metrics = step(holder["state"], batch)
            jax.block_until_ready(metrics)
    flops = cfg.model.flops_per_token(seq_len) * seq_len * batch_size
    return run, flops, compile_s


def torch_runner(fields, seq_len, batch_size, dtype):
    import torch
    import transformers
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(**fields, max_position_embeddings=4096,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(hf_cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = torch.randint(0, fields["vocab_size"], (batch_size, seq_len + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")

    def run(n):
        for _ in range(n):
            with autocast:
                logits = model(input_ids=inputs).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                     targets.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return run


def bench(name, rounds, steps, dtype="float32", extra_flags=()):
    fields, seq_len, batch_size = CONFIGS[name]
    ours, flops, compile_s = meshlm_runner(fields, seq_len, batch_size, dtype, extra_flags)
    theirs = torch_runner(fields, seq_len, batch_size, dtype)
    ours(2)
    theirs(2)
    tokens = steps * seq_len * batch_size
    rates = {"meshlm": [], "torch": []}
    for _ in range(rounds):
        for label, run in (("meshlm", ours), ("torch", theirs)):
            t = time.perf_counter()
            run(steps)
            rates[label].append(tokens / (time.perf_counter() - t))
    ratios = [a / b for a, b in zip(rates["meshlm"], rates["torch"])]
    return {"meshlm": statistics.median(rates["meshlm"]), "torch": statistics.median(rates["torch"]),
            "ratio": statistics.median(ratios),
            "gflops": statistics.median(rates["meshlm"]) * flops / (seq_len * batch_size) / 1e9,
            "compile_s": compile_s}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="tiny,small,small-bf16,medium")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--flags", default="", help="extra meshlm train flags, space-separated")
    args = parser.parse_args(argv)
    import torch
    peak = matmul_peak_gflops()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads); XLA fp32 matmul peak {peak:.0f} GFLOP/s")
    print("| config | meshlm tokens/s | HF + torch tokens/s | ratio | meshlm GFLOP/s | of peak "
          "| compile s |")
    print("|---|---|---|---|---|---|---|")
    for name in args.configs.split(","):
        base, _, kind = name.partition("-")
        dtype = "bfloat16" if kind == "bf16" else "float32"
        r = bench(base, args.rounds, args.steps, dtype, args.flags.split())
        print(f"| {name} | {r['meshlm']:,.0f} | {r['torch']:,.0f} | {r['ratio']:.2f} | "
              f"{r['gflops']:.0f} | {r['gflops'] / peak:.0%} | {r['compile_s']:.1f} |",
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
