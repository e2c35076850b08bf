"""python -m trainer.train: train or fine-tune a LLaMA-family model.

flags -> mesh -> tokenizer and data -> state (fresh, HF import or checkpoint) ->
jax.jit(train_step) -> loop: batch(step) -> step -> log -> checkpoint -> HF export.

`train_step` is a pure single-device function; the mesh enters only through
jax.jit's shardings. Run with --help for every flag.
"""

import concurrent.futures
import dataclasses
import functools
import json
import math
import os
import signal
import sys
import threading
import time
import typing

import fsspec
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from trainer import attention, checkpoint, data, dpo, flags, loading, lora, optim, sharding
from trainer import storage
from trainer.config import TrainConfig, parse_mix
from trainer.errors import UserError
from trainer.families import ModelConfig
from trainer.flags import ConfigError
from trainer.model import DTYPES, batch_loss, build_model, loss_chunk_for
from trainer.tokenizer import load_tokenizer

# Peak dense bf16 TFLOP/s per device, for MFU, by a part of jax's device_kind (the longest
# match wins: "TPU v5 lite" is a v5e, "TPU v5" a v5p). Override with --peak_tflops.
PEAK_TFLOPS = {"TPU v4": 275, "TPU v5 lite": 197, "TPU v5e": 197, "TPU v5": 459, "TPU v5p": 459,
               "TPU v6 lite": 918, "TPU v6e": 918, "A100": 312, "H100": 989, "H100 PCIe": 756,
               "H100 NVL": 835, "H200": 989, "H200 NVL": 835, "B200": 2250}


# ------------------------------------------------------------------ the step
class Objective(typing.NamedTuple):
    """What the step minimises. loss(params, state, batch, dropout_rng) -> (loss summed over
    the batch, how many things it was summed over, {name: sum} of the `metrics` named here);
    the step divides all of them by the global count."""
    loss: typing.Callable
    metrics: tuple = ()


def make_objective(cfg, model, trainable):
    """Next-token loss on the masked targets, or DPO for --data.format=preference (its
    reference: the base model with LoRA's adapters off, else the params with a frozen copy
    of the starting values of the trainable ones)."""
    if cfg.data.mix:  # rows say their source: the loss per source too
        names = [name for name, _, _ in parse_mix(cfg.data.mix)]

        def mixture_objective(params, state, batch, rng):
            if "source" not in batch:  # held-out rows are scored one source at a time
                return *batch_loss(model, params, batch, rng), {}
            losses, counts = batch_loss(model, params, batch, rng, per_row=True)
            sums = {}
            for i, name in enumerate(names):
                rows = batch["source"] == i
                sums[f"loss_sum.{name}"] = jnp.sum(jnp.where(rows, losses, 0.0))
                sums[f"tokens.{name}"] = jnp.sum(jnp.where(rows, counts, 0.0))
            return jnp.sum(losses), jnp.sum(counts), sums
        return Objective(mixture_objective, tuple(
            f"{kind}.{name}" for name in names for kind in ("loss_sum", "tokens")))
    if cfg.data.format != "preference":
        return Objective(lambda params, state, batch, rng: (
            *batch_loss(model, params, batch, rng), {}))

    def dpo_objective(params, state, batch, rng):
        reference = (lora.adapters_off(params) if cfg.lora.rank else
                     lora.join(state["ref_params"], lora.split(params, trainable)[1]))
        return dpo.dpo_loss(model, params, reference, batch, cfg.dpo.beta, rng)
    return Objective(dpo_objective, dpo.METRICS)


def train_step(state, batch, *, objective, trainable, optimizer, schedule, grad_accum,
               spike_sigma, dropout=False, nan_steps=(), grad_shardings=None, inspect=None):
    """One optimizer step over the global batch, in grad_accum micro-batches.

    state: {'params', 'opt_state', 'step', 'rng', 'bad_steps', 'loss_mean', 'loss_var'}
    (+ 'ref_params': DPO's reference without LoRA)
    batch: {'inputs', 'targets', 'loss_mask'}, each [B, T] ([B, 2, T] for DPO's pairs)
    trainable: the mask (lora.py) of the params that train; only they get gradients and
    optimizer state. dropout: LoRA dropout is on (its randomness comes from state['rng']).
    A non-finite loss or gradient (or, with spike_sigma > 0, a loss spike) skips the
    update and counts a bad step; a good step resets the count.
    nan_steps (testing aid, --debug_nan_steps): steps, numbered as logged, whose loss and
    gradients are made NaN.
    grad_shardings: the trainable params' shardings: gradients and their float32 sums are
    held split like their parameters from the moment they exist, never whole on a device.
    inspect(name, tree) (testing aid) sees them inside the step.
    """
    poison = jnp.where(jnp.isin(state["step"] + 1, jnp.asarray(nan_steps, jnp.int32)),
                       jnp.nan, 1.0) if nan_steps else 1.0
    train_params, frozen_params = lora.split(state["params"], trainable)
    like_params = ((lambda tree: tree) if grad_shardings is None else
                   (lambda tree: jax.lax.with_sharding_constraint(tree, grad_shardings)))
    inspect = inspect or (lambda name, tree: None)

    def micro_loss(train_params, micro, index):
        rng = jax.random.fold_in(state["rng"], index) if dropout else None
        loss_sum, n, sums = objective.loss(lora.join(train_params, frozen_params), state,
                                           micro, rng)
        return loss_sum * poison, (n, sums)

    def accumulate(carry, micro_and_index):
        grad_sum, loss_sum, count, sums_total = carry
        (loss, (n, sums)), grads = jax.value_and_grad(micro_loss, has_aux=True)(
            train_params, *micro_and_index)
        grads = like_params(grads)
        inspect("grads", grads)
        grad_sum = like_params(jax.tree.map(lambda s, g: s + g.astype(jnp.float32), grad_sum,
                                            grads))
        inspect("grad_sum", grad_sum)
        sums_total = {k: sums_total[k] + sums[k] for k in sums_total}
        return (grad_sum, loss_sum + loss, count + n, sums_total), None

    # Gradients add up in float32, whatever the parameter dtype.
    zeros = like_params(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), train_params))
    carry = (zeros, jnp.float32(0), jnp.float32(0),
             {k: jnp.float32(0) for k in objective.metrics})
    if grad_accum == 1:  # no loop: XLA fuses the backward pass with what follows
        (grad_sum, loss_sum, count, sums), _ = accumulate(carry, (batch, 0))
    else:
        # [B, ...] -> [A, B/A, ...] such that every micro-batch keeps each device's rows.
        micro_batches = jax.tree.map(
            lambda x: x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1),
            batch)
        (grad_sum, loss_sum, count, sums), _ = jax.lax.scan(
            accumulate, carry, (micro_batches, jnp.arange(grad_accum)))
    count = jnp.maximum(count, 1.0)
    loss = loss_sum / count
    grads = jax.tree.map(lambda g: g / count, grad_sum)
    grad_norm = optax.global_norm(grads)

    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    if spike_sigma > 0:  # after a warm-up of good steps, skip losses far above the running mean
        limit = state["loss_mean"] + spike_sigma * jnp.sqrt(state["loss_var"])
        ok &= (state["good_steps"] < 50) | (loss <= limit)

    updates, opt_state = optimizer.update(grads, state["opt_state"], train_params)
    new_params = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), train_params, updates)
    # Every state leaf keeps its dtype (bf16 params get f32 gradients, so Adam's moments
    # would drift to f32), or the compiled step and its donated buffers no longer fit.
    keep_old = lambda new, old: jax.tree.map(
        lambda n, o: jnp.where(ok, n, o).astype(o.dtype), new, old)

    # Running mean and variance of good losses (for the spike guard).
    rate = jnp.where(state["good_steps"] == 0, 1.0, 0.05)
    delta = loss - state["loss_mean"]
    new_state = {
        **state,
        "params": lora.join(keep_old(new_params, train_params), frozen_params),
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
               "skipped": ~ok, "bad_steps": new_state["bad_steps"],
               **{k: v / count for k, v in sums.items()}}
    return new_state, metrics


def init_state(rng, base=None, *, model, optimizer, seq_len, trainable, base_dtype="",
               reference=False):
    """A fresh train state: random weights, or `base` (loaded weights: all but any new LoRA
    adapters). Frozen weights are stored in base_dtype; only trainable ones get optimizer
    state. reference: keep a frozen copy of the starting weights (DPO without LoRA)."""
    params = model.init(rng, jnp.zeros((1, seq_len), jnp.int32))["params"]
    if base is not None:
        params = lora.join(lora.only_adapters(params), base)
    params = lora.cast_frozen(params, trainable, base_dtype and DTYPES[base_dtype])
    train_params = lora.split(params, trainable)[0]
    state = {"params": params, "opt_state": optimizer.init(train_params),
             "step": jnp.int32(0), "rng": jax.random.fold_in(rng, 1), "bad_steps": jnp.int32(0),
             "good_steps": jnp.int32(0), "loss_mean": jnp.float32(0),
             "loss_var": jnp.float32(0)}
    if reference:  # (the frozen weights are their own reference)
        state["ref_params"] = jax.tree.map(jnp.copy, train_params)
    return state


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
    named = flags.given(argv)  # flags that would silently do nothing
    idle = sorted(n for n in named if n.startswith("lora.") and n != "lora.rank"
                  and not cfg.lora.rank)
    idle += ["dpo.beta"] if "dpo.beta" in named and cfg.data.format != "preference" else []
    if idle:
        raise ConfigError(f"--{idle[0]} has no effect without "
                          + ("--lora.rank" if idle[0].startswith("lora.") else
                             "--data.format=preference"))
    why = attention.unsupported(cfg.attention, DTYPES[cfg.dtype], cfg.seq_len,
                                cfg.model.head_dim)
    if why:
        raise ConfigError(f"--attention={cfg.attention}: {why}; use --attention=auto")
    from trainer import hf
    exports = [(f, getattr(cfg, f)) for f in ("export_hf", "export_peft") if getattr(cfg, f)]
    for i, (name, path) in enumerate(exports):  # each export its own dir, outside the run's
        for other, there in [("output_dir", cfg.output_dir)] + exports[i + 1:]:
            a, b = path.rstrip("/") + "/", there.rstrip("/") + "/"
            if a.startswith(b) or b.startswith(a):
                raise ConfigError(f"--{name}={path} and --{other}={there} overlap; give each "
                                  "its own dir")
    if cfg.export_peft and not (cfg.init_from and loading.kind(cfg.init_from) == "hf"):
        raise ConfigError("--export_peft writes adapters for the Hugging Face model they were "
                          "trained on; pass that dir as --init_from (or use --export_hf)")
    try:  # fail now, not after training
        if cfg.export_hf:
            hf.check_export_dir(cfg.export_hf)
            hf.hf_config(cfg.model, "float32")
    except hf.HFError as e:
        raise ConfigError(f"--export_hf: {e}") from None
    try:
        if cfg.export_peft:
            hf.check_export_dir(cfg.export_peft, peft=True)
            hf.peft_modules(cfg.model, cfg.lora.targets)
    except hf.HFError as e:
        raise ConfigError(f"--export_peft: {e}") from None
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
        self.local = storage.is_local(path)
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


STOP_CHECK_EVERY = 10  # steps between multi-host stop agreements (a spot VM gives ~30 s)


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
        # --remat=auto compiles as none here; make_trainer decides it by the device's memory.
        # Scanned layers are what bound memory (see model.Transformer._scanned_blocks); on
        # one device without remat, unrolled layers run faster.
        scan = cfg.scan_layers == "true" or (cfg.scan_layers == "auto" and (
            mesh.shape["fsdp"] * mesh.shape["tp"] > 1 or cfg.remat not in ("auto", "none")))
        cfg = dataclasses.replace(cfg, remat="none" if cfg.remat == "auto" else cfg.remat,
                                  scan_layers=str(scan).lower())
        self.cfg = cfg
        batch_shards = mesh.shape["dp"] * mesh.shape["fsdp"]
        rows_per_device = cfg.batch_size // cfg.grad_accum // batch_shards
        if cfg.data.format == "preference":
            rows_per_device *= 2  # each row is a pair of sequences
        chunk = cfg.loss_chunk or loss_chunk_for(rows_per_device, cfg.seq_len,
                                                 cfg.model.vocab_size)
        self.model = build_model(cfg.model, cfg.dtype, cfg.param_dtype, cfg.remat, cfg.attention,
                                 chunk, cfg.lora, scan)
        self.optimizer, self.schedule = optim.make_optimizer(cfg.optimizer, cfg.steps)
        self.rng = jax.random.PRNGKey(cfg.seed)
        param_shapes = jax.eval_shape(self.model.init, self.rng,
                                      jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]
        if cfg.lora.rank:
            lora.check_targets(param_shapes, cfg.lora)
        self.trainable = lora.trainable_mask(param_shapes, cfg.lora.rank, cfg.freeze)
        objective = make_objective(cfg, self.model, self.trainable)
        init_fn = functools.partial(
            init_state, model=self.model, optimizer=self.optimizer, seq_len=cfg.seq_len,
            trainable=self.trainable, base_dtype=cfg.lora.base_dtype if cfg.lora.rank else "",
            reference=cfg.data.format == "preference" and not cfg.lora.rank)
        shapes = jax.eval_shape(init_fn, self.rng)
        self.state_shardings = sharding.state_shardings(
            shapes, mesh, sharding.param_rules(cfg.model, mesh))
        self.abstract_state = checkpoint.abstract_with_shardings(shapes, self.state_shardings)
        self.batch_sharding = sharding.batch_sharding(mesh)
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        # A fresh state is created in its sharded layout: no device ever holds all of it.
        self._init = jax.jit(init_fn, out_shardings=self.state_shardings)
        self.step_args = dict(objective=objective, trainable=self.trainable,
                              optimizer=self.optimizer, schedule=self.schedule,
                              grad_accum=cfg.grad_accum, spike_sigma=cfg.spike_sigma,
                              dropout=bool(cfg.lora.rank and cfg.lora.dropout),
                              nan_steps=cfg.debug_nan_steps,
                              grad_shardings=lora.split(self.state_shardings["params"],
                                                        self.trainable)[0])
        self.step_fn = jax.jit(functools.partial(train_step, **self.step_args),
                               in_shardings=(self.state_shardings, self.batch_sharding),
                               out_shardings=(self.state_shardings, replicated),
                               donate_argnums=0)
        self.eval_fn = jax.jit(lambda state, batch: objective.loss(state["params"], state,
                                                                   batch, None)[:2],
                               in_shardings=(self.state_shardings, self.batch_sharding))

    def compile_abstract(self, options=None):
        """The step compiled for abstract state and batch shapes: no weights, no data."""
        cfg = self.cfg
        batch = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=self.batch_sharding)
                 for k, (shape, dtype) in data.batch_shapes(cfg.data, cfg.batch_size,
                                                            cfg.seq_len).items()}
        return self.step_fn.lower(self.abstract_state, batch).compile(options)

    def fresh_state(self, base=None):
        """A new train state around random weights, or `base`: the loaded weights of every
        parameter but LoRA's adapters (lora.without_adapters), created sharded."""
        return self._init(self.rng) if base is None else self._init(self.rng, base)

    @property
    def abstract_base(self):
        """What a model source must provide: the params without adapters, sharded."""
        return lora.without_adapters(self.abstract_state["params"])


def step_bytes(memory):
    """Per-device bytes a compiled step needs at its peak (from memory_analysis()): its
    arguments (state and batch) and temporaries; the new state is written into the
    donated old one."""
    return (memory.argument_size_in_bytes + memory.temp_size_in_bytes +
            max(0, memory.output_size_in_bytes - memory.alias_size_in_bytes))


def device_memory():
    """The memory of one local device in bytes, or None where the backend doesn't say
    (CPU: host memory, no fixed budget)."""
    stats = jax.local_devices()[0].memory_stats()
    return (stats or {}).get("bytes_limit")


def make_trainer(cfg, mesh, budget=None, log=print):
    """The Trainer for cfg, with --remat=auto decided: none when the step compiled without
    remat fits `budget` bytes per device (default: the device's memory), else full."""
    trainer = Trainer(cfg, mesh)
    if cfg.remat == "offload" and jax.devices()[0].platform == "cpu":
        log("remat: offload runs as full here (the CPU backend has no separate host memory)")
    if cfg.remat != "auto":
        return trainer
    budget = budget or device_memory()
    if budget is None:
        log("remat: none (--remat=auto; this backend has no fixed memory budget)")
        return trainer
    with jax.set_mesh(mesh):
        needed = step_bytes(trainer.compile_abstract().memory_analysis())
    gib = lambda n: f"{n / 2 ** 30:.1f} GiB"  # noqa: E731
    if needed <= budget:
        log(f"remat: none (--remat=auto; the step needs {gib(needed)} of {gib(budget)} "
            "per device)")
        return trainer
    log(f"remat: full (--remat=auto; without it the step needs {gib(needed)} per device, "
        f"{gib(budget)} available)")
    return Trainer(dataclasses.replace(cfg, remat="full"), mesh)


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
    # (Before any file is written: it checks --lora and --freeze.)
    trainer = make_trainer(cfg, mesh, log=log)
    prepare_output_dir(cfg)
    mngr = checkpoint.manager(checkpoint.checkpoint_dir(cfg.output_dir), cfg.keep, cfg.keep_every)
    with jax.set_mesh(mesh), BatchFeed(cfg, train_data, trainer.batch_sharding) as feed:
        state, start = restore_or_init(cfg, trainer, mngr, log)
        if state is None:
            return None
        if start >= cfg.steps:  # trained, but its export was cut off
            mngr.close()
            export_at_end(cfg, state, log)
            return state
        batch = feed.get(start)
        compiled, flops_per_step = compile_step(cfg, trainer, state, batch, mesh, log)
        write_run_config(cfg)
        steplog = StepLog(cfg, start, flops_per_step, mesh.size, is_main, log,
                          data_fields=train_data.epochs)
        evaluate = functools.partial(held_out_loss, cfg, trainer, val_data, feed)
        if start == 0:
            steplog.val_loss(0, evaluate(state))  # the untrained model; every process takes part
        if stop.agreed():  # signalled during setup: nothing new to save
            log(f"stopped by signal before step {start + 1}; nothing new to save. Re-run the "
                "same command to resume.")
            mngr.close()
            return state
        saves = SavePolicy(cfg, mngr)

        # The loop: the next batch is prepared while the device runs this step, and
        # metrics come back to the host only on logging steps.
        step = start
        try:
            while step < cfg.steps:
                state, metrics = compiled(state, batch)
                step += 1
                if not cfg.async_loop:  # wait for the device, every step
                    metrics = jax.device_get(metrics)
                elif step < cfg.steps:
                    feed.prefetch(step)
                steplog.add(metrics)
                # Several hosts agree on stopping through a collective, which waits for the
                # device: on logging steps and every STOP_CHECK_EVERY steps only.
                stopping = (jax.process_count() == 1 or steplog.due(step)
                            or step % STOP_CHECK_EVERY == 0) and stop.agreed()
                if steplog.due(step):
                    steplog.write(step, lambda: evaluate(state))
                if saves.due(step, stopping, metrics):
                    saves.save(step, state)
                if stopping:
                    break
                batch = feed.get(step) if step < cfg.steps else None
        except TooManyBadSteps as e:
            mngr.wait_until_finished()
            last = mngr.latest_step()
            where = (f"{checkpoint.checkpoint_dir(cfg.output_dir)}/{last}" if last is not None
                     else "none yet")
            raise UserError(f"{cfg.max_bad_steps} bad steps in a row at step {e.step} (non-"
                            f"finite or spiking loss); last good checkpoint: {where}. Lower "
                            "--optimizer.lr or check the data, then re-run to resume from it")
        finally:
            steplog.close()
        mngr.wait_until_finished()
        mngr.close()
    if step < cfg.steps:
        log(f"stopped by signal at step {step}; checkpoint saved in "
            f"{checkpoint.checkpoint_dir(cfg.output_dir)}/{step}. Re-run the same command "
            "to resume from it.")
        return state
    log(f"done: {step} steps; checkpoint in {checkpoint.checkpoint_dir(cfg.output_dir)}/{step}")
    export_at_end(cfg, state, log)
    return state


# ------------------------------------------------------------------ the loop's parts
def restore_or_init(cfg, trainer, mngr, log):
    """(state, start step): the newest checkpoint in output_dir, else fresh weights or
    --init_from's. (None, step) when output_dir is already trained to --steps."""
    start = mngr.latest_step() if cfg.resume == "auto" else None
    if start is None:
        if cfg.init_from:
            return trainer.fresh_state(loading.load_weights(
                cfg.init_from, cfg.model, trainer.abstract_base)), 0
        return trainer.fresh_state(), 0
    meta = checkpoint.read_meta(mngr, start)
    saved = ModelConfig.from_dict(meta["model"]).to_dict()
    if saved != cfg.model.to_dict():
        diff = [k for k in saved if saved[k] != cfg.model.to_dict().get(k)]
        raise checkpoint.CheckpointError(
            f"{cfg.output_dir} holds a checkpoint of a different model (model.{diff[0]}: "
            f"{saved[diff[0]]} there); use another --output_dir, or --resume=never --overwrite")
    theirs = meta.get("config", {})
    lora_there, format_there = theirs.get("lora", {}), theirs.get("data", {}).get("format")
    same_state = {  # flag: (this run's value, the checkpoint's, whether they make one state)
        "lora.rank": (cfg.lora.rank, lora_there.get("rank", 0), None),
        "lora.targets": (cfg.lora.targets, lora_there.get("targets", cfg.lora.targets), None),
        "lora.base_dtype": (cfg.lora.base_dtype, lora_there.get("base_dtype", ""), None),
        "freeze": (cfg.freeze, theirs.get("freeze", ""), None),
        "data.format": (cfg.data.format, format_there or cfg.data.format,
                        (cfg.data.format == "preference") == (format_there == "preference"))}
    for name, (mine, there, compatible) in same_state.items():
        if not (compatible if compatible is not None else mine == there):
            raise checkpoint.CheckpointError(
                f"{cfg.output_dir} holds a checkpoint trained with --{name}={there} (this run: "
                f"{mine}); use another --output_dir, or --resume=never --overwrite")
    if start >= cfg.steps:
        if not missing_exports(cfg):
            log(f"{cfg.output_dir} is already trained to step {start} (--steps={cfg.steps}); "
                "nothing to do. Raise --steps to train on.")
            mngr.close()
            return None, start
        log(f"{cfg.output_dir} is already trained to step {start}; exporting it")
    log(f"resuming from step {start} of {cfg.output_dir}")
    return checkpoint.restore(mngr, start, trainer.abstract_state), start


class BatchFeed:
    """The batch for step k (a pure function of data, seed and k) as global arrays sharded
    over (dp, fsdp): each host builds only its own rows. `prefetch` builds one in a
    background thread, so the host is done before the device asks."""

    def __init__(self, cfg, dataset, batch_sharding):
        self.cfg, self.dataset, self.sharding = cfg, dataset, batch_sharding
        self.rows = sharding.host_rows(batch_sharding, (cfg.batch_size, cfg.seq_len))
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self.pending = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.pool.shutdown(wait=True, cancel_futures=True)

    def to_global(self, host_batch):
        """This host's rows -> one global array per key."""
        return {k: jax.make_array_from_process_local_data(
            self.sharding, v, (self.cfg.batch_size,) + v.shape[1:]) for k, v in host_batch.items()}

    def _build(self, step):
        rows = self.dataset.batch(step, self.cfg.batch_size, self.cfg.seed, rows=self.rows)
        sharding.debug_log_rows(step, self.rows, rows)
        return self.to_global(rows)

    def prefetch(self, step):
        if step not in self.pending:
            self.pending[step] = self.pool.submit(self._build, step)

    def get(self, step):
        self.prefetch(step)
        return self.pending.pop(step).result()


def compile_step(cfg, trainer, state, example, mesh, log):
    """The train step compiled ahead of time (the first step's timing stays honest), and
    the analytic FLOPs per step, cross-checked against XLA's own count in the log."""
    compiled = trainer.step_fn.lower(state, example).compile()
    trainable, frozen = lora.split(state["params"], trainer.trainable)
    frozen_matmul = sum(x.size for p, x in jax.tree_util.tree_flatten_with_path(frozen)[0]
                        if x.ndim >= 2 and (cfg.model.tie_word_embeddings or
                                            not sharding.path_str(p).endswith("embedding")))
    flops = analytic_flops_per_step(cfg, frozen_matmul)
    # (XLA counts a loop body once: with scanned layers its figure is no cross-check.)
    xla = (f"XLA {xla_flops_per_step(compiled, mesh.size, cfg.grad_accum):.3g}"
           if trainer.cfg.scan_layers == "false" else "layers scanned")
    params = sum(x.size for x in jax.tree.leaves(state["params"]))
    trains = sum(x.size for x in jax.tree.leaves(trainable))
    kernel = attention.choose(cfg.attention, DTYPES[cfg.dtype], cfg.seq_len, cfg.model.head_dim)
    log(f"model: {cfg.model.model_type}, {params:,} params ({trains:,} trainable); mesh dp,fsdp,tp = "
        f"{tuple(mesh.shape.values())} over {jax.device_count()} devices; attention: {kernel}; "
        f"FLOPs/step analytic {flops:.3g}, {xla}")
    return compiled, flops


def tokens_per_step(cfg):
    """Tokens a step trains on: batch_size rows of seq_len (a preference row: two)."""
    return cfg.batch_size * cfg.seq_len * (2 if cfg.data.format == "preference" else 1)


def analytic_flops_per_step(cfg, frozen_matmul_params):
    """PaLM-style training FLOPs of a step: flops_per_token (6 per matmul parameter, plus
    attention), minus the weight gradients frozen weights skip (2 per parameter), plus
    DPO's reference forward pass (a third of the whole)."""
    per_token = cfg.model.flops_per_token(cfg.seq_len)
    reference = per_token / 3 if cfg.data.format == "preference" else 0
    return (per_token - 2 * frozen_matmul_params + reference) * tokens_per_step(cfg)


def write_run_config(cfg):
    """config.json: the exact flags of the run (process 0)."""
    if jax.process_index() == 0:
        with fsspec.open(cfg.output_dir.rstrip("/") + "/config.json", "w") as f:
            f.write(json.dumps({"argv": sys.argv[1:], **flags.to_dict(cfg)}, indent=2))


def held_out_loss(cfg, trainer, val_data, feed, state):
    """{"val_loss": mean loss over (up to --eval_batches of) the validation rows}, plus
    "val_loss.<name>" for each source of a --data.mix (val_loss: their token-weighted
    mean); {} without any rows."""
    mixture = hasattr(val_data, "parts")
    out, total = {}, [0.0, 0.0]
    for name, part in (val_data.parts if mixture else {"": val_data}).items():
        if part.num_rows == 0:
            continue
        loss_sum, count = 0.0, 0.0
        for i, full in enumerate(part.eval_batches(cfg.batch_size)):
            if cfg.eval_batches and i >= cfg.eval_batches:
                break
            s, n = trainer.eval_fn(state, feed.to_global(
                {k: v[feed.rows] for k, v in full.items()}))
            loss_sum, count = loss_sum + float(s), count + float(n)
        out[f"val_loss.{name}" if mixture else "val_loss"] = loss_sum / max(count, 1.0)
        total = [total[0] + loss_sum, total[1] + count]
    if mixture and out:
        out = {"val_loss": total[0] / max(total[1], 1.0), **out}
    return out


class StepLog:
    """What a logging step reports: metrics.jsonl (process 0), the progress bar, skipped
    updates, throughput and MFU; and the bad-step limit, checked as steps are logged."""

    def __init__(self, cfg, start, flops_per_step, num_devices, is_main, log, data_fields=None):
        self.cfg, self.log, self.is_main = cfg, log, is_main
        self.pending = []  # each step's metrics since the last log, still on the device
        self.flops_per_token = flops_per_step / tokens_per_step(cfg)
        self.num_devices, self.peak = num_devices, peak_tflops(cfg)
        self.metrics = (MetricsLog(cfg.output_dir.rstrip("/") + "/metrics.jsonl", start)
                        if is_main else None)
        self.bar = tqdm(total=cfg.steps, initial=start, disable=not is_main, dynamic_ncols=True)
        self.window_start, self.window_from = time.perf_counter(), start
        self.data_fields = data_fields  # (step, batch_size) -> epochs seen (per source)

    def due(self, step):
        return step % self.cfg.log_every == 0 or step == self.cfg.steps

    def val_loss(self, step, losses):
        if losses and self.is_main:
            self.metrics.write({"step": step, **losses})
            self.log(f"step {step}: val_loss {losses['val_loss']:.4f}")
        self.window_start = time.perf_counter()  # evaluation time is not training throughput

    def add(self, metrics):
        self.pending.append(metrics)

    def write(self, step, evaluate):
        """Fetch the metrics of every step since the last log (one transfer), report skipped
        updates and the bad-step limit step by step, and log this step."""
        cfg = self.cfg
        history, self.pending = jax.device_get(self.pending), []
        elapsed = time.perf_counter() - self.window_start
        tokens = tokens_per_step(cfg)
        tps = tokens * (step - self.window_from) / elapsed
        self.bar.update(step - self.bar.n)
        too_many = None  # the first step that reached --max_bad_steps
        for at, m in enumerate(history, start=step - len(history) + 1):
            if m["skipped"]:
                self.log(f"step {at}: skipped the update (loss {m['loss']}, grad_norm "
                         f"{m['grad_norm']}); {m['bad_steps']} bad in a row")
            if m["bad_steps"] >= cfg.max_bad_steps and too_many is None:
                too_many = at
        metrics = history[-1]
        record = {"step": step, "loss": float(metrics["loss"]), "lr": float(metrics["lr"]),
                  "grad_norm": float(metrics["grad_norm"]), "tokens": step * tokens,
                  "tokens_per_sec": tps,
                  "tflops_per_device": self.flops_per_token * tps / self.num_devices / 1e12}
        if self.peak:
            record["mfu"] = record["tflops_per_device"] / self.peak
        record.update({k: float(v) for k, v in metrics.items() if k in dpo.METRICS})
        for key in metrics:  # --data.mix: the training loss of each source's rows
            if key.startswith("loss_sum.") and float(metrics["tokens." + key[9:]]) > 0:
                record["loss." + key[9:]] = float(metrics[key] / metrics["tokens." + key[9:]])
        if metrics["skipped"]:
            record["skipped"] = True
        if self.data_fields:
            record |= self.data_fields(step, cfg.batch_size)
        if cfg.eval_every and step % cfg.eval_every == 0 or step == cfg.steps:
            record |= evaluate()  # every process: evaluation is a collective
        if self.is_main:
            self.metrics.write(record)
        self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{tps:,.0f}")
        self.window_start, self.window_from = time.perf_counter(), step
        if too_many is not None:
            raise TooManyBadSteps(too_many)

    def close(self):
        self.bar.close()


class TooManyBadSteps(Exception):
    """--max_bad_steps reached; the run names its last good checkpoint and stops."""

    def __init__(self, step):
        super().__init__(step)
        self.step = step


class SavePolicy:
    """When to checkpoint: every --save_every steps (not during a streak of bad steps),
    at the end, and when a stop signal arrives. Saves are asynchronous."""

    def __init__(self, cfg, mngr):
        self.cfg, self.mngr = cfg, mngr
        self.meta = checkpoint.to_json_meta(cfg.model, cfg.tokenizer, cfg)

    def due(self, step, stopping, metrics):
        if step == self.cfg.steps or stopping:
            return True
        if self.cfg.save_every and step % self.cfg.save_every == 0:
            return not int(metrics["bad_steps"])  # (a host sync, on save steps only)
        return False

    def save(self, step, state):
        checkpoint.save(self.mngr, step, state, self.meta)


def missing_exports(cfg):
    """A finished run stopped before its export (a spot VM taken away) still owes one.
    Process 0 writes exports, so it decides for every process."""
    from trainer import hf
    missing = bool((cfg.export_hf and not hf.is_hf_dir(cfg.export_hf))
                   or (cfg.export_peft and not hf.is_peft_dir(cfg.export_peft)))
    if jax.process_count() == 1:
        return missing
    from jax.experimental import multihost_utils
    return bool(multihost_utils.broadcast_one_to_all(np.array(missing)))


def export_at_end(cfg, state, log):
    """--export_hf (LoRA: the merged model), --push_to_hub and --export_peft once training
    is done."""
    from trainer import hf
    if cfg.export_peft:
        hf.export_peft(state["params"], cfg.model, cfg.lora, cfg.tokenizer, cfg.export_peft,
                       base_model=cfg.init_from)
        log(f"exported the LoRA adapters (PEFT) to {cfg.export_peft}")
    if not cfg.export_hf:
        return
    params = lora.merged(state["params"], cfg.lora) if cfg.lora.rank else state["params"]
    hf.export(params, cfg.model, cfg.tokenizer, cfg.export_hf)
    log(f"exported Hugging Face model to {cfg.export_hf}")
    if cfg.push_to_hub:
        hf.push_to_hub(cfg.export_hf, cfg.push_to_hub)


def enable_compile_cache(directory):
    """Keep compiled programs on disk (JAX's persistent compilation cache), so that the same
    run started again skips XLA compilation. Empty: off."""
    if not directory:
        return
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


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
        cfg = resolve_config(argv)
        enable_compile_cache(cfg.compile_cache)
        run(cfg)
    except UserError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
