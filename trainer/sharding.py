"""How the single-device model and step become a multi-device, multi-host program.

Three pieces, all outside the model:
- the mesh: `--mesh=dp,fsdp,tp` over every device of every host;
- PARAM_RULES: one table, regex over a parameter's path -> PartitionSpec;
- LOGICAL_AXES: the mesh axes each named activation axis is split over, used by
  `constrain`, which does nothing when no mesh is set.
"""

import glob
import hashlib
import importlib.util
import json
import os
import re

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from trainer.errors import UserError

MESH_AXES = ("dp", "fsdp", "tp")
BATCH_AXES = ("dp", "fsdp")  # the batch is split over data and fully-sharded-data parallelism


class ShardingError(UserError):
    """A mesh or rule problem; the message is one line naming the fix."""


# ------------------------------------------------------------------ rules
# Weights: "fsdp" splits the hidden (embed) side, "tp" the heads / mlp / vocab side,
# Megatron-style, so one all-reduce per attention and per MLP block suffices.
PARAM_RULES = [
    (r"embed_tokens/embedding$", P("tp", "fsdp")),  # [V, D]
    (r"self_attn/[qkv]_proj/kernel$", P("fsdp", "tp")),  # [D, heads*Dh]
    (r"self_attn/[qkv]_proj/bias$", P("tp")),
    (r"self_attn/o_proj/kernel$", P("tp", "fsdp")),  # [H*Dh, D]
    (r"self_attn/o_proj/bias$", P()),
    (r"mlp/(gate|up)_proj/kernel$", P("fsdp", "tp")),  # [D, F]
    (r"mlp/(gate|up)_proj/bias$", P("tp")),
    (r"mlp/down_proj/kernel$", P("tp", "fsdp")),  # [F, D]
    (r"mlp/down_proj/bias$", P()),
    (r"norm/scale$", P()),  # every RMSNorm
    (r"lm_head/kernel$", P("fsdp", "tp")),  # [D, V]
    (r"^rng$", P()),  # the train state's PRNG key
]

LOGICAL_AXES = {
    "batch": BATCH_AXES,
    "seq": None,
    "embed": None,
    "heads": "tp",
    "mlp": "tp",
    "vocab": "tp",
    "vocab_rows": ("tp", "fsdp"),  # the embedding table's rows, for lookup and scoring
    "replica_batch": "dp",  # the batch where fsdp shards take all rows (vocab-split scoring)
}


# When tp does not divide the kv heads, k/v weights are whole on every tp shard (split
# over fsdp only) and the model repeats kv heads to match (model.kv_repeats).
KV_REPLICATED_RULES = [
    (r"self_attn/[kv]_proj/kernel$", P("fsdp", None)),
    (r"self_attn/[kv]_proj/bias$", P()),
]


def param_rules(model_cfg, mesh):
    """The rule table of one model on one mesh: its family's extra rules, then the kv
    replication rules where tp exceeds what the kv heads allow, then PARAM_RULES."""
    rules = list(model_cfg.family.sharding_rules)
    if model_cfg.num_key_value_heads % mesh.shape["tp"]:
        rules += KV_REPLICATED_RULES
    return rules + PARAM_RULES


def axis_size(logical_axis):
    """How many ways the set mesh splits a logical axis (1 without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = LOGICAL_AXES[logical_axis]
    if mesh.empty or axes is None:
        return 1
    axes = (axes,) if isinstance(axes, str) else axes
    return int(np.prod([mesh.shape[a] for a in axes]))


def constrain(x, logical_axes):
    """Pin an activation's sharding by logical axis names; a no-op without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = P(*(LOGICAL_AXES[name] if name else None for name in logical_axes))
    return jax.lax.with_sharding_constraint(x, spec)


def path_str(path):
    """A pytree key path as 'layers_0/self_attn/q_proj/kernel'."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def _pad(spec, ndim):
    return list(spec) + [None] * (ndim - len(spec))


def _fit(spec, shape, mesh):
    """Drop mesh axes that don't evenly divide their dimension (small biases, odd vocabs)."""
    axes = _pad(spec, len(shape))
    for i, axis in enumerate(axes):
        if axis is not None and shape[i] % mesh.shape[axis]:
            axes[i] = None
    return P(*axes)


def spec_for(path, shape, mesh, rules=PARAM_RULES):
    """The PartitionSpec of one array in the train state: the first rule that matches."""
    if len(shape) == 0:
        return P()  # step counters, RNG keys, optimizer counts
    name = path_str(path)
    if name.endswith(("/lora_a", "/lora_b")):
        # A LoRA adapter follows its kernel's rule: A [in, r] is split like the kernel's
        # input side, B [r, out] like its output side; the small rank is never split.
        kernel = _pad(_rule(name.rsplit("/", 1)[0] + "/kernel", shape, rules), 2)
        spec = P(kernel[0], None) if name.endswith("/lora_a") else P(None, kernel[1])
    else:
        spec = _rule(name, shape, rules)
    if len(spec) > len(shape):  # a factored optimizer statistic of this parameter
        return P()
    return _fit(spec, shape, mesh)


def _rule(name, shape, rules):
    for pattern, spec in rules:
        if re.search(pattern, name):
            return spec
    raise ShardingError(f"parameter '{name}' (shape {tuple(shape)}) matches no rule in "
                        "trainer/sharding.py PARAM_RULES; add one")


def state_shardings(abstract_state, mesh, rules=PARAM_RULES):
    """NamedShardings for a whole pytree (params, or the train state with optimizer moments,
    which follow their parameter's rule because their paths end in the parameter's path).
    rules: param_rules(model_cfg, mesh) for a model's state."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, spec_for(path, leaf.shape, mesh, rules)),
        abstract_state)


def batch_sharding(mesh):
    return NamedSharding(mesh, P(BATCH_AXES))


# ------------------------------------------------------------------ mesh
def parse_mesh(text, num_devices):
    """'1,-1,1' -> (1, num_devices, 1)."""
    try:
        dims = [int(d) for d in text.split(",")]
    except ValueError:
        dims = []
    if len(dims) != 3 or any(d == 0 or d < -1 for d in dims) or dims.count(-1) > 1:
        raise ShardingError(f"--mesh: expected three numbers dp,fsdp,tp (one may be -1), "
                            f"got '{text}'")
    known = int(np.prod([d for d in dims if d != -1]))
    if -1 in dims:
        if num_devices % known:
            raise ShardingError(f"--mesh={text}: {num_devices} devices don't divide by {known}")
        dims[dims.index(-1)] = num_devices // known
    if int(np.prod(dims)) != num_devices:
        raise ShardingError(f"--mesh={text}: dp*fsdp*tp = {int(np.prod(dims))} but there are "
                            f"{num_devices} devices; make the product {num_devices} or use -1")
    return tuple(dims)


def make_mesh(text, model_cfg=None, batch_size=None, grad_accum=1, devices=None):
    """Build the dp/fsdp/tp mesh and check that the model and batch fit it."""
    devices = devices if devices is not None else jax.devices()
    dp, fsdp, tp = parse_mesh(text, len(devices))
    if model_cfg is not None:
        # Each tp shard holds whole query heads (kv heads are repeated when tp exceeds them).
        heads = model_cfg.num_attention_heads
        if heads % tp:
            fits = [d for d in range(1, heads + 1) if heads % d == 0]
            raise ShardingError(f"--mesh={text}: tp={tp} must divide model.num_attention_heads="
                                f"{heads}; use tp in {{{', '.join(map(str, fits))}}}")
    if batch_size is not None:
        rows = dp * fsdp * grad_accum
        if batch_size % rows:
            lower = batch_size // rows * rows
            near = " or ".join(str(b) for b in (lower, lower + rows) if b > 0)
            raise ShardingError(
                f"--batch_size={batch_size} must be a multiple of dp*fsdp*grad_accum = "
                f"{dp}*{fsdp}*{grad_accum} = {rows}; use --batch_size={near}, or change "
                "--mesh or --grad_accum")
    return jax.make_mesh((dp, fsdp, tp), MESH_AXES, axis_types=(AxisType.Auto,) * 3,
                         devices=devices)


def host_rows(sharding, global_shape):
    """The contiguous range of batch rows this process's devices hold."""
    starts, stops = [], []
    for index in sharding.addressable_devices_indices_map(global_shape).values():
        rows = index[0]
        starts.append(rows.start or 0)
        stops.append(global_shape[0] if rows.stop is None else rows.stop)
    lo, hi = min(starts), max(stops)
    held = sum(stop - start for start, stop in set(zip(starts, stops)))
    if held != hi - lo:
        raise ShardingError("this host's batch rows are not contiguous; use a mesh whose "
                            "dp*fsdp devices are grouped by host")
    return slice(lo, hi)


def debug_log_rows(step, rows, host_batch):
    """Test aid (tests/test_multihost.py): with MESHLM_DEBUG_ROWS_LOG=PATH set, each process
    appends the global batch rows it loaded for `step`, and a digest of them, to
    PATH.<process index>. Does nothing otherwise."""
    path = os.environ.get("MESHLM_DEBUG_ROWS_LOG")
    if not path:
        return
    record = {"process": jax.process_index(), "step": step, "rows": [rows.start, rows.stop],
              "loaded": len(host_batch["inputs"]),
              "sha1": hashlib.sha1(host_batch["inputs"].tobytes()).hexdigest()}
    with open(f"{path}.{jax.process_index()}", "a") as f:
        f.write(json.dumps(record) + "\n")


# ------------------------------------------------------------------ multi-host
def init_distributed(coordinator_address="", num_processes=0, process_id=-1):
    """Join JAX's distributed runtime, so that every process sees every device of the job.

    Explicit (any machines): --coordinator_address=HOST:PORT of process 0, --num_processes
    and --process_id, the same command on every host. Auto-detected: Cloud TPU VMs (pod
    slices), SLURM (srun) and Open MPI (mpirun), where JAX reads all three from the
    environment. Otherwise a single-process run: nothing to do. Call before any JAX op."""
    explicit = bool(coordinator_address) or num_processes > 0 or process_id >= 0
    in_cluster = _in_cluster()
    if not explicit and not in_cluster:
        return
    if not in_cluster and not (coordinator_address and num_processes > 0 and process_id >= 0):
        raise ShardingError("multi-host needs all three of --coordinator_address=HOST:PORT "
                            "(process 0's address), --num_processes and --process_id, unless "
                            "JAX detects the cluster (Cloud TPU VM, SLURM srun, Open MPI)")
    if 0 < num_processes <= process_id:
        raise ShardingError(f"--process_id={process_id} must be below --num_processes="
                            f"{num_processes} (processes count from 0)")
    try:
        jax.distributed.initialize(coordinator_address=coordinator_address or None,
                                   num_processes=num_processes or None,
                                   process_id=None if process_id < 0 else process_id)
    except (RuntimeError, ValueError) as e:
        where = coordinator_address or "the auto-detected coordinator"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ShardingError(f"could not join the distributed runtime at {where}: {first}; "
                            "check that every process got the same --coordinator_address and "
                            "--num_processes and that process 0 is reachable") from None


def _in_cluster():
    """A multi-process job that jax.distributed.initialize() can configure by itself."""
    env = os.environ
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_STEP_NODELIST" in env:  # under srun
        return True
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:  # under mpirun
        return True
    if len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:  # GKE TPU
        return True
    # A Cloud TPU VM (libtpu installed, TPU chips attached): JAX asks the metadata server
    # for the slice's workers; on a single-host slice that is a harmless one-process job.
    has_chips = glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
    return bool(has_chips) and importlib.util.find_spec("libtpu") is not None
