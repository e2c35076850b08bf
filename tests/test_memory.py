"""Memory that follows the math: the scanned layers compute what the unrolled ones do; the
compiled step's temporaries grow with depth only by the added layers' sharded state and
block inputs; gradients and their sums inside the step are split like their parameters."""

import functools
import re

import jax
import numpy as np
import pytest

from test_model import init, tiny
from test_sharding import abstract_batch, build, train_losses
from trainer import lora, plan, train
from trainer.model import batch_loss, layer_period

GEMMA_TYPES = ("sliding_attention", "sliding_attention", "full_attention") * 2


def test_layer_period():
    assert layer_period(("full_attention",) * 4) == 1
    assert layer_period(GEMMA_TYPES[:5]) == 3  # one whole period, then two layers after it
    assert layer_period(("full_attention", "sliding_attention", "sliding_attention")) == 3


@pytest.mark.parametrize("family, remat", [("llama", "none"), ("gemma3_text", "full")])
def test_scanned_layers_equal_unrolled(family, remat):
    overrides = {} if family == "llama" else dict(
        model_type="gemma3_text", num_hidden_layers=5, sliding_window=4,
        layer_types=GEMMA_TYPES[:5])
    cfg = tiny(**overrides)
    unrolled, params = init(cfg, remat=remat)
    scanned = unrolled.clone(scan_layers=True)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (2, 17), np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "loss_mask": np.ones((2, 16), np.float32),
             # two packed documents in the first row
             "segment_ids": np.array([[0] * 6 + [1] * 10, [0] * 16], np.int32),
             "positions": np.array([list(range(6)) + list(range(10)), list(range(16))],
                                   np.int32)}

    def loss_and_grads(model):
        f = jax.jit(jax.value_and_grad(lambda p: batch_loss(model, p, batch)[0]))
        return jax.device_get(f(params))

    (loss_u, grads_u), (loss_s, grads_s) = loss_and_grads(unrolled), loss_and_grads(scanned)
    np.testing.assert_allclose(loss_s, loss_u, rtol=1e-6)
    for g_s, g_u in zip(jax.tree.leaves(grads_s), jax.tree.leaves(grads_u)):
        assert np.max(np.abs(g_s - g_u)) <= 1e-5 * np.max(np.abs(g_u))
    assert jax.tree.structure(grads_s) == jax.tree.structure(params)


@pytest.mark.parametrize("vocab", [4096, 320])
def test_both_embedding_lookups_give_the_single_device_losses(vocab):
    """1,024 tokens a step: fewer than the vocab rows per tp shard at 4,096 (each device
    looks up its own rows) and more at 320 (the table is gathered); the tied head always
    scores by rows. Both, scanned, on 1,8,1 and 1,2,4, equal one device's losses."""
    flags = (f"--model.vocab_size={vocab}", "--model.tie_word_embeddings=true")
    reference = np.array(train_losses("1,1,1", 3, *flags, init=flags)[0])
    for mesh in ("1,8,1", "1,2,4"):
        np.testing.assert_allclose(train_losses(mesh, 3, *flags, init=flags)[0], reference,
                                   rtol=1e-5, err_msg=mesh)


@pytest.mark.parametrize("scan", ["true", "false"])
def test_offload_keeps_exactly_the_block_inputs_in_host_memory(scan):
    """--remat=offload: the only values the backward pass keeps in host memory are the block
    inputs, one [rows, seq, hidden] per layer (stacked by the scan), and the step lowered
    for a GPU asks XLA to place them in pinned host memory."""
    def traced(remat):
        cfg, mesh, trainer = build("1,2,1", f"--remat={remat}", f"--scan_layers={scan}",
                                   batch_size=4, seq_len=32)
        with jax.set_mesh(mesh):
            return cfg, trainer.step_fn.trace(trainer.abstract_state,
                                              abstract_batch(trainer, 4, 32))
    cfg, offload = traced("offload")
    layers, block_input = cfg.model.num_hidden_layers, (4, 32, cfg.model.hidden_size)
    in_host = {tuple(map(int, dims.split(","))) for dims in
               re.findall(r"f32<host>\[([\d,]+)\]", str(offload.jaxpr))}
    assert in_host == ({block_input, (layers, *block_input)} if scan == "true" else
                       {block_input})
    assert "<host>" not in str(traced("full")[1].jaxpr)
    gpu = offload.lower(lowering_platforms=("cuda",)).as_text()
    placed = re.findall(r'annotate_device_placement.*"pinned_host".*\(tensor<(\w+)>\)', gpu)
    # The scan's body is written once; unrolled, every layer places its own.
    assert placed == ["x".join(map(str, block_input)) + "xf32"] * (1 if scan == "true" else
                                                                  layers)


def test_offload_runs_as_full_on_cpu_and_the_plan_says_so():
    """The CPU backend has no separate host memory: offload computes exactly what full
    does, and the plan shows the block inputs a GPU would move to host memory."""
    offload, _ = train_losses("1,2,1", 3, "--remat=offload")
    assert offload == train_losses("1,2,1", 3, "--remat=full")[0]
    cfg, mesh, _ = build("1,2,1", "--remat=offload")
    lines = []
    result = plan.plan(cfg, mesh, out=lines.append)
    m = cfg.model
    block_inputs = m.num_hidden_layers * (cfg.batch_size // 2) * cfg.seq_len * m.hidden_size * 4
    assert result["host"] == 0
    assert any(re.fullmatch(rf"  host memory \(offload\) +0\.0 MiB +{block_inputs / 2**20:.1f} "
                            "MiB", line) for line in lines), lines
    assert any("figures are remat full's; on GPU/TPU about" in line for line in lines)


def compiled_temporaries(layers, scan):
    cfg, mesh, trainer = build("1,8,1", "--model.hidden_size=256",
                               "--model.intermediate_size=512",
                               "--model.num_attention_heads=4", "--model.vocab_size=32000",
                               f"--model.num_hidden_layers={layers}", "--remat=full",
                               f"--scan_layers={scan}", batch_size=8, seq_len=256)
    with jax.set_mesh(mesh):
        memory = trainer.compile_abstract().memory_analysis()
    per_layer_params = sum(x.size for p, x in jax.tree_util.tree_flatten_with_path(
        trainer.abstract_state["params"])[0] if "layers_0/" in jax.tree_util.keystr(p)
        .replace("']['", "/"))
    return memory.temp_size_in_bytes, per_layer_params, cfg


@pytest.mark.slow
def test_temporaries_grow_by_the_added_layers_state_and_checkpoints_only():
    """16 versus 8 layers on 1,8,1: each added layer may add its sharded state (weights and
    two Adam moments, float32, over 8 devices) and its block input (one row of seq x
    hidden); a full-size copy of its weights would be 8/3 of that state alone."""
    temp_8, per_layer, cfg = compiled_temporaries(8, "true")
    temp_16, _, _ = compiled_temporaries(16, "true")
    sharded_state = per_layer * (4 + 8) / 8
    block_input = 1 * cfg.seq_len * cfg.model.hidden_size * 4
    allowed = 8 * (sharded_state + block_input)
    grew = temp_16 - temp_8
    print(f"temporaries: 8 layers {temp_8 / 2**20:.1f} MiB, 16 layers {temp_16 / 2**20:.1f} MiB;"
          f" grew {grew / 2**20:.1f} MiB, allowed {allowed / 2**20:.1f} MiB")
    assert grew <= allowed


def test_gradients_and_their_sums_are_split_like_their_parameters():
    cfg, mesh, trainer = build("1,4,2", "--grad_accum=2", "--lora.rank=0", batch_size=16)
    seen = {}

    def inspect(name, tree):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            jax.debug.inspect_array_sharding(
                leaf, callback=functools.partial(seen.__setitem__, (name, path)))

    step = jax.jit(functools.partial(train.train_step, **{**trainer.step_args,
                                                          "inspect": inspect}),
                   in_shardings=(trainer.state_shardings, trainer.batch_sharding))
    with jax.set_mesh(mesh):
        step.lower(trainer.abstract_state, abstract_batch(trainer)).compile()
    expected = dict(jax.tree_util.tree_flatten_with_path(
        lora.split(trainer.state_shardings["params"], trainer.trainable)[0])[0])
    assert {name for name, _ in seen} == {"grads", "grad_sum"}
    assert len(seen) == 2 * len(expected)
    split = 0
    for (name, path), sharding in seen.items():
        want = expected[path]
        assert sharding.is_equivalent_to(want, len(want.spec) or 1), (name, path, sharding)
        split += not sharding.is_fully_replicated
    assert split > len(expected) // 2  # most weights are split: the check has teeth
