"""python -m trainer.plan [train flags] [--devices=N] [--device_memory=16GiB]: will it fit?

Compiles the train step for exactly the job the same flags would train, with abstract
shapes: no weights, no data, not a byte of the model allocated. It runs on this machine's
devices, or on N virtual CPU devices (--devices=N) to plan for a slice you don't have yet.
Per device it prints the train state (params, optimizer state, the rest), the step's
temporaries and the total from XLA's compiled memory analysis, the largest buffers of
its buffer assignment, and the README's analytic estimate beside them. With
--device_memory it says whether the job fits, and if not, which flags would help (and
exits with status 2). The last line printed is JSON.

The compiled figures are the backend's own: a CPU plan shows the CPU backend's buffer
assignment, which can differ from what a GPU or TPU compiler does with the same program.
"""

import glob
import json
import os
import re
import shutil
import sys
import tempfile

import jax
import numpy as np

from trainer import flags, lora, sharding, train
from trainer.errors import UserError
from trainer.flags import ConfigError
from trainer.model import DTYPES

PLAN_FLAGS = ("devices", "device_memory")
GiB = 2 ** 30
_UNITS = {"": 1, "b": 1, "k": 2 ** 10, "kb": 10 ** 3, "kib": 2 ** 10, "m": 2 ** 20,
          "mb": 10 ** 6, "mib": 2 ** 20, "g": GiB, "gb": 10 ** 9, "gib": GiB,
          "t": 2 ** 40, "tb": 10 ** 12, "tib": 2 ** 40}


def parse_bytes(text):
    """'16GiB' -> 17179869184; '80GB' -> 8e10; '512' -> 512. None if it isn't a size."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text or "")
    if not match or match.group(2).lower() not in _UNITS:
        return None
    try:
        return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    except ValueError:
        return None


def split_plan_flags(argv):
    """(the plan's own flags {name: value}, the train flags)."""
    own, rest = {}, []
    for name, value in flags.split_args(argv):
        if name in PLAN_FLAGS:
            own[name] = value
        else:
            rest.append(f"--{name}" if value is None else f"--{name}={value}")
    return own, rest


def per_device_bytes(abstract_tree):
    """Bytes one device holds of a tree of ShapeDtypeStructs with shardings (the largest
    share, where shards are uneven)."""
    total = 0
    for leaf in jax.tree.leaves(abstract_tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


def largest_buffers(dump_dir, count=5):
    """[(bytes, description)] of the largest buffers (XLA's logical values) in the step's
    buffer assignment: each with its shape, and whether it is an argument or a temporary."""
    files = glob.glob(os.path.join(dump_dir, "*train_step*buffer-assignment.txt"))
    if not files:
        return []
    found, kind = [], "temporary"
    for line in open(max(files, key=os.path.getsize)):
        # "allocation 3: size 16777216, parameter 0, shape |f32[2048,2048]| ...:" then its
        # values: " value: <10004 param.5 @0> (size=24576,offset=0): f32[384,16]{1,0}"
        if line.startswith("allocation "):
            kind = ("argument" if ", parameter " in line else
                    "output" if "output" in line else "temporary")
        match = re.match(r"\s*value: <\d+ (\S+) [^>]*> \(size=(\d+),offset=\d+\): (\S+?)(\{|$)",
                         line)
        if match:
            name, size, shape = match.group(1), int(match.group(2)), match.group(3)
            found.append((size, f"{kind} {shape} ({name})"))
    return sorted(set(found), reverse=True)[:count]


def _size(n):
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2 ** 20:.1f} MiB"


def analytic(cfg, mesh_shape, trainable_params, total_params):
    """The README's memory math, per device. State: bytes per parameter x N / (fsdp x tp),
    the weights plus two float32 Adam moments for the trainable ones. Temporaries: their
    float32 gradients, sharded the same way, plus activations: the block input every layer
    keeps (remat full; in host memory with offload) or about 16 [rows, T, D]-sized tensors
    per layer (no remat), and one layer's working set. Returns (state, temporaries, the
    block inputs' bytes)."""
    dp, fsdp, tp = mesh_shape
    weight = np.dtype(DTYPES[cfg.param_dtype]).itemsize
    frozen = total_params - trainable_params
    base = (np.dtype(DTYPES[cfg.lora.base_dtype]).itemsize if cfg.lora.rank and
            cfg.lora.base_dtype else weight)
    state = (trainable_params * (weight + 8) + frozen * base) / (fsdp * tp)
    grads = trainable_params * 4 / (fsdp * tp)
    m = cfg.model
    rows = cfg.batch_size // cfg.grad_accum // (dp * fsdp) * (2 if cfg.data.format ==
                                                               "preference" else 1)
    act = np.dtype(DTYPES[cfg.dtype]).itemsize
    token_bytes = rows * cfg.seq_len * act
    block_inputs = m.num_hidden_layers * token_bytes * m.hidden_size
    kept = {"full": 1, "offload": 0}.get(cfg.remat, 16) * block_inputs
    working = token_bytes * (8 * m.hidden_size + 4 * m.intermediate_size // tp)
    return state, grads + kept + working, block_inputs


def advice(cfg, mesh_shape, state, temp, budget, loss_chunk, block_inputs):
    """Flag changes that would bring the total under budget, most effective first, each
    with an estimate of what it saves (a re-plan with the change gives the real figure)."""
    dp, fsdp, tp = mesh_shape
    tips = []
    if dp > 1:
        tips.append((state / 2, f"--mesh={dp // 2},{fsdp * 2},{tp}: fsdp shards the state "
                                "that dp replicates"))
    if not cfg.lora.rank:
        tips.append((state * 0.8, "--lora.rank=16 --lora.base_dtype=bfloat16: train adapters, "
                                  "freeze a bf16 base (about 1/5 of the state)"))
    if cfg.remat == "none":
        tips.append((temp * 0.5, "--remat=full: keep only each block's input for the "
                                 "backward pass"))
    if cfg.remat in ("none", "full"):
        tips.append((block_inputs + (temp * 0.5 if cfg.remat == "none" else 0),
                     "--remat=offload: as full, with the block inputs in host memory "
                     "(GPU/TPU)"))
    rows = cfg.batch_size // cfg.grad_accum // (dp * fsdp)
    if rows > 1:
        tips.append((temp * 0.5, f"--grad_accum={cfg.grad_accum * 2}: half the rows per "
                                 "device at a time"))
    if loss_chunk > 128 and cfg.seq_len % 128 == 0:
        tips.append((temp * 0.05, "--loss_chunk=128: smaller logits chunks"))
    over = state + temp - budget
    tips.sort(key=lambda t: -t[0])
    return [f"{text} (saves ~{_size(saved)}{'' if saved >= over else ', not enough alone'})"
            for saved, text in tips]


def plan(cfg, mesh, budget=None, out=print):
    """Compile cfg's train step on mesh with abstract shapes and report; returns a dict of
    the per-device figures (bytes) and, with budget, 'fits'."""
    trainer = train.make_trainer(cfg, mesh, budget, out)
    cfg = trainer.cfg  # with --remat and --scan_layers decided
    state = trainer.abstract_state
    parts = {"params": per_device_bytes(state["params"]),
             "optimizer": per_device_bytes(state["opt_state"]),
             "other": per_device_bytes({k: v for k, v in state.items()
                                        if k not in ("params", "opt_state")})}
    dump = tempfile.mkdtemp(prefix="meshlm-plan-")
    with jax.set_mesh(mesh):
        compiled = trainer.compile_abstract({"xla_dump_to": dump, "xla_dump_hlo_pass_re": "^$"})
    memory = compiled.memory_analysis()
    state_bytes = sum(parts.values())
    batch_bytes = memory.argument_size_in_bytes - state_bytes
    temp = memory.temp_size_in_bytes
    total = train.step_bytes(memory)
    params = sum(x.size for x in jax.tree.leaves(state["params"]))
    trains = sum(x.size for x in jax.tree.leaves(lora.split(state["params"],
                                                            trainer.trainable)[0]))
    shape = tuple(mesh.shape.values())
    est_state, est_temp, block_inputs = analytic(cfg, shape, trains, params)
    host = memory.host_temp_size_in_bytes

    out(f"plan: {cfg.model.model_type}, {params:,} params ({trains:,} trainable); mesh "
        f"dp,fsdp,tp = {shape} over {mesh.size} {jax.devices()[0].platform} devices; "
        f"batch {cfg.batch_size} x seq {cfg.seq_len}, grad_accum {cfg.grad_accum}, "
        f"dtype {cfg.dtype}, remat {cfg.remat}, layers "
        f"{'scanned' if cfg.scan_layers == 'true' else 'unrolled'}")
    rows = [*((f"state: {name}", value, None) for name, value in parts.items()),
            ("state total", state_bytes, est_state), ("batch", batch_bytes, None),
            ("temporaries", temp, est_temp), ("total", total, est_state + est_temp)]
    if cfg.remat == "offload":
        rows.append(("host memory (offload)", host, block_inputs))
    out(f"per device:{'compiled':>24}{'analytic':>14}")
    for name, value, estimate in rows:
        out(f"  {name:<21}{_size(value):>12}{_size(estimate) if estimate else '':>14}")
    if cfg.remat == "offload" and not host:
        out(f"  ({jax.devices()[0].platform} keeps no separate host memory, so the compiled "
            f"figures are remat full's; on GPU/TPU about {_size(block_inputs)} of block inputs "
            "move to host memory)")
    buffers = largest_buffers(dump)
    shutil.rmtree(dump, ignore_errors=True)
    if buffers:
        out("largest buffers:")
        for size, what in buffers:
            out(f"  {_size(size):>11}  {what}")
    result = {"state": state_bytes, **{f"state_{k}": v for k, v in parts.items()},
              "temp": temp, "total": total, "host": host, "analytic_state": est_state,
              "analytic_temporaries": est_temp, "largest": buffers}
    if budget:
        result["fits"] = total <= budget
        if result["fits"]:
            out(f"fits: {_size(total)} of {_size(budget)} per device ({_size(budget - total)} "
                "to spare)")
        else:
            out(f"does not fit: {_size(total)} per device needed, {_size(budget)} available. "
                "Flags that would help:")
            for tip in advice(cfg, shape, state_bytes, temp, budget, trainer.model.loss_chunk,
                              block_inputs):
                out(f"  {tip}")
    out(json.dumps({k: v for k, v in result.items() if k != "largest"}))
    return result


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip() + "\n\nTrain flags: python -m trainer.train --help")
        return
    try:
        own, train_argv = split_plan_flags(argv)
        devices = own.get("devices")
        if devices is not None:
            if not (devices or "").isdigit() or int(devices) < 1:
                raise ConfigError(f"--devices: expected a positive number of virtual CPU "
                                  f"devices, got '{devices}'")
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", int(devices))
        budget = None
        if "device_memory" in own:
            budget = parse_bytes(own["device_memory"])
            if not budget:
                raise ConfigError(f"--device_memory: expected a size like 16GiB or 80GB, got "
                                  f"'{own['device_memory']}'")
        jax.config.update("jax_threefry_partitionable", True)
        cfg = train.resolve_config(train_argv)
        mesh = sharding.make_mesh(cfg.mesh, cfg.model, cfg.batch_size, cfg.grad_accum)
        result = plan(cfg, mesh, budget)
    except UserError as e:
        sys.exit(f"error: {e}")
    if budget and not result["fits"]:
        sys.exit(2)


if __name__ == "__main__":
    main()
