"""How the single-device model and step become a multi-device, multi-host program.

Three pieces, all outside the model:
- the mesh: `--mesh=dp,fsdp,tp` over every device of every host;
- PARAM_RULES: one table, regex over a parameter's path -> PartitionSpec;
- LOGICAL_AXES: the mesh axes each named activation axis is split over, used by
  `constrain`, which does nothing when no mesh is set.
"""

import os
import re

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from trainer.config import UserError

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
}


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


def _fit(spec, shape, mesh):
    """Drop mesh axes that don't evenly divide their dimension (small biases, odd vocabs)."""
    axes = list(spec) + [None] * (len(shape) - len(spec))
    for i, axis in enumerate(axes):
        if axis is not None and shape[i] % mesh.shape[axis]:
            axes[i] = None
    return P(*axes)


def spec_for(path, shape, mesh):
    """The PartitionSpec of one array in the train state, found by PARAM_RULES."""
    if len(shape) == 0:
        return P()  # step counters, RNG keys, optimizer counts
    name = path_str(path)
    for pattern, spec in PARAM_RULES:
        if re.search(pattern, name):
            if len(spec) > len(shape):  # a factored optimizer statistic of this parameter
                return P()
            return _fit(spec, shape, mesh)
    raise ShardingError(f"parameter '{name}' (shape {tuple(shape)}) matches no rule in "
                        "trainer/sharding.py PARAM_RULES; add one")


def state_shardings(abstract_state, mesh):
    """NamedShardings for a whole pytree (params, or the train state with optimizer moments,
    which follow their parameter's rule because their paths end in the parameter's path)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, spec_for(path, leaf.shape, mesh)), abstract_state)


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
        for field in ("num_attention_heads", "num_key_value_heads"):
            if getattr(model_cfg, field) % tp:
                raise ShardingError(f"--mesh={text}: tp={tp} must divide model.{field}="
                                    f"{getattr(model_cfg, field)}; pick a tp that divides it")
    if batch_size is not None:
        rows = dp * fsdp * grad_accum
        if batch_size % rows:
            raise ShardingError(f"--batch_size={batch_size} must be a multiple of dp*fsdp*"
                                f"grad_accum = {dp}*{fsdp}*{grad_accum} = {rows}")
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


# ------------------------------------------------------------------ multi-host
def init_distributed(coordinator_address="", num_processes=0, process_id=-1):
    """Join JAX's distributed runtime: from flags, or auto-detected on TPU pods, SLURM and
    other clusters JAX knows. Single-host runs do nothing. Call before any JAX op."""
    if coordinator_address:
        jax.distributed.initialize(coordinator_address=coordinator_address,
                                   num_processes=num_processes or None,
                                   process_id=None if process_id < 0 else process_id)
    elif _in_cluster():
        jax.distributed.initialize()


def _in_cluster():
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return True
    if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return True
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return len([h for h in hosts.split(",") if h]) > 1
