"""trainer/sharding.py: the dp/fsdp/tp mesh, the rule table, constrain, and what they do to
the train step: the same losses on every mesh, FSDP that really shards, donation, FLOPs,
dtypes and remat, and one-line errors for every misconfiguration."""

import functools
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import REPO, cli_env
from trainer import sharding, train

MESHES = ["1,1,1", "8,1,1", "1,8,1", "1,2,4", "2,2,2"]
# The tiny preset has 2 kv heads; 4 lets tp=4 split whole kv heads without repeating them.
TINY = ["--model=tiny", "--model.num_key_value_heads=4"]


def build(mesh_text, *flags, batch_size=16, seq_len=64, steps=5):
    """cfg, mesh and train.Trainer for the tiny model on the first dp*fsdp*tp devices."""
    cfg = train.resolve_config([*TINY, f"--mesh={mesh_text}", f"--batch_size={batch_size}",
                                f"--seq_len={seq_len}", f"--steps={steps}", *flags])
    size = int(np.prod([int(d) for d in mesh_text.split(",")]))
    mesh = sharding.make_mesh(cfg.mesh, cfg.model, cfg.batch_size, cfg.grad_accum,
                              devices=jax.devices()[:size])
    return cfg, mesh, train.Trainer(cfg, mesh)


def batch_for(step, batch_size=16, seq_len=64):
    """A deterministic batch of random byte tokens."""
    tokens = np.random.default_rng(step).integers(0, 256, (batch_size, seq_len + 1), np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "loss_mask": np.ones((batch_size, seq_len), np.float32)}


def abstract_batch(trainer, batch_size=16, seq_len=64):
    return {k: jax.ShapeDtypeStruct((batch_size, seq_len), v.dtype, sharding=trainer.batch_sharding)
            for k, v in batch_for(0, batch_size, seq_len).items()}


@functools.lru_cache(maxsize=4)
def host_state(*flags):
    """A fresh train state on one device, in host memory: the starting point of runs on
    every mesh (the sharded initialiser itself is tested below and by the CLI tests)."""
    _, mesh, trainer = build("1,1,1", *flags)
    with jax.set_mesh(mesh):
        return jax.device_get(trainer.fresh_state())


def train_losses(mesh_text, steps=5, *flags, init=()):
    """Losses of `steps` steps on a mesh, from host_state(*init) cast to this run's dtypes."""
    cfg, mesh, trainer = build(mesh_text, *flags, steps=steps)
    start = jax.tree.map(lambda x, a: np.asarray(x).astype(a.dtype), host_state(*init),
                         trainer.abstract_state)
    losses = []
    with jax.set_mesh(mesh):
        state = jax.device_put(start, trainer.state_shardings)
        # Compiled once, as train.run does: a state whose types drift fails the next call.
        step_fn = trainer.step_fn.lower(state, abstract_batch(trainer)).compile()
        for step in range(steps):
            batch = jax.device_put(batch_for(step), trainer.batch_sharding)
            state, metrics = step_fn(state, batch)
            losses.append(float(metrics["loss"]))
    return losses, state


def per_device_bytes(tree):
    held = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values())


# ------------------------------------------------------------------ equivalence
@pytest.mark.slow
def test_every_mesh_gives_the_single_device_losses():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = {mesh: train_losses(mesh)[0] for mesh in MESHES}
    reference = np.array(runs["1,1,1"])
    assert np.all(np.isfinite(reference)) and reference[-1] < reference[0]
    for mesh, losses in runs.items():
        np.testing.assert_allclose(losses, reference, rtol=1e-5, err_msg=f"mesh {mesh}")
    # The state is donated to the step and every buffer is reused: no warning about it.
    assert not [w for w in caught if "donat" in str(w.message).lower()]


@pytest.mark.parametrize("mesh,flags", [
    ("1,2,4", ["--model.num_key_value_heads=2"]),  # the tiny preset's own 2 kv heads
    ("2,1,4", ["--model.num_key_value_heads=1"]),  # multi-query: one kv head, 4 copies
    ("1,2,3", ["--model.num_attention_heads=6", "--model.head_dim=32",  # tp=3, 2 kv heads:
               "--model.num_key_value_heads=2"]),  # 3 copies of each, on 6 devices
])
def test_tp_beyond_the_kv_heads_gives_the_single_device_losses(mesh, flags):
    """tp larger than (or not dividing) the kv heads: each kv head is repeated to
    lcm(K, tp) heads and the k/v weights stay whole over tp; losses over 3 steps (with
    their updates) equal one device's."""
    reference = train_losses("1,1,1", 3, *flags, init=tuple(flags))[0]
    losses, _ = train_losses(mesh, 3, *flags, init=tuple(flags))
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    _, _, trainer = build(mesh, *flags)
    params = trainer.state_shardings["params"]["layers_0"]["self_attn"]
    assert params["q_proj"]["kernel"].spec == P("fsdp", "tp")
    assert params["k_proj"]["kernel"].spec == P("fsdp", None)  # whole on every tp shard


# ------------------------------------------------------------------ FSDP memory
def test_fsdp_shards_params_and_optimizer_state():
    # Layers unrolled: XLA's cost analysis counts a loop body once (the FLOPs check below).
    _, mesh1, single = build("1,1,1", "--scan_layers=false")
    _, mesh8, fsdp = build("1,8,1", "--scan_layers=false")
    with jax.set_mesh(mesh1):
        compiled1 = single.step_fn.lower(single.abstract_state, abstract_batch(single)).compile()
    with jax.set_mesh(mesh8):
        state8 = fsdp.fresh_state()  # initialised straight into the sharded layout
        compiled8 = fsdp.step_fn.lower(state8, abstract_batch(fsdp)).compile()

    weights = lambda s: {"params": s["params"], "opt_state": s["opt_state"]}
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(weights(single.abstract_state)))
    # Norm scales (and their moments) and scalars stay replicated: a few KiB here.
    overhead = 32 * 1024
    assert per_device_bytes(weights(state8)) <= total / 8 + overhead

    # The compiler agrees: each device's arguments are 1/8 (the batch is sharded too).
    args1 = compiled1.memory_analysis().argument_size_in_bytes
    args8 = compiled8.memory_analysis().argument_size_in_bytes
    assert args1 >= total
    assert args8 <= args1 / 8 + overhead
    # Donation: the new state is written into the old state's buffers.
    assert compiled8.memory_analysis().alias_size_in_bytes >= per_device_bytes(weights(state8))
    # XLA's FLOPs are per device; summed over the mesh they match the one-device count.
    flops1, flops8 = train.xla_flops_per_step(compiled1, 1), train.xla_flops_per_step(compiled8, 8)
    assert 0.95 <= flops8 / flops1 <= 1.1


def test_optimizer_state_follows_its_parameter():
    _, mesh, trainer = build("1,2,4")
    params = trainer.state_shardings["params"]
    moments = trainer.state_shardings["opt_state"]
    flat_params = {sharding.path_str(p): s.spec
                   for p, s in jax.tree_util.tree_leaves_with_path(params)}
    checked = 0
    for path, s in jax.tree_util.tree_leaves_with_path(moments):
        name = sharding.path_str(path)
        owner = [p for p in flat_params if name.endswith("/" + p)]
        if owner:
            assert len(owner) == 1 and s.spec == flat_params[owner[0]], name
            checked += 1
    assert checked == 2 * len(flat_params)  # Adam's mu and nu
    assert flat_params["layers_0/self_attn/q_proj/kernel"] == P("fsdp", "tp")
    assert flat_params["layers_0/mlp/down_proj/kernel"] == P("tp", "fsdp")
    assert flat_params["embed_tokens/embedding"] == P("tp", "fsdp")


# ------------------------------------------------------------------ rules
@pytest.mark.parametrize("flags", [
    [], ["--model.tie_word_embeddings=true"], ["--model.model_type=qwen2"],
    ["--model.attention_bias=true", "--model.mlp_bias=true"],
    ["--model.model_type=qwen3"], ["--model.model_type=gemma3_text"],
    ["--optimizer.name=adafactor"], ["--optimizer.name=sgd"]])
def test_every_parameter_matches_a_rule(flags):
    build("1,2,4", *flags)  # sharding.state_shardings raises on any unmatched leaf


def test_an_unmatched_parameter_is_an_error_that_names_it():
    mesh = sharding.make_mesh("1,8,1")
    state = {"params": {"layers_0": {"router": {"kernel": jnp.zeros((128, 8))}}}}
    with pytest.raises(sharding.ShardingError, match=r"'params/layers_0/router/kernel' "
                                                     r"\(shape \(128, 8\)\) matches no rule"):
        sharding.state_shardings(state, mesh)


def test_constrain_is_a_no_op_without_a_mesh_and_pins_sharding_with_one():
    fn = jax.jit(lambda x: sharding.constrain(x * 2, ("batch", None, "vocab")))
    x = jnp.ones((8, 4, 16))
    assert "sharding_constraint" not in fn.lower(x).as_text()
    assert isinstance(fn(x).sharding, jax.sharding.SingleDeviceSharding)
    with jax.set_mesh(sharding.make_mesh("2,2,2")):
        assert "sharding_constraint" in fn.lower(x).as_text()
        assert fn(x).sharding.spec == P(("dp", "fsdp"), None, "tp")


def test_the_model_constrains_its_activations_only_under_a_mesh():
    _, mesh, trainer = build("1,2,4", "--scan_layers=false")
    batch = abstract_batch(trainer)
    # (Without the step's own constraints, which keep gradients split like their params.)
    step = jax.jit(functools.partial(train.train_step,
                                     **{**trainer.step_args, "grad_shardings": None}))
    assert step.lower(trainer.abstract_state, batch).as_text().count("sharding_constraint") == 0
    with jax.set_mesh(mesh):
        text = step.lower(trainer.abstract_state, batch).as_text()
    # Embedding, q/k/v/attention output, MLP hidden and block output per layer, logits.
    assert text.count("sdy.sharding_constraint") >= 1 + 6 * 4 + 1
    assert '[{"dp", "fsdp"}, {}, {"tp"}, {}]' in text  # [B, T, heads, Dh]: heads over tp


# ------------------------------------------------------------------ FLOPs, dtypes, remat
@functools.lru_cache(maxsize=1)
def fp32_losses_on_1_2_4(*flags):
    return train_losses("1,2,4", 3, *flags, init=flags)[0]


def xla_over_analytic(*flags, seq_len=128):
    # Layers unrolled: XLA's cost analysis counts a loop body once.
    cfg, mesh, trainer = build("1,1,1", "--scan_layers=false", *flags, seq_len=seq_len)
    with jax.set_mesh(mesh):
        compiled = trainer.step_fn.lower(trainer.abstract_state,
                                         abstract_batch(trainer, seq_len=seq_len)).compile()
    analytic = cfg.model.flops_per_token(seq_len) * cfg.batch_size * seq_len
    return train.xla_flops_per_step(compiled, mesh.size, cfg.grad_accum) / analytic


def test_analytic_flops_agree_with_xla():
    assert 0.8 <= xla_over_analytic() <= 1.25
    two_layers = "--model.num_hidden_layers=2"  # quicker to compile
    assert 0.8 <= xla_over_analytic(two_layers, "--grad_accum=2") <= 1.25  # scan body once
    # Full remat recomputes each block's forward pass in the backward one: ~4/3 the work.
    assert xla_over_analytic(two_layers, "--remat=full") > 1.15 * xla_over_analytic(two_layers)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--remat=full"], ["--remat=dots"], ["--remat=dots_no_batch"],
                                   ["--dtype=bfloat16"],
                                   ["--dtype=bfloat16", "--param_dtype=bfloat16"]])
def test_dtype_and_remat_train_on_a_mesh(flags):
    two_layers = "--model.num_hidden_layers=2"  # quicker to compile; same flags plumbing
    reference = fp32_losses_on_1_2_4(two_layers)
    losses, state = train_losses("1,2,4", 3, two_layers, *flags, init=(two_layers,))
    param_dtype = np.dtype(jnp.bfloat16 if "--param_dtype=bfloat16" in flags else jnp.float32)
    assert {x.dtype for x in jax.tree.leaves(state["params"])} == {param_dtype}
    assert {x.dtype for x in jax.tree.leaves(state["opt_state"]) if x.ndim} == {param_dtype}
    # remat changes what is stored, not the math; bf16 compute stays close.
    np.testing.assert_allclose(losses, reference, rtol=1e-5 if "--remat" in flags[0] else 2e-2)


def test_peak_tflops_table_covers_the_usual_accelerators():
    expected = {"TPU v4": 275, "TPU v5 lite": 197, "TPU v5": 459, "TPU v5p": 459,
                "TPU v6 lite": 918, "NVIDIA A100-SXM4-80GB": 312, "NVIDIA A100-SXM4-40GB": 312,
                "NVIDIA H100 80GB HBM3": 989, "NVIDIA H100 PCIe": 756, "NVIDIA H200": 989,
                "cpu": 0, "TFRT_CPU": 0}
    assert {kind: train.peak_tflops_for(kind) for kind in expected} == expected


# ------------------------------------------------------------------ errors
def test_parse_mesh():
    assert sharding.parse_mesh("1,-1,1", 8) == (1, 8, 1)
    assert sharding.parse_mesh("2,-1,2", 8) == (2, 2, 2)
    for bad in ("1,1", "a,b,c", "-1,-1,1", "0,8,1", "1,-2,4"):
        with pytest.raises(sharding.ShardingError, match="--mesh: expected three numbers"):
            sharding.parse_mesh(bad, 8)
    with pytest.raises(sharding.ShardingError, match="--mesh=3,-1,1: 8 devices don't divide"):
        sharding.parse_mesh("3,-1,1", 8)


MISTAKES = [  # (flags, what the one-line error must say)
    (["--mesh=2,2,1"], "--mesh=2,2,1: dp*fsdp*tp = 4 but there are 8 devices"),
    (["--mesh=1,x,1"], "--mesh: expected three numbers dp,fsdp,tp"),
    (["--mesh=1,1,8"], "tp=8 must divide model.num_attention_heads=4; use tp in {1, 2, 4}"),
    (["--mesh=1,8,1", "--batch_size=12"],
     "--batch_size=12 must be a multiple of dp*fsdp*grad_accum = 1*8*1 = 8; "
     "use --batch_size=8 or 16"),
    (["--mesh=2,4,1", "--batch_size=16", "--grad_accum=4"],
     "must be a multiple of dp*fsdp*grad_accum = 2*4*4 = 32; use --batch_size=32"),
    (["--num_processes=2"], "multi-host needs all three of --coordinator_address"),
    (["--coordinator_address=127.0.0.1:1", "--num_processes=2", "--process_id=2"],
     "--process_id=2 must be below --num_processes=2"),
]


@pytest.mark.slow
def test_every_misconfiguration_is_one_clear_line_and_exit_1(tmp_path):
    """Through the real CLI on 8 devices, all started at once to save wall time."""
    procs = [subprocess.Popen(
        [sys.executable, "-m", "trainer.train", *flags, f"--output_dir={tmp_path}/{i}",
         f"--data.cache_dir={tmp_path}/cache"],
        cwd=REPO, env=cli_env(8), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i, (flags, _) in enumerate(MISTAKES)]
    try:
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for i, ((flags, message), p, (out, err)) in enumerate(zip(MISTAKES, procs, results)):
        assert p.returncode == 1, (flags, out, err)
        assert "Traceback" not in err, (flags, err)
        last = err.strip().splitlines()[-1]
        assert last.startswith("error: ") and message in last, (flags, last)
        assert not (tmp_path / str(i)).exists()  # nothing left behind
