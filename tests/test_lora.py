"""trainer/lora.py and its seam: the trainable mask, LoRA adapters, freezing, merged and PEFT
exports (checked with transformers and peft themselves), meshes, resume and errors."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run_cli
from test_sharding import batch_for, build, train_losses
from tiny_hf import make_hf_dir, torch_logits
from trainer import checkpoint, lora, loading, train
from trainer.model import build_model
from trainer.sharding import path_str

LORA = ["--lora.rank=4", "--lora.alpha=8", "--optimizer.lr=1e-2", "--optimizer.warmup_steps=0"]


def flat(tree):
    return {path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def run_steps(trainer, mesh, steps):
    with jax.set_mesh(mesh):
        state = trainer.fresh_state()
        start = jax.device_get(state)
        for step in range(steps):
            state, _ = trainer.step_fn(state, jax.device_put(batch_for(step),
                                                             trainer.batch_sharding))
        return start, jax.device_get(state)


def test_lora_trains_only_the_adapters():
    """Base weights stay bitwise; every adapter moves; only adapters have optimizer state;
    the model starts exactly as its base (B = 0)."""
    cfg, mesh, trainer = build("1,1,1", *LORA)
    start, end = run_steps(trainer, mesh, 3)
    before, after = flat(start["params"]), flat(end["params"])
    adapters = [p for p in before if lora.is_adapter(p)]
    # q, k, v, o, gate, up and down of every layer, A and B each.
    assert len(adapters) == cfg.model.num_hidden_layers * 7 * 2
    for p in before:
        if lora.is_adapter(p):
            assert not np.array_equal(before[p], after[p]), p
        else:
            assert np.array_equal(before[p], after[p]), p
    moments = [p for p in flat(end["opt_state"]) if p.rsplit("/", 1)[-1] not in ("count",)]
    assert moments and all(lora.is_adapter(p) for p in moments), moments[:5]
    assert sum(x.size for x in jax.tree.leaves(end["opt_state"])) < 3 * sum(
        before[p].size for p in adapters)
    # At the start, the adapted model's logits are its base's.
    tokens = batch_for(0)["inputs"][:2]
    plain = build_model(cfg.model)
    base = lora.without_adapters(start["params"])
    np.testing.assert_array_equal(trainer.model.apply({"params": start["params"]}, tokens),
                                  plain.apply({"params": base}, tokens))


def test_freeze_keeps_matching_weights_bitwise_and_trains_the_rest():
    _, mesh, trainer = build("1,1,1", "--freeze=embed_tokens|layers_0/")
    start, end = run_steps(trainer, mesh, 2)
    before, after = flat(start["params"]), flat(end["params"])
    for p in before:
        frozen = p.startswith(("embed_tokens", "layers_0/"))
        assert np.array_equal(before[p], after[p]) == frozen, p
    assert not any(p.startswith(("embed_tokens", "layers_0/")) for p in flat(end["opt_state"]))


def test_base_dtype_stores_the_frozen_weights_in_bf16():
    _, mesh, trainer = build("1,1,1", *LORA, "--lora.base_dtype=bfloat16")
    _, end = run_steps(trainer, mesh, 2)
    for p, x in flat(end["params"]).items():
        assert x.dtype == (np.float32 if lora.is_adapter(p) else jnp.bfloat16), p


@pytest.mark.parametrize("mesh", ["2,2,2", "1,2,4"])
def test_lora_on_a_mesh_equals_one_device(mesh):
    flags = (*LORA, "--model.num_key_value_heads=4")
    one, one_state = train_losses("1,1,1", 4, *flags, init=flags)
    many, many_state = train_losses(mesh, 4, *flags, init=flags)
    np.testing.assert_allclose(many, one, rtol=1e-5)
    a, b = flat(jax.device_get(one_state["params"])), flat(jax.device_get(many_state["params"]))
    for p in a:  # (Adam's first steps move a tiny gradient's weight by ~lr: 1e-2 here)
        np.testing.assert_allclose(b[p], a[p], atol=1e-4, err_msg=p)
    # Adapters are sharded like their kernels: A over fsdp on its input side.
    _, _, trainer = build(mesh, *flags)
    specs = flat(jax.tree.map(lambda s: str(s.spec), trainer.state_shardings["params"]))
    assert specs["layers_0/self_attn/q_proj/lora_a"] == str(jax.sharding.PartitionSpec("fsdp", None))
    assert specs["layers_0/self_attn/q_proj/lora_b"] == str(jax.sharding.PartitionSpec(None, "tp"))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    from pydoc_data.topics import topics
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("\n\n".join(topics[t] for t in sorted(topics)[:30]))
    return str(path)


@pytest.mark.parametrize("family,lora_flags", [
    ("llama_gqa", ["--lora.rank=4", "--lora.alpha=8"]),
    ("qwen3", ["--lora.rank=2", "--lora.alpha=3", r"--lora.targets=layers_1/self_attn/(q|v)_proj|down_proj"]),
])
def test_merged_and_peft_exports_give_the_adapted_logits(family, lora_flags, text_file, tmp_path):
    """Fine-tune an HF model with LoRA from the command line. transformers on the merged
    export, and peft with the adapter on the base, give meshlm's (unmerged) logits."""
    import peft
    import transformers
    base_dir, run = str(tmp_path / "base"), str(tmp_path / "run")
    make_hf_dir(base_dir, family, seed=3)
    run_cli("train", f"--init_from={base_dir}", f"--data.path={text_file}", "--seq_len=32",
            "--batch_size=8", "--steps=8", "--optimizer.lr=2e-2", "--optimizer.warmup_steps=0",
            f"--output_dir={run}", f"--export_hf={tmp_path}/merged",
            f"--export_peft={tmp_path}/adapter", "--eval_every=0", *lora_flags)

    tokens = np.random.default_rng(0).integers(0, 300, (2, 24)).astype(np.int32)
    settings = loading.lora_of(run)
    assert settings.rank == int(lora_flags[0].split("=")[1])
    model_cfg, _ = loading.model_source(run)
    adapted = build_model(model_cfg, lora=settings)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = checkpoint.load_params(run, loading.abstract_params(adapted, device))
    ours = np.asarray(adapted.apply({"params": params}, tokens))
    base = np.asarray(build_model(model_cfg).apply({"params": lora.without_adapters(params)},
                                                   tokens))
    assert np.abs(ours - base).max() > 1e-3  # the adapters learned something

    merged = transformers.AutoModelForCausalLM.from_pretrained(f"{tmp_path}/merged").eval()
    np.testing.assert_allclose(torch_logits(merged, tokens), ours, atol=1e-4)
    with_adapter = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base_dir), f"{tmp_path}/adapter").eval()
    np.testing.assert_allclose(torch_logits(with_adapter, tokens), ours, atol=1e-4)
    config = json.load(open(f"{tmp_path}/adapter/adapter_config.json"))
    assert config["base_model_name_or_path"] == base_dir and config["r"] == settings.rank
    # eval, generate, convert and --init_from read a LoRA checkpoint with its adapters
    # merged in.
    model, merged_params, _ = loading.load_model(run)
    np.testing.assert_allclose(model.apply({"params": merged_params}, tokens), ours, atol=1e-4)
    run_cli("convert", f"--input={run}", f"--output={tmp_path}/converted")
    converted = transformers.AutoModelForCausalLM.from_pretrained(f"{tmp_path}/converted")
    np.testing.assert_allclose(torch_logits(converted.eval(), tokens), ours, atol=1e-4)
    if family == "llama_gqa":  # a second LoRA round on top of the first (SFT, then DPO)
        run_cli("train", f"--init_from={run}", f"--data.path={text_file}", "--seq_len=32",
                "--batch_size=8", "--steps=1", "--lora.rank=2", "--eval_every=0",
                f"--output_dir={tmp_path}/second")
        again = build_model(model_cfg, lora=loading.lora_of(f"{tmp_path}/second"))
        second = checkpoint.load_params(f"{tmp_path}/second",
                                        loading.abstract_params(again, device))
        np.testing.assert_allclose(
            build_model(model_cfg).apply({"params": lora.without_adapters(second)}, tokens),
            ours, atol=1e-4)  # its frozen base is the first round's merged model


def test_lora_resume_is_bitwise(tmp_path, text_file):
    common = [f"--data.path={text_file}", "--seq_len=32", "--batch_size=8", "--eval_every=0",
              "--log_every=1", "--model.hidden_size=64", "--model.intermediate_size=128",
              "--optimizer.schedule=constant", "--optimizer.warmup_steps=0",  # same lr at 3 of 3
              "--lora.rank=4", "--lora.dropout=0.1", "--compile_cache="]
    run_cli("train", *common, "--steps=6", f"--output_dir={tmp_path}/straight")
    run_cli("train", *common, "--steps=3", f"--output_dir={tmp_path}/resumed")
    run_cli("train", *common, "--steps=6", f"--output_dir={tmp_path}/resumed")

    def losses(run):
        return [json.loads(l).get("loss") for l in open(f"{run}/metrics.jsonl") if '"loss"' in l]
    assert losses(f"{tmp_path}/straight") == losses(f"{tmp_path}/resumed")
    # A different LoRA setting can't continue that run.
    proc = run_cli("train", *common[:-3], "--lora.rank=8", "--steps=9",
                   f"--output_dir={tmp_path}/resumed", check=False)
    assert proc.returncode == 1 and "trained with --lora.rank=4 (this run: 8)" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("flags,message", [
    (["--lora.rank=4", "--lora.targets=nothing_here"], "--lora.targets matches no attention"),
    (["--lora.rank=4", "--lora.targets=lm_head|q_proj"], "matches lm_head/kernel, which cannot"),
    (["--lora.rank=4", "--lora.targets=("], "--lora.targets: '(' is not a regular expression"),
    (["--freeze=."], "--freeze='.' matches every parameter"),
    (["--export_peft=/tmp/x"], "--export_peft writes LoRA adapters; pass --lora.rank"),
    (["--lora.rank=4", "--freeze=embed"], "--freeze and --lora.rank both choose"),
    (["--lora.rank=-1"], "need rank >= 0"),
    (["--freeze=nothing_here"], "--freeze='nothing_here' matches no parameter"),
    (["--lora.alpha=32"], "--lora.alpha has no effect without --lora.rank"),
    (["--dpo.beta=0.2"], "--dpo.beta has no effect without --data.format=preference"),
    (["--lora.rank=4", "--export_peft={tmp}/a"], "--export_peft writes adapters for the Hugging"),
    (["--export_hf={tmp}/run/hf"], "--export_hf={tmp}/run/hf and --output_dir={tmp}/run overlap"),
])
def test_lora_errors_are_one_line(flags, message, tmp_path):
    flags = [f.format(tmp=tmp_path) for f in flags]
    message = message.format(tmp=tmp_path)
    proc = run_cli("train", "--steps=1", f"--output_dir={tmp_path}/run", *flags, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and message in lines[-1], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not os.path.exists(f"{tmp_path}/run")


def test_peft_export_refuses_fused_phi3_tensors(tmp_path):
    base = str(tmp_path / "phi3")
    make_hf_dir(base, "phi3")
    proc = run_cli("train", f"--init_from={base}", "--lora.rank=4", f"--export_peft={tmp_path}/a",
                   f"--output_dir={tmp_path}/run", check=False)
    assert proc.returncode == 1 and "qkv_proj.weight is fused" in proc.stderr.splitlines()[-1]
    # o_proj and down_proj are not fused: their adapters export.
    cfg = train.resolve_config([f"--init_from={base}", "--lora.rank=4",
                                "--lora.targets=o_proj|down_proj", f"--export_peft={tmp_path}/a"])
    assert cfg.lora.targets == "o_proj|down_proj"
