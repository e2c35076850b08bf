"""trainer/hf.py and trainer/convert.py against transformers (torch on CPU) as the oracle.

Random tiny HF models of every family (tests/tiny_hf.py) are built offline; meshlm must
give the same logits after import, transformers the same logits after export, a round
trip the same bits, and eval / a first training step the same loss as transformers.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

from tiny_hf import CHATML, COMMON, FAMILIES, hf_tensors, make_hf_dir, torch_logits
from trainer import checkpoint, config, convert, data, flags, hf, loading, sharding, train
from trainer.families import ModelConfig
from trainer.model import build_model
from trainer.tokenizer import BUILTIN_CHAT_TEMPLATE, ByteTokenizer, load_tokenizer

try:  # the GCS emulator fixture, for the gs:// round trip
    import test_gcs
    from test_gcs import gcs  # noqa: F401
except ImportError:
    test_gcs = None

TOL = 1e-5


def abstract_params(model_cfg, mesh=None):
    """The model and its params' ShapeDtypeStructs, on one device or on a mesh's shardings."""
    model = build_model(model_cfg)
    if mesh is None:
        return model, loading.abstract_params(
            model, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0),
                                               jnp.zeros((1, 1), jnp.int32)))["params"]
    shardings = sharding.state_shardings(shapes, mesh, sharding.param_rules(model_cfg, mesh))
    return model, loading.abstract_params(model, shardings)


def masked_loss(logits, targets, mask):
    logp = torch.log_softmax(torch.tensor(logits, dtype=torch.float64), -1)
    nll = -logp.gather(-1, torch.tensor(targets, dtype=torch.long)[..., None])[..., 0]
    mask = torch.tensor(mask, dtype=torch.float64)
    return float((nll * mask).sum()), float(mask.sum())


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {f: (str(root / f), make_hf_dir(str(root / f), f, seed=i))
            for i, f in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, COMMON["vocab_size"], (2, 40), dtype=np.int32)


# ------------------------------------------------------------------ import and export parity
@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_and_export_logits_match_transformers(family, family_dirs, tokens, tmp_path):
    path, torch_model = family_dirs[family]
    expected = torch_logits(torch_model, tokens)
    model_cfg = hf.model_config_from_hf(path)
    assert model_cfg.family.config_class == FAMILIES[family][0].__name__
    # Imported straight onto an 8-device dp,fsdp,tp = 1,4,2 mesh: every slice path is used.
    mesh = sharding.make_mesh("1,4,2", model_cfg)
    model, abstract = abstract_params(model_cfg, mesh)
    params = hf.load_params(path, model_cfg, abstract)
    assert jax.tree.leaves(params)[0].sharding == jax.tree.leaves(abstract)[0].sharding
    ours = np.asarray(jax.jit(model.apply)({"params": params}, tokens))
    print(f"{family}: import max|logits diff| {np.abs(ours - expected).max():.2e}")
    assert np.abs(ours - expected).max() < TOL

    out = str(tmp_path / "export")
    hf.export(params, model_cfg, path, out, max_shard_size="40KB")  # several shards
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded).__name__ == model_cfg.family.architecture
    print(f"{family}: export max|logits diff| {np.abs(torch_logits(reloaded, tokens) - ours).max():.2e}")
    assert np.abs(torch_logits(reloaded, tokens) - ours).max() < TOL
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == CHATML and tok.eos_token_id == torch_model.config.eos_token_id
    assert hf.model_config_from_hf(out) == model_cfg


def test_old_config_layout_reads_the_same(family_dirs, tokens, tmp_path):
    """rope_theta at the top and rope_scaling (transformers 4) vs rope_parameters (5)."""
    path, torch_model = family_dirs["llama3_tied"]
    old = str(tmp_path / "old")
    shutil.copytree(path, old)
    raw = json.load(open(os.path.join(old, "config.json")))
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    raw["torch_dtype"] = raw.pop("dtype", "float32")
    json.dump(raw, open(os.path.join(old, "config.json"), "w"))
    assert hf.model_config_from_hf(old) == hf.model_config_from_hf(path)
    model_cfg = hf.model_config_from_hf(old)
    model, abstract = abstract_params(model_cfg)
    params = hf.load_params(old, model_cfg, abstract)
    ours = np.asarray(model.apply({"params": params}, tokens))
    assert np.abs(ours - torch_logits(torch_model, tokens)).max() < TOL


@pytest.mark.parametrize("family,edit", [
    # Phi-3's habit: original_max_position_embeddings at the top level, which transformers
    # prefers to the one in rope_parameters (here they differ).
    ("llama_yarn", lambda raw: raw.update(original_max_position_embeddings=16)),
    ("llama3_tied", lambda raw: raw.update(original_max_position_embeddings=16)),
    # Zero betas mean YaRN's defaults, and a whole float is an int.
    ("llama_yarn", lambda raw: raw["rope_parameters"].update(
        beta_fast=0, beta_slow=0, original_max_position_embeddings=64.0)),
])
def test_rope_config_quirks_read_as_transformers_reads_them(family, edit, family_dirs, tokens,
                                                            tmp_path):
    path, _ = family_dirs[family]
    edited = str(tmp_path / "edited")
    shutil.copytree(path, edited)
    raw = json.load(open(os.path.join(edited, "config.json")))
    edit(raw)
    json.dump(raw, open(os.path.join(edited, "config.json"), "w"))
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(edited).eval()
    expected = torch_logits(torch_model, tokens)
    model, params, _ = loading.load_model(edited)
    assert np.abs(np.asarray(model.apply({"params": params}, tokens)) - expected).max() < TOL
    out = str(tmp_path / "export")
    hf.export(params, model.cfg, edited, out)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert np.abs(torch_logits(reloaded, tokens) - expected).max() < TOL


def test_export_bf16_and_single_file(family_dirs, tokens, tmp_path):
    path, torch_model = family_dirs["qwen2"]
    model_cfg = hf.model_config_from_hf(path)
    model, abstract = abstract_params(model_cfg)
    params = hf.load_params(path, model_cfg, abstract)
    out = str(tmp_path / "bf16")
    hf.export(params, model_cfg, path, out, dtype="bf16")
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
    assert not os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    with safe_open(os.path.join(out, "model.safetensors"), framework="numpy") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    # bf16 rounding of the weights only: the logits stay close.
    assert np.abs(torch_logits(reloaded, tokens) - torch_logits(torch_model, tokens)).max() < 0.05
    # bf16 HF weights import into fp32 params exactly (bf16 -> fp32 is exact).
    again = hf.load_params(out, model_cfg, abstract)
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(bf16)))


def test_remote_paths_stage_through_local_files(family_dirs, tokens):
    """gs:// and other fsspec URLs (here memory://): read and written through a local copy."""
    import fsspec
    path, torch_model = family_dirs["llama3_tied"]
    fs = fsspec.filesystem("memory")
    fs.put(path + "/", "/src", recursive=True)
    assert hf.is_hf_dir("memory://src") and not hf.is_hf_dir("memory://nothing")
    model_cfg = hf.model_config_from_hf("memory://src")
    assert model_cfg == hf.model_config_from_hf(path)
    model, abstract = abstract_params(model_cfg)
    params = hf.load_params("memory://src", model_cfg, abstract)
    ours = np.asarray(model.apply({"params": params}, tokens))
    assert np.abs(ours - torch_logits(torch_model, tokens)).max() < TOL
    hf.export(params, model_cfg, "memory://src", "memory://dst", max_shard_size="40KB")
    assert fs.exists("/dst/model.safetensors.index.json") and fs.exists("/dst/tokenizer.json")
    again = hf.load_params("memory://dst", model_cfg, abstract)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params)))
    fs.rm("/src", recursive=True)
    fs.rm("/dst", recursive=True)


# ------------------------------------------------------------------ tokenizers
def test_bytes_tokenizer_exports_as_an_equivalent_hf_tokenizer(tmp_path):
    hf.save_tokenizer("bytes", str(tmp_path))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = ByteTokenizer()
    text = "Grüße, 日本!\n\n  tabs\tand <|user|> tags"
    assert tok.encode(text, add_special_tokens=False) == ours.encode(text)
    assert tok(text)["input_ids"] == ours.encode_text(text) == [256] + ours.encode(text)
    assert tok.decode(ours.encode(text)) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 258)
    chat = [{"role": "user", "content": "Hi ü"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "More"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert list(ids) == ours.apply_chat_template(chat)  # the built-in chat format, kept
    gen = json.load(open(tmp_path / "generation_config.json"))
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (256, 257, 258)


def test_sentencepiece_model_exports_as_hf_tokenizer(tmp_path):
    import sentencepiece as spm
    from pydoc_data.topics import topics
    lines = [ln for t in sorted(topics)[:10] for ln in topics[t].splitlines() if ln.strip()]
    prefix = str(tmp_path / "sp")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=prefix,
                                   vocab_size=400, byte_fallback=True, minloglevel=2)
    out = str(tmp_path / "tok")
    hf.save_tokenizer(prefix + ".model", out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    for text in ["Hello world, this is a test.", "def f(x):\n    return x ü 日本"]:
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text)
    assert tok.chat_template == BUILTIN_CHAT_TEMPLATE


# ------------------------------------------------------------------ the command line
@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    from pydoc_data.topics import topics
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": topics[t][:1500]}) + "\n"
                            for t in sorted(topics)[:40]))
    return str(path)


def test_convert_round_trip_eval_and_finetune_parity(family_dirs, text_file, tmp_path, cli):
    """HF -> checkpoint -> HF is bit-exact; eval on the checkpoint and a first training step
    from the HF dir report transformers' loss; the run's --export_hf is its checkpoint."""
    path, torch_model = family_dirs["llama_gqa"]
    ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "back")
    cache = f"--data.cache_dir={tmp_path / 'cache'}"
    cli("convert", f"--input={path}", f"--output={ckpt}")
    cli("convert", f"--input={ckpt}", f"--output={back}", "--max_shard_size=30KB")
    ev = cli("eval", f"--checkpoint={ckpt}", f"--data={text_file}", "--seq_len=32",
             "--batch_size=4", f"--cache_dir={tmp_path / 'cache'}")
    ev_hf = cli("eval", f"--checkpoint={path}", f"--data={text_file}", "--seq_len=32",
                "--batch_size=4", f"--cache_dir={tmp_path / 'cache'}")
    run_dir, export = str(tmp_path / "run"), str(tmp_path / "run_export")
    argv = [f"--init_from={path}", "--steps=1", "--batch_size=4", "--seq_len=32",
            f"--data.path={text_file}", "--data.val_fraction=0", cache, "--log_every=1",
            "--optimizer.warmup_steps=0", f"--output_dir={run_dir}", f"--export_hf={export}",
            "--mesh=1,2,1"]
    cli("train", *argv, devices=2)

    # Round trip: the same tensors, bit for bit, and the same config.
    original, returned = hf_tensors(path), hf_tensors(back)
    assert sorted(original) == sorted(returned)
    for name in original:
        assert original[name].dtype == returned[name].dtype
        assert np.array_equal(original[name], returned[name]), name
    assert hf.model_config_from_hf(back) == hf.model_config_from_hf(path)
    assert transformers.AutoTokenizer.from_pretrained(back).chat_template == CHATML

    # The converted checkpoint is a self-contained meshlm checkpoint.
    meta, step = checkpoint.load_meta(ckpt)
    assert step == 0 and meta["model"] == hf.model_config_from_hf(path).to_dict()
    assert meta["tokenizer"].startswith(ckpt) and load_tokenizer(meta["tokenizer"])
    cfg = train.resolve_config([f"--init_from={ckpt}"])
    assert cfg.model.to_dict() == meta["model"] and cfg.tokenizer == meta["tokenizer"]
    model, abstract = abstract_params(cfg.model)
    params = loading.load_weights(cfg.init_from, cfg.model, abstract)
    q = np.asarray(params["layers_1"]["self_attn"]["q_proj"]["kernel"])
    assert np.array_equal(q, original["model.layers.1.self_attn.q_proj.weight"].T)

    # Eval on the checkpoint == transformers' loss on the same rows.
    tok = load_tokenizer(path)
    dcfg = config.DataConfig(path=text_file, val_fraction=0.0, cache_dir=str(tmp_path / "cache"))
    dataset, _ = data.load_dataset(dcfg, tok, 32)
    total, count = 0.0, 0.0
    for batch in dataset.eval_batches(4):
        s, n = masked_loss(torch_logits(torch_model, batch["inputs"]), batch["targets"],
                           batch["loss_mask"])
        total, count = total + s, count + n
    result = json.loads(ev.stdout.strip().splitlines()[-1])
    assert json.loads(ev_hf.stdout.strip().splitlines()[-1]) == result  # HF dir: the same
    print(f"eval loss diff {abs(result['loss'] - total / count):.1e}")
    assert abs(result["loss"] - total / count) < TOL and result["tokens"] == count

    # Fine-tune: the step-1 loss is transformers' loss on the first batch.
    cfg = train.resolve_config(argv)
    train_data, _ = data.load_dataset(cfg.data, load_tokenizer(cfg.tokenizer), cfg.seq_len)
    batch = train_data.batch(0, cfg.batch_size, cfg.seed)
    s, n = masked_loss(torch_logits(torch_model, batch["inputs"]), batch["targets"],
                       batch["loss_mask"])
    metrics = [json.loads(ln) for ln in open(os.path.join(run_dir, "metrics.jsonl"))]
    step1 = next(m for m in metrics if m["step"] == 1 and "loss" in m)
    print(f"step-1 loss diff {abs(step1['loss'] - s / n):.1e}")
    assert abs(step1["loss"] - s / n) < TOL

    # --export_hf wrote the trained weights: exactly the final checkpoint's.
    meta, _ = checkpoint.load_meta(run_dir)
    _, abstract = abstract_params(ModelConfig.from_dict(meta["model"]))
    trained = checkpoint.load_params(run_dir, abstract)
    exported = hf_tensors(export)
    assert np.array_equal(exported["model.layers.0.mlp.down_proj.weight"],
                          np.asarray(trained["layers_0"]["mlp"]["down_proj"]["kernel"]).T)
    assert np.array_equal(exported["model.embed_tokens.weight"],
                          np.asarray(trained["embed_tokens"]["embedding"]))
    assert not np.array_equal(exported["model.embed_tokens.weight"],
                              original["model.embed_tokens.weight"])  # it did train
    transformers.AutoModelForCausalLM.from_pretrained(export)
    transformers.AutoTokenizer.from_pretrained(export)


def test_push_to_hub_uploads_the_export(family_dirs, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.setattr("huggingface_hub.HfApi.create_repo", lambda self, **kw: calls.append(
        ("create_repo", self.token, kw)))
    monkeypatch.setattr("huggingface_hub.HfApi.upload_folder", lambda self, **kw: calls.append(
        ("upload_folder", self.token, kw)) or "https://huggingface.co/me/tiny/commit/1")
    path, _ = family_dirs["mistral"]
    model_cfg = hf.model_config_from_hf(path)
    _, abstract = abstract_params(model_cfg)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    mngr = checkpoint.manager(checkpoint.checkpoint_dir(ckpt), async_save=False)
    checkpoint.save(mngr, 3, {"params": hf.load_params(path, model_cfg, abstract),
                              "step": jnp.int32(3)},
                    {"model": model_cfg.to_dict(), "tokenizer": path, "config": {}})
    mngr.wait_until_finished()
    convert.main([f"--input={ckpt}", f"--output={out}", "--push_to_hub=me/tiny", "--dtype=bf16"])
    assert [c[0] for c in calls] == ["create_repo", "upload_folder"]
    assert all(c[1] == "hf_test_token" for c in calls)
    assert calls[0][2]["repo_id"] == "me/tiny" and calls[0][2]["exist_ok"]
    assert calls[1][2]["repo_id"] == "me/tiny" and calls[1][2]["folder_path"] == out
    assert transformers.AutoConfig.from_pretrained(out).model_type == "mistral"
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
    with safe_open(os.path.join(out, "model.safetensors"), framework="numpy") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # --dtype=bf16

    def failing(self, **kw):
        raise ConnectionError("hub unreachable")
    monkeypatch.setattr("huggingface_hub.HfApi.upload_folder", failing)
    with pytest.raises(hf.HFError, match="--push_to_hub=me/tiny: upload failed.*HF_TOKEN"):
        hf.push_to_hub(out, "me/tiny")
    with pytest.raises(hf.HFError, match="not a hub repo id"):
        hf.push_to_hub(out, "not a repo")


# ------------------------------------------------------------------ errors
def _rewrite_config(src, dst, **changes):
    shutil.copytree(src, dst)
    raw = json.load(open(os.path.join(dst, "config.json")))
    raw.update(changes)
    json.dump(raw, open(os.path.join(dst, "config.json"), "w"))
    return dst


def test_errors_name_the_problem(family_dirs, tmp_path, capsys):
    llama, _ = family_dirs["llama_gqa"]
    mistral, _ = family_dirs["mistral"]
    with pytest.raises(hf.HFError, match="'GPT2LMHeadModel' is not supported; meshlm reads "
                                         "LlamaForCausalLM.*MistralForCausalLM.*Qwen2"):
        hf.model_config_from_hf(_rewrite_config(llama, str(tmp_path / "gpt2"), model_type="gpt2",
                                                architectures=["GPT2LMHeadModel"]))
    with pytest.raises(hf.HFError, match=r"config.json: model.hidden_act: expected one of "
                                         r"silu, gelu, gelu_pytorch_tanh, got \"relu\""):
        hf.model_config_from_hf(_rewrite_config(llama, str(tmp_path / "relu"), hidden_act="relu"))
    with pytest.raises(hf.HFError, match="rope_type='dynamic' is not supported"):
        hf.model_config_from_hf(_rewrite_config(llama, str(tmp_path / "dyn"), rope_parameters={
            "rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}))
    with pytest.raises(hf.HFError, match="partial_rotary_factor != 1 is not supported"):
        hf.model_config_from_hf(_rewrite_config(mistral, str(tmp_path / "partial"),
                                                partial_rotary_factor=0.5))
    # A config the family's HF class cannot express is refused before anything is written.
    windowed = ModelConfig(model_type="llama", hidden_size=64, num_attention_heads=4,
                           num_key_value_heads=4, sliding_window=16)
    with pytest.raises(hf.HFError, match="cannot export as LlamaForCausalLM: LlamaForCausalLM "
                                         "has no sliding-window attention"):
        hf.hf_config(windowed, "float32")
    mixed = ModelConfig(model_type="mistral", hidden_size=64, num_attention_heads=4,
                        num_key_value_heads=4, num_hidden_layers=2, sliding_window=16,
                        layer_types=("sliding_attention", "full_attention"))
    with pytest.raises(hf.HFError, match="MistralForCausalLM applies one sliding window"):
        hf.hf_config(mixed, "float32")

    wide = _rewrite_config(llama, str(tmp_path / "wide"), intermediate_size=128)
    model_cfg = hf.model_config_from_hf(wide)
    _, abstract = abstract_params(model_cfg)
    with pytest.raises(hf.HFError, match=r"tensor model.layers.0.mlp.gate_proj.weight has shape "
                                         r"\[96, 64\] but config.json implies \[128, 64\]"):
        hf.load_params(wide, model_cfg, abstract)

    # convert: an unsupported input gets one line and exit 1, nothing written.
    with pytest.raises(SystemExit, match="error: .*architecture 'GPT2LMHeadModel' is not"):
        convert.main([f"--input={tmp_path / 'gpt2'}", f"--output={tmp_path / 'x'}"])
    assert not os.path.exists(tmp_path / "x")

    # A checkpoint whose tokenizer is gone, exported without --tokenizer.
    notok = str(tmp_path / "notok")
    make_hf_dir(notok, "qwen2", tokenizer=False)
    with pytest.raises(hf.HFError, match="has no tokenizer files.*--tokenizer="):
        train.resolve_config([f"--init_from={notok}"])
    assert train.resolve_config([f"--init_from={notok}", "--tokenizer=bytes"]).tokenizer == "bytes"
    tok_dir = str(tmp_path / "tok")
    hf.save_tokenizer("bytes", tok_dir)
    ckpt = str(tmp_path / "ckpt")
    convert.main([f"--input={notok}", f"--output={ckpt}", f"--tokenizer={tok_dir}"])
    shutil.rmtree(os.path.join(ckpt, "tokenizer"))
    with pytest.raises(SystemExit, match="error: the tokenizer of checkpoint .* does not exist; "
                                         "pass --tokenizer="):
        convert.main([f"--input={ckpt}", f"--output={tmp_path / 'y'}"])
    convert.main([f"--input={ckpt}", f"--output={tmp_path / 'y'}", "--tokenizer=bytes"])
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "y")).eos_token_id == 257

    with pytest.raises(flags.ConfigError, match="--push_to_hub .*--export_hf"):
        train.resolve_config(["--push_to_hub=me/tiny"])
    with pytest.raises(SystemExit, match="--push_to_hub uploads an HF model dir"):
        convert.main([f"--input={llama}", f"--output={tmp_path / 'z'}", "--push_to_hub=me/x"])
    with pytest.raises(SystemExit, match="exists and is not empty; pass --overwrite"):
        convert.main([f"--input={llama}", f"--output={ckpt}"])
    with pytest.raises(flags.ConfigError,
                       match="--export_hf: .* exists and is not a Hugging Face model dir"):
        train.resolve_config([f"--export_hf={tmp_path}"])



@pytest.mark.slow
def test_convert_round_trip_on_gcs(tmp_path, request, cli):
    """gs:// both ways against the local GCS emulator of test_gcs.py: bit-exact."""
    if test_gcs is None:
        pytest.skip("tests/test_gcs.py (the GCS emulator) is not there")
    gcs = request.getfixturevalue("gcs")
    src = str(tmp_path / "hf")
    make_hf_dir(src, "llama3_tied")
    for name in os.listdir(src):
        test_gcs.upload(gcs, f"hf/{name}", open(os.path.join(src, name), "rb").read())
    env, bucket = test_gcs.gcs_env(gcs), f"gs://{test_gcs.BUCKET}"
    cli("convert", f"--input={bucket}/hf", f"--output={bucket}/ck", env=env)
    assert "ck/tokenizer/tokenizer.json" in test_gcs.names(gcs, "ck/tokenizer/")
    cli("convert", f"--input={bucket}/ck", f"--output={bucket}/back", "--max_shard_size=40KB",
        env=env)
    back = tmp_path / "back"
    back.mkdir()
    for name in test_gcs.names(gcs, "back/"):
        (back / name.split("/", 1)[1]).write_bytes(test_gcs.download(gcs, name))
    original, returned = hf_tensors(src), hf_tensors(str(back))
    assert sorted(original) == sorted(returned)
    assert all(np.array_equal(original[k], returned[k]) for k in original)
    assert transformers.AutoTokenizer.from_pretrained(str(back)).chat_template == CHATML
