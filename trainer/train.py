"""python -m trainer.train: train or fine-tune a LLaMA-family model.

flags -> mesh -> tokenizer and data -> state (fresh, HF import or checkpoint) ->
jax.jit(train_step) -> loop: batch(step) -> step -> log -> checkpoint -> HF export.

`train_step` is a pure single-device function; the mesh enters only through
jax.jit's shardings. Run with --help for every flag.
"""

import dataclasses
import functools
import json
import math
import os
import signal
import sys
import threading
import time

import fsspec
import fsspec.implementations.local
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from trainer import checkpoint, data, flags, loading, optim, sharding
from trainer.config import TrainConfig
from trainer.errors import UserError
from trainer.families import ModelConfig
from trainer.flags import ConfigError
from trainer.model import batch_loss, build_model
from trainer.tokenizer import load_tokenizer

# Peak dense bf16 TFLOP/s per device, for MFU, by a part of jax's device_kind (the longest
# match wins: "TPU v5 lite" is a v5e, "TPU v5" a v5p). Override with --peak_tflops.
PEAK_TFLOPS = {"TPU v4": 275, "TPU v5 lite": 197, "TPU v5e": 197, "TPU v5": 459, "TPU v5p": 459,
               "TPU v6 lite": 918, "TPU v6e": 918, "A100": 312, "H100": 989, "H100 PCIe": 756,
               "H100 NVL": 835, "H200": 989, "H200 NVL": 835, "B200": 2250}


# ------------------------------------------------------------------ the step
def train_step(state, batch, *, model, optimizer, schedule, grad_accum, spike_sigma,
               nan_steps=()):
    """One optimizer step over the global batch, in grad_accum micro-batches.

    state: {'params', 'opt_state', 'step', 'rng', 'bad_steps', 'loss_mean', 'loss_var'}
    batch: {'inputs', 'targets', 'loss_mask'}, each [B, T]
    A non-finite loss or gradient (or, with spike_sigma > 0, a loss spike) skips the
    update and counts a bad step; a good step resets the count.
    nan_steps (testing aid, --debug_nan_steps): steps, numbered as logged, whose loss and
    gradients are made NaN.
    """
    poison = jnp.where(jnp.isin(state["step"] + 1, jnp.asarray(nan_steps, jnp.int32)),
                       jnp.nan, 1.0) if nan_steps else 1.0

    def micro_loss(params, micro):
        loss_sum, n = batch_loss(model, params, micro)
        return loss_sum * poison, n

    def accumulate(carry, micro):
        grad_sum, loss_sum, count = carry
        (loss, n), grads = jax.value_and_grad(micro_loss, has_aux=True)(state["params"], micro)
        grad_sum = jax.tree.map(lambda s, g: s + g.astype(jnp.float32), grad_sum, grads)
        return (grad_sum, loss_sum + loss, count + n), None

    # Gradients add up in float32, whatever the parameter dtype.
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state["params"])
    carry = (zeros, jnp.float32(0), jnp.float32(0))
    if grad_accum == 1:  # no loop: XLA fuses the backward pass with what follows
        (grad_sum, loss_sum, count), _ = accumulate(carry, batch)
    else:
        # [B, T] -> [A, B/A, T] such that every micro-batch keeps each device's share of rows.
        micro_batches = jax.tree.map(
            lambda x: x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1),
            batch)
        (grad_sum, loss_sum, count), _ = jax.lax.scan(accumulate, carry, micro_batches)
    count = jnp.maximum(count, 1.0)
    loss = loss_sum / count
    grads = jax.tree.map(lambda g: g / count, grad_sum)
    grad_norm = optax.global_norm(grads)

    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    if spike_sigma > 0:  # after a warm-up of good steps, skip losses far above the running mean
        limit = state["loss_mean"] + spike_sigma * jnp.sqrt(state["loss_var"])
        ok &= (state["good_steps"] < 50) | (loss <= limit)

    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), state["params"], updates)
    # Every state leaf keeps its dtype (bf16 params get f32 gradients, so Adam's moments
    # would drift to f32), or the compiled step and its donated buffers no longer fit.
    keep_old = lambda new, old: jax.tree.map(
        lambda n, o: jnp.where(ok, n, o).astype(o.dtype), new, old)

    # Running mean and variance of good losses (for the spike guard).
    rate = jnp.where(state["good_steps"] == 0, 1.0, 0.05)
    delta = loss - state["loss_mean"]
    new_state = {
        "params": keep_old(params, state["params"]),
        "opt_state": keep_old(opt_state, state["opt_state"]),
        "step": state["step"] + 1,
        "rng": jax.random.split(state["rng"])[0],
        "bad_steps": jnp.where(ok, 0, state["bad_steps"] + 1),
        "good_steps": state["good_steps"] + ok.astype(jnp.int32),
        "loss_mean": jnp.where(ok, state["loss_mean"] + rate * delta, state["loss_mean"]),
        "loss_var": jnp.where(ok, (1 - rate) * (state["loss_var"] + rate * delta ** 2),
                              state["loss_var"]),
    }
    # The optimizer's schedule counts applied updates (a skipped step leaves its state as it
    # was), which is good_steps: that is the lr this step used.
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state["good_steps"]),
               "skipped": ~ok, "bad_steps": new_state["bad_steps"]}
    return new_state, metrics


def init_state(rng, *, model, optimizer, seq_len):
    params = model.init(rng, jnp.zeros((1, seq_len), jnp.int32))["params"]
    return fresh_state(params, optimizer, rng)


def fresh_state(params, optimizer, rng):
    return {"params": params, "opt_state": optimizer.init(params), "step": jnp.int32(0),
            "rng": jax.random.fold_in(rng, 1), "bad_steps": jnp.int32(0),
            "good_steps": jnp.int32(0), "loss_mean": jnp.float32(0), "loss_var": jnp.float32(0)}


# ------------------------------------------------------------------ setup
def resolve_config(argv):
    """Parse flags; with --init_from, the model and tokenizer come from that source."""
    given = dict(flags.split_args(argv))
    defaults = {}
    if given.get("init_from"):
        if "model" in given:
            raise ConfigError("--model and --init_from both name a model; drop --model "
                              "(override single fields with --model.<field>=)")
        try:
            model, tokenizer = loading.model_source(given["init_from"], given.get("tokenizer") or "")
        except loading.SourceError as e:
            raise ConfigError(f"--init_from: {e}") from None
        defaults = {"model": model, "tokenizer": tokenizer}
    cfg = flags.parse(TrainConfig, argv, defaults)
    if not cfg.tokenizer:
        cfg = dataclasses.replace(cfg, tokenizer="bytes")
    if cfg.export_hf:  # fail now, not after training
        from trainer import hf
        hf.check_export_dir(cfg.export_hf)
    return cfg


def peak_tflops(cfg):
    if cfg.peak_tflops > 0:
        return cfg.peak_tflops
    return peak_tflops_for(jax.devices()[0].device_kind)


def xla_flops_per_step(compiled, num_devices, grad_accum=1):
    """XLA's own FLOP count of a compiled train step, summed over its devices. Its cost
    analysis is per device and counts a loop body once, so the grad_accum scan is scaled up
    (the small optimizer update with it: close enough for a cross-check)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float((cost or {}).get("flops", 0.0)) * num_devices * grad_accum


def peak_tflops_for(device_kind):
    """'NVIDIA H100 80GB HBM3' -> 989; 0.0 for kinds without an entry (CPU)."""
    matches = [k for k in PEAK_TFLOPS if k in device_kind]
    return float(PEAK_TFLOPS[max(matches, key=len)]) if matches else 0.0


class MetricsLog:
    """metrics.jsonl, written only by process 0. On resume, lines past the restored step
    are dropped (those steps run again). Local files are appended to; object stores
    (gs://) can't append, so there the file is rewritten whole."""

    def __init__(self, path, start_step):
        self.path, self.lines = path, []
        fs, _, _ = fsspec.get_fs_token_paths(path)
        self.local = isinstance(fs, fsspec.implementations.local.LocalFileSystem)
        if start_step > 0 and fs.exists(path):
            with fsspec.open(path, "r") as f:
                self.lines = [l for l in f.read().splitlines()
                              if l.strip() and json.loads(l)["step"] <= start_step]
        self._rewrite()

    def _rewrite(self):
        with fsspec.open(self.path, "w") as f:
            f.write("".join(line + "\n" for line in self.lines))

    def write(self, record):
        # NaN and inf are not JSON: a skipped step's loss is written as null.
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                  for k, v in record.items()}
        self.lines.append(json.dumps(record))
        if self.local:
            with open(self.path, "a") as f:
                f.write(self.lines[-1] + "\n")
        else:
            self._rewrite()


def prepare_output_dir(cfg):
    """--resume=never starts over; refuse to clobber a non-empty dir without --overwrite."""
    fs, _, _ = fsspec.get_fs_token_paths(cfg.output_dir)
    if cfg.resume == "never":
        if fs.exists(cfg.output_dir) and fs.ls(cfg.output_dir):
            if not cfg.overwrite:
                raise ConfigError(f"--output_dir={cfg.output_dir} is not empty; pass "
                                  "--overwrite to start over there, or pick another dir")
            if jax.process_index() == 0:
                fs.rm(cfg.output_dir, recursive=True)
    if jax.process_index() == 0:
        fs.makedirs(cfg.output_dir, exist_ok=True)
    if jax.process_count() > 1:  # nobody looks into the dir before process 0 has cleared it
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("meshlm:prepare_output_dir")


class StopSignal:
    """SIGTERM / SIGINT (spot preemption, Ctrl-C): finish the step, save, exit 0.
    Installed for the whole run, so a signal during setup also stops cleanly. Repeated
    SIGTERMs are ignored; a second Ctrl-C aborts at once."""

    def __init__(self):
        self.requested, self._previous = False, {}
        if threading.current_thread() is threading.main_thread():  # where handlers live
            self._previous = {sig: signal.signal(sig, self._handle)
                              for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            self.restore()
            raise KeyboardInterrupt
        if not self.requested:  # os.write: print() may be mid-call in the main thread
            os.write(2, f"\n{signal.Signals(signum).name}: finishing this step, then saving a "
                        f"checkpoint and exiting\n".encode())
        self.requested = True

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def agreed(self):
        """All processes stop at the same step if any of them was signalled."""
        if jax.process_count() == 1:
            return self.requested
        from jax.experimental import multihost_utils
        flags = multihost_utils.process_allgather(np.array([self.requested]))
        return bool(np.any(flags))


class Trainer:
    """What a run compiles from its flags and mesh alone: the model, the optimizer, the
    train state's shardings, a sharded initialiser and the jitted steps. No data and no
    files, so tests can build one per mesh. Call its functions under jax.set_mesh(mesh)."""

    def __init__(self, cfg, mesh):
        self.model = build_model(cfg.model, cfg.dtype, cfg.param_dtype, cfg.remat)
        self.optimizer, self.schedule = optim.make_optimizer(cfg.optimizer, cfg.steps)
        self.rng = jax.random.PRNGKey(cfg.seed)
        init_fn = functools.partial(init_state, model=self.model, optimizer=self.optimizer,
                                    seq_len=cfg.seq_len)
        shapes = jax.eval_shape(init_fn, self.rng)
        self.state_shardings = sharding.state_shardings(
            shapes, mesh, sharding.param_rules(cfg.model, mesh))
        self.abstract_state = checkpoint.abstract_with_shardings(shapes, self.state_shardings)
        self.batch_sharding = sharding.batch_sharding(mesh)
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        # A fresh state is created in its sharded layout: no device ever holds all of it.
        self._init = jax.jit(init_fn, out_shardings=self.state_shardings)
        self._from_params = jax.jit(lambda p: fresh_state(p, self.optimizer, self.rng),
                                    out_shardings=self.state_shardings)
        self.step_fn = jax.jit(
            functools.partial(train_step, model=self.model, optimizer=self.optimizer,
                              schedule=self.schedule, grad_accum=cfg.grad_accum,
                              spike_sigma=cfg.spike_sigma,
                              nan_steps=cfg.debug_nan_steps),
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, replicated), donate_argnums=0)
        self.eval_fn = jax.jit(functools.partial(batch_loss, self.model),
                               in_shardings=(self.state_shardings["params"], self.batch_sharding))

    def fresh_state(self, params=None):
        """A new train state around random weights (or `params`), created sharded."""
        return self._init(self.rng) if params is None else self._from_params(params)


# ------------------------------------------------------------------ the run
def run(cfg):
    """Train as cfg says; returns the final train state (None when output_dir already holds
    --steps steps). SIGTERM / SIGINT stop it cleanly."""
    stop = StopSignal()
    try:
        return _run(cfg, stop)
    finally:
        stop.restore()


def _run(cfg, stop):
    is_main = jax.process_index() == 0
    log = tqdm.write if is_main else (lambda *a, **k: None)  # above the progress bar

    mesh = sharding.make_mesh(cfg.mesh, cfg.model, cfg.batch_size, cfg.grad_accum)
    tokenizer = load_tokenizer(cfg.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"tokenizer '{cfg.tokenizer}' has {tokenizer.vocab_size} tokens but "
            f"model.vocab_size={cfg.model.vocab_size}; pass --model.vocab_size="
            f"{-(-tokenizer.vocab_size // 128) * 128}")
    train_data, val_data = data.load_dataset(cfg.data, tokenizer, cfg.seq_len)
    prepare_output_dir(cfg)

    trainer = Trainer(cfg, mesh)
    abstract_state, batch_sharding = trainer.abstract_state, trainer.batch_sharding

    mngr = checkpoint.manager(checkpoint.checkpoint_dir(cfg.output_dir), cfg.keep, cfg.keep_every)
    meta = checkpoint.to_json_meta(cfg.model, cfg.tokenizer, cfg)
    start = mngr.latest_step() if cfg.resume == "auto" else None
    with jax.set_mesh(mesh):
        if start is not None:
            saved = ModelConfig.from_dict(checkpoint.read_meta(mngr, start)["model"]).to_dict()
            if saved != cfg.model.to_dict():
                diff = [k for k in saved if saved[k] != cfg.model.to_dict().get(k)]
                raise checkpoint.CheckpointError(
                    f"{cfg.output_dir} holds a checkpoint of a different model (model.{diff[0]}: "
                    f"{saved[diff[0]]} there); use another --output_dir, or --resume=never "
                    "--overwrite")
            if start >= cfg.steps:
                log(f"{cfg.output_dir} is already trained to step {start} (--steps={cfg.steps}); "
                    "nothing to do. Raise --steps to train on.")
                mngr.close()
                return None
            state = checkpoint.restore(mngr, start, abstract_state)
            log(f"resuming from step {start} of {cfg.output_dir}")
        else:
            start = 0
            if cfg.init_from:
                state = trainer.fresh_state(loading.load_weights(
                    cfg.init_from, cfg.model, abstract_state["params"]))
            else:
                state = trainer.fresh_state()

        step_fn, eval_fn = trainer.step_fn, trainer.eval_fn

        def global_batch(rows):
            """This host's rows of a batch -> one global array sharded over (dp, fsdp)."""
            return {k: jax.make_array_from_process_local_data(
                batch_sharding, v, (cfg.batch_size,) + v.shape[1:]) for k, v in rows.items()}

        host_rows = sharding.host_rows(batch_sharding, (cfg.batch_size, cfg.seq_len))

        def evaluate():
            """Mean held-out loss (None without a validation split)."""
            if val_data.num_rows == 0:
                return None
            loss_sum, count = 0.0, 0.0
            for i, full in enumerate(val_data.eval_batches(cfg.batch_size)):
                if cfg.eval_batches and i >= cfg.eval_batches:
                    break
                s, n = eval_fn(state["params"], global_batch(
                    {k: v[host_rows] for k, v in full.items()}))
                loss_sum, count = loss_sum + float(s), count + float(n)
            return loss_sum / max(count, 1.0)

        # Compile ahead of time: the first step's timing stays honest, and XLA's own
        # FLOP count cross-checks the analytic one used for MFU.
        example = global_batch(train_data.batch(start, cfg.batch_size, cfg.seed, rows=host_rows))
        compiled = step_fn.lower(state, example).compile()
        tokens_per_step = cfg.batch_size * cfg.seq_len
        model_flops = cfg.model.flops_per_token(cfg.seq_len) * tokens_per_step
        xla_flops = xla_flops_per_step(compiled, mesh.size, cfg.grad_accum)
        peak = peak_tflops(cfg)
        log(f"model: {cfg.model.model_type}, {sum(x.size for x in jax.tree.leaves(state['params'])):,} "
            f"params; mesh dp,fsdp,tp = {tuple(mesh.shape.values())} over {jax.device_count()} "
            f"devices; FLOPs/step analytic {model_flops:.3g}, XLA {xla_flops:.3g}")

        if is_main:
            with fsspec.open(cfg.output_dir.rstrip("/") + "/config.json", "w") as f:
                f.write(json.dumps({"argv": sys.argv[1:], **flags.to_dict(cfg)}, indent=2))
        metrics_log = MetricsLog(cfg.output_dir.rstrip("/") + "/metrics.jsonl", start) \
            if is_main else None
        if start == 0:
            val_loss = evaluate()  # every process: evaluation is a collective
            if val_loss is not None and is_main:
                metrics_log.write({"step": 0, "val_loss": val_loss})
                log(f"step 0: val_loss {val_loss:.4f}")

        if stop.agreed():  # signalled during setup: nothing new to save
            log(f"stopped by signal before step {start + 1}; nothing new to save. Re-run the "
                "same command to resume.")
            mngr.close()
            return state
        bar = tqdm(total=cfg.steps, initial=start, disable=not is_main, dynamic_ncols=True)
        window_start, window_steps = time.perf_counter(), 0
        step = start
        while step < cfg.steps:
            rows = train_data.batch(step, cfg.batch_size, cfg.seed, rows=host_rows)
            sharding.debug_log_rows(step, host_rows, rows)
            state, metrics = compiled(state, global_batch(rows))
            metrics = jax.device_get(metrics)
            step += 1
            window_steps += 1
            bar.update(1)
            if metrics["skipped"]:
                log(f"step {step}: skipped the update (loss {metrics['loss']}, grad_norm "
                    f"{metrics['grad_norm']}); {metrics['bad_steps']} bad in a row")

            if step % cfg.log_every == 0 or step == cfg.steps:
                elapsed = time.perf_counter() - window_start
                tps = tokens_per_step * window_steps / elapsed
                record = {"step": step, "loss": float(metrics["loss"]), "lr": float(metrics["lr"]),
                          "grad_norm": float(metrics["grad_norm"]),
                          "tokens": step * tokens_per_step, "tokens_per_sec": tps,
                          "tflops_per_device": model_flops / tokens_per_step * tps
                          / mesh.size / 1e12}
                if peak:
                    record["mfu"] = record["tflops_per_device"] / peak
                if metrics["skipped"]:
                    record["skipped"] = True
                if (cfg.eval_every and step % cfg.eval_every == 0 or step == cfg.steps) and \
                        val_data.num_rows:
                    record["val_loss"] = evaluate()
                if is_main:
                    metrics_log.write(record)
                bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{tps:,.0f}")
                window_start, window_steps = time.perf_counter(), 0
            if metrics["bad_steps"] >= cfg.max_bad_steps:
                mngr.wait_until_finished()
                last = mngr.latest_step()
                where = (f"{checkpoint.checkpoint_dir(cfg.output_dir)}/{last}" if last is not None
                         else "none yet")
                sys.exit(f"error: {cfg.max_bad_steps} bad steps in a row at step {step} (non-"
                         f"finite or spiking loss); last good checkpoint: {where}. Lower "
                         "--optimizer.lr or check the data, then re-run to resume from it")

            stopping = stop.agreed()
            periodic = cfg.save_every and step % cfg.save_every == 0 and not metrics["bad_steps"]
            if step == cfg.steps or stopping or periodic:  # (no periodic save mid bad streak)
                checkpoint.save(mngr, step, state, meta)
            if stopping:
                break
        bar.close()
        mngr.wait_until_finished()
        mngr.close()
        if step < cfg.steps:
            log(f"stopped by signal at step {step}; checkpoint saved in "
                f"{checkpoint.checkpoint_dir(cfg.output_dir)}/{step}. Re-run the same command "
                "to resume from it.")
            return state
        log(f"done: {step} steps; checkpoint in {checkpoint.checkpoint_dir(cfg.output_dir)}/{step}")

        if cfg.export_hf:
            from trainer import hf
            hf.export(state["params"], cfg.model, cfg.tokenizer, cfg.export_hf)
            log(f"exported Hugging Face model to {cfg.export_hf}")
            if cfg.push_to_hub:
                hf.push_to_hub(cfg.export_hf, cfg.push_to_hub)
    return state


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "--helpfull") for a in argv):
        print(flags.help_text("trainer.train", TrainConfig))
        return
    try:
        # Joining the other hosts comes before any JAX call, reading --init_from included.
        hosts = flags.parse(TrainConfig, [f"--{k}={v}" for k, v in flags.split_args(argv)
                                          if k in ("coordinator_address", "num_processes",
                                                   "process_id")])
        sharding.init_distributed(hosts.coordinator_address, hosts.num_processes,
                                  hosts.process_id)
        jax.config.update("jax_threefry_partitionable", True)
        run(resolve_config(argv))
    except UserError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
