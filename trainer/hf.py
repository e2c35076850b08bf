"""Hugging Face <-> meshlm: config and weight mapping, export, push to hub.

Supported: LlamaForCausalLM (LLaMA 1, 2, 3, 3.1, 3.2: GQA, llama3 RoPE scaling, tied
embeddings, attention/mlp bias), MistralForCausalLM (without an active sliding window)
and Qwen2ForCausalLM (q/k/v bias).

Weights: meshlm's params carry HF's names, so the mapping is a rename and, for Linear
layers (HF stores [out, in], Flax [in, out]), a transpose. RoPE in model.py uses HF's
rotate-half channel order, so q/k need no permutation. `weight_map` below is the one
table both directions use.

Memory: import reads one tensor at a time (safetensors `safe_open`, and only the slice
each device holds); export fetches one tensor at a time and writes shard files tensor
by tensor. A model never exists twice in host memory.

Paths may be local or gs://. transformers and safetensors read local files only, so
HF dirs on gs:// are staged through a local temporary directory.
"""

import json
import os
import shutil
import struct
import tempfile

import fsspec
import jax
import ml_dtypes
import numpy as np

from trainer.config import UserError, model_fields

SUPPORTED = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
             "Qwen2ForCausalLM": "qwen2"}
ARCHITECTURES = {model_type: arch for arch, model_type in SUPPORTED.items()}
SUPPORTED_TEXT = ("LlamaForCausalLM (LLaMA 1-3.2), MistralForCausalLM (no sliding window), "
                  "Qwen2ForCausalLM")

# Files that make up a tokenizer in an HF dir (copied as they are on import).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "chat_template.jinja",
                   "chat_template.json", "vocab.json", "merges.txt", "generation_config.json")

# data.Tokenizer's built-in chat format, as a Jinja template, for tokenizers that bring
# none: models fine-tuned on it must be prompted the same way after export.
BUILTIN_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>\n{{ m['content'] }}{{ eos_token }}"
    "{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

DTYPES = {"bf16": ml_dtypes.bfloat16, "bfloat16": ml_dtypes.bfloat16, "fp32": np.float32,
          "float32": np.float32, "fp16": np.float16, "float16": np.float16}
_ST_CODES = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16",
             np.dtype(np.float16): "F16"}
_ST_DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16}
_HF_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(ml_dtypes.bfloat16): "bfloat16",
                   np.dtype(np.float16): "float16"}


class HFError(UserError):
    """A Hugging Face model, file or hub problem; one line naming it and the fix."""


# ------------------------------------------------------------------ paths
def _fs(path):
    return fsspec.core.url_to_fs(path)


def _is_local(path):
    return "://" not in path or path.startswith("file://")


def _exists(path):
    fs, p = _fs(path)
    return fs.exists(p)


_STAGED = {}  # remote dir -> its local staging dir, so files are fetched once per process


def _stage(path, names=None):
    """A local dir holding `names` (those that exist; None: every file) of the dir `path`;
    path itself when it is local."""
    if _is_local(path):
        return path
    fs, root = _fs(path)
    root = root.rstrip("/")
    if root not in _STAGED:
        _STAGED[root] = tempfile.mkdtemp(prefix="meshlm-hf-")
    local = _STAGED[root]
    if names is None:
        names = [os.path.basename(f) for f in fs.ls(root, detail=False)]
    for name in names:
        if not os.path.exists(os.path.join(local, name)) and fs.isfile(f"{root}/{name}"):
            fs.get(f"{root}/{name}", os.path.join(local, name))
    return local


def _read_json(path):
    with fsspec.open(path, "r") as f:
        return json.load(f)


def _one_line(e):
    return " ".join(str(e).split()) or type(e).__name__


# ------------------------------------------------------------------ config
def is_hf_dir(path):
    """A directory holding an HF config.json (one with a model_type or architectures;
    a meshlm run dir's config.json holds flags instead)."""
    if not path or path == "bytes":
        return False
    try:
        fs, p = _fs(path)
        if not fs.isfile(f"{p.rstrip('/')}/config.json"):
            return False
        raw = _read_json(f"{path.rstrip('/')}/config.json")
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and ("model_type" in raw or "architectures" in raw)


def _hf_config(path):
    """The raw config.json of an HF dir, checked for a supported architecture, parsed by
    transformers' own config class (which fills defaults and reads both RoPE layouts)."""
    import transformers
    if not is_hf_dir(path):
        raise HFError(f"{path} is not a Hugging Face model dir (no config.json with a model_type)")
    raw = _read_json(f"{path.rstrip('/')}/config.json")
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    arch = archs[0] if archs else ARCHITECTURES.get(model_type)
    if arch not in SUPPORTED or (model_type and SUPPORTED[arch] != model_type):
        raise HFError(f"{path}/config.json: architecture {arch or model_type!r} is not supported; "
                      f"meshlm reads {SUPPORTED_TEXT}")
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config}[SUPPORTED[arch]]
    try:
        return cls.from_dict(raw), raw
    except Exception as e:  # noqa: BLE001 -- transformers validates in many ways
        raise HFError(f"{path}/config.json: transformers rejects it: {_one_line(e)[:300]}") from None


def model_config_from_hf(path):
    """An HF model dir's config.json -> a full meshlm model config dict (HF field names)."""
    hfc, raw = _hf_config(path)
    where = f"{path.rstrip('/')}/config.json"
    model_type = hfc.model_type

    def unsupported(what):
        return HFError(f"{where}: {what}; meshlm supports {SUPPORTED_TEXT} with silu MLPs, "
                       "default or llama3 RoPE and full attention")

    if hfc.hidden_act != "silu":
        raise unsupported(f"hidden_act={hfc.hidden_act!r} is not supported")
    rope = dict(hfc.rope_parameters or {})
    if any(isinstance(v, dict) for v in rope.values()):
        raise unsupported("per-layer rope_parameters are not supported")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise unsupported(f"rope_type={rope_type!r} is not supported")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise unsupported("partial_rotary_factor != 1 is not supported")
    window = getattr(hfc, "sliding_window", None)
    if model_type == "mistral" and window is not None and window < hfc.max_position_embeddings:
        raise HFError(f"{where}: sliding_window={window} is in effect (< max_position_embeddings="
                      f"{hfc.max_position_embeddings}) and meshlm has full attention only; set "
                      f"\"sliding_window\": null there to import it (identical up to {window} "
                      "tokens)")
    if model_type == "qwen2" and "sliding_attention" in (hfc.layer_types or []):
        raise HFError(f"{where}: sliding-window layers (use_sliding_window) are not supported; "
                      "meshlm has full attention only")
    scaling = dict(rope_type=rope_type)
    if rope_type == "llama3":
        scaling.update(
            factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope.get("original_max_position_embeddings")
                                                  or hfc.max_position_embeddings))
    head_dim = int(getattr(hfc, "head_dim", None) or 0)  # 0: hidden_size // heads, as in meshlm
    return model_fields(
        model_type=model_type,
        vocab_size=int(hfc.vocab_size),
        hidden_size=int(hfc.hidden_size),
        intermediate_size=int(hfc.intermediate_size),
        num_hidden_layers=int(hfc.num_hidden_layers),
        num_attention_heads=int(hfc.num_attention_heads),
        num_key_value_heads=int(hfc.num_key_value_heads or hfc.num_attention_heads),
        head_dim=0 if head_dim == hfc.hidden_size // hfc.num_attention_heads else head_dim,
        max_position_embeddings=int(hfc.max_position_embeddings),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rope_scaling=scaling,
        rms_norm_eps=float(hfc.rms_norm_eps),
        tie_word_embeddings=bool(hfc.tie_word_embeddings),
        attention_bias=bool(getattr(hfc, "attention_bias", False)) and model_type == "llama",
        qkv_bias=model_type == "qwen2",
        mlp_bias=bool(getattr(hfc, "mlp_bias", False)) and model_type == "llama",
    )


def _as_dict(model_cfg):
    return model_cfg.to_dict() if hasattr(model_cfg, "to_dict") else dict(model_cfg)


def hf_config(model_cfg, dtype, bos_id=None, eos_id=None, pad_id=None):
    """A meshlm model config -> the transformers config object of its architecture."""
    import transformers
    c = _as_dict(model_cfg)
    model_type = c["model_type"]
    if model_type not in ARCHITECTURES:
        raise HFError(f"model.model_type={model_type!r} has no Hugging Face architecture; use "
                      "one of " + ", ".join(ARCHITECTURES))
    bias = {"llama": (c["qkv_bias"] and not c["attention_bias"],
                      "q/k/v bias without o bias (qkv_bias) is Qwen2's layout; set "
                      "model.model_type=qwen2"),
            "mistral": (c["qkv_bias"] or c["attention_bias"] or c["mlp_bias"],
                        "MistralForCausalLM has no biases; set model.model_type=llama"),
            "qwen2": (not c["qkv_bias"] or c["attention_bias"] or c["mlp_bias"],
                      "Qwen2ForCausalLM has q/k/v bias only (qkv_bias=true, attention_bias and "
                      "mlp_bias false); set model.model_type=llama")}[model_type]
    if bias[0]:
        raise HFError(f"cannot export as {ARCHITECTURES[model_type]}: {bias[1]}")
    scaling = c["rope_scaling"]
    rope = {"rope_type": scaling["rope_type"], "rope_theta": float(c["rope_theta"])}
    if scaling["rope_type"] == "llama3":
        rope.update({k: scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                             "original_max_position_embeddings")})
    kwargs = dict(
        architectures=[ARCHITECTURES[model_type]],
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        max_position_embeddings=c["max_position_embeddings"], hidden_act="silu",
        rms_norm_eps=c["rms_norm_eps"], tie_word_embeddings=c["tie_word_embeddings"],
        rope_parameters=rope, bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id,
        dtype=dtype)
    if c["head_dim"]:  # else the architecture's default, hidden_size // num_attention_heads
        kwargs.update(head_dim=c["head_dim"])
    if model_type == "llama":
        cls = transformers.LlamaConfig
        kwargs.update(attention_bias=c["attention_bias"], mlp_bias=c["mlp_bias"])
    elif model_type == "mistral":
        cls = transformers.MistralConfig
        kwargs.update(sliding_window=None)
    else:
        cls = transformers.Qwen2Config
        kwargs.update(use_sliding_window=False, sliding_window=None)
    return cls(**kwargs)


# ------------------------------------------------------------------ weights
def weight_map(model_cfg):
    """[(HF tensor name, meshlm param path, transpose)] for a model config, in HF's order."""
    c = _as_dict(model_cfg)
    out = [("model.embed_tokens.weight", "embed_tokens/embedding", False)]
    for i in range(c["num_hidden_layers"]):
        hf, ml = f"model.layers.{i}", f"layers_{i}"
        for p in ("q", "k", "v", "o"):
            out.append((f"{hf}.self_attn.{p}_proj.weight", f"{ml}/self_attn/{p}_proj/kernel", True))
            if c["attention_bias"] or (c["qkv_bias"] and p != "o"):
                out.append((f"{hf}.self_attn.{p}_proj.bias", f"{ml}/self_attn/{p}_proj/bias", False))
        for p in ("gate", "up", "down"):
            out.append((f"{hf}.mlp.{p}_proj.weight", f"{ml}/mlp/{p}_proj/kernel", True))
            if c["mlp_bias"]:
                out.append((f"{hf}.mlp.{p}_proj.bias", f"{ml}/mlp/{p}_proj/bias", False))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out.append((f"{hf}.{norm}.weight", f"{ml}/{norm}/scale", False))
    out.append(("model.norm.weight", "norm/scale", False))
    if not c["tie_word_embeddings"]:
        out.append(("lm_head.weight", "lm_head/kernel", True))
    return out


def _flat(tree):
    from trainer.sharding import path_str
    return {path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _unflat(flat, like):
    from trainer.sharding import path_str
    return jax.tree_util.tree_map_with_path(lambda p, _: flat[path_str(p)], like)


def _check_tree(flat, table, what):
    expected = {ml for _, ml, _ in table}
    extra, missing = sorted(set(flat) - expected), sorted(expected - set(flat))
    if extra or missing:
        raise HFError(f"{what} do not match the model config: "
                      + (f"unexpected {extra[0]}" if extra else f"missing {missing[0]}"))


def _weight_files(path):
    """{HF tensor name: file name} of an HF dir's safetensors weights."""
    fs, root = _fs(path)
    root = root.rstrip("/")
    if fs.exists(f"{root}/model.safetensors.index.json"):
        return dict(_read_json(f"{path.rstrip('/')}/model.safetensors.index.json")["weight_map"])
    files = sorted(os.path.basename(f) for f in fs.glob(f"{root}/*.safetensors"))
    if not files:
        others = [os.path.basename(f) for f in fs.glob(f"{root}/*.bin")]
        hint = (" (it has PyTorch .bin weights: re-save them with transformers, "
                "model.save_pretrained(dir), which writes safetensors)" if others else "")
        raise HFError(f"{path}: no *.safetensors weights found{hint}")
    from safetensors import safe_open
    local = _stage(path, files)
    names = {}
    for name in files:
        with safe_open(os.path.join(local, name), framework="numpy") as f:
            names.update({k: name for k in f.keys()})
    return names


def stored_dtype(path):
    """The dtype the embedding of an HF dir is stored in (a numpy dtype)."""
    from safetensors import safe_open
    files = _weight_files(path)
    name = "model.embed_tokens.weight"
    if name not in files:
        raise HFError(f"{path}: no tensor {name} in its safetensors files")
    local = _stage(path, [files[name]])
    with safe_open(os.path.join(local, files[name]), framework="numpy") as f:
        code = f.get_slice(name).get_dtype()
    if code not in _ST_DTYPES:
        raise HFError(f"{path}: {name} is stored as {code}; expected F32, BF16 or F16")
    return np.dtype(_ST_DTYPES[code])


def load_params(path, model_cfg, abstract_params):
    """An HF dir's safetensors weights -> params placed on abstract_params' shardings.

    abstract_params: a pytree of jax.ShapeDtypeStruct with .sharding. Each device reads only
    its own slice of each tensor, cast to the abstract dtype; nothing is held twice."""
    from safetensors import safe_open
    table = weight_map(model_cfg)
    abstract = _flat(abstract_params)
    _check_tree(abstract, table, "the model's parameters")
    files = _weight_files(path)
    wanted = {hf for hf, _, _ in table}
    for name in files:  # a tensor of another layout means another model
        if name in wanted or name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and _as_dict(model_cfg)["tie_word_embeddings"]:
            continue  # some tied checkpoints store the (identical) head anyway
        raise HFError(f"{path}: tensor {name} has no place in a meshlm "
                      f"{_as_dict(model_cfg)['model_type']} model with this config.json")
    missing = [hf for hf, _, _ in table if hf not in files]
    if missing:
        raise HFError(f"{path}: tensor {missing[0]} is missing from its safetensors files")
    local = _stage(path, sorted(set(files.values())))
    handles = {}
    try:
        tensors = {}  # first every name and shape, so a mismatch fails before any reading
        for hf, ml, transpose in table:
            if files[hf] not in handles:  # pread: mmap'd pages would stay counted as ours
                handles[files[hf]] = safe_open(os.path.join(local, files[hf]),
                                               framework="numpy", backend="pread")
            tensors[hf] = handles[files[hf]].get_slice(hf)
            shape, target = tuple(tensors[hf].get_shape()), abstract[ml].shape
            want = tuple(reversed(target)) if transpose else tuple(target)
            if shape != want:
                raise HFError(f"{path}: tensor {hf} has shape {list(shape)} but config.json "
                              f"implies {list(want)}")
        out = {}
        for hf, ml, transpose in table:
            target = abstract[ml]

            def read(index, tensor=tensors[hf], transpose=transpose, dtype=target.dtype):
                index = tuple(index) + (slice(None),) * (len(target.shape) - len(index))
                if transpose:  # our [in, out] slice is HF's [out, in] slice, transposed
                    return tensor[index[::-1]].T.astype(dtype, order="C")
                return np.ascontiguousarray(tensor[index].astype(dtype, copy=False))

            # Wait for each copy, so that host buffers don't pile up behind async transfers.
            out[ml] = jax.make_array_from_callback(target.shape, target.sharding,
                                                   read).block_until_ready()
        return _unflat(out, abstract_params)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)


def _write_safetensors(path, entries, get):
    """Write one safetensors file tensor by tensor. entries: [(name, shape, np dtype)];
    get(name) -> that array. safetensors' own writer needs every tensor of the file in
    memory at once; the format is a JSON header and the raw bytes, so we stream it."""
    header, offset = {}, 0
    for name, shape, dtype in entries:
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _ST_CODES[np.dtype(dtype)], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}  # transformers requires it
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, dtype in entries:
            array = get(name)
            assert array.shape == tuple(shape) and array.dtype == np.dtype(dtype), name
            f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)


def _to_host(x):
    """One parameter as a numpy array on every process (a collective if it spans hosts)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# ------------------------------------------------------------------ tokenizer
def has_tokenizer(path):
    fs, p = _fs(path)
    return any(fs.exists(f"{p.rstrip('/')}/{n}")
               for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def tokenizer_spec(hf_dir, override=""):
    """The tokenizer for a model taken from an HF dir: --tokenizer if given, else the dir."""
    if override:
        return override
    if not has_tokenizer(hf_dir):
        raise HFError(f"{hf_dir} has no tokenizer files (tokenizer.json, tokenizer_config.json "
                      "or tokenizer.model); pass --tokenizer=bytes|HF_DIR|FILE.model")
    return hf_dir


def check_tokenizer(spec, context="tokenizer"):
    """Raise if a tokenizer spec names files that are gone; context says whose it is."""
    if spec == "bytes":
        return
    if not spec or not _exists(spec):
        raise HFError(f"{context} {spec!r} does not exist; pass "
                      "--tokenizer=bytes|HF_DIR|FILE.model")


def _byte_tokenizer():
    """data.ByteTokenizer as an HF tokenizer: ids 0-255 are the bytes, 256/257/258 are
    bos/eos/pad (byte-level BPE without merges)."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    chars = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|bos|>", "<|eos|>", "<|pad|>")])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>")


def save_tokenizer(spec, out_dir):
    """Write the tokenizer named by a meshlm tokenizer spec as HF files into the local dir
    out_dir (with a chat template and generation_config.json); returns the HF tokenizer."""
    import transformers
    check_tokenizer(spec)
    source = None
    if spec == "bytes":
        tok = _byte_tokenizer()
    else:
        fs, path = _fs(spec)
        if fs.isfile(path) and spec.endswith(".model"):  # SentencePiece: converted by transformers
            source = tempfile.mkdtemp(prefix="meshlm-sp-")
            fs.get(path, os.path.join(source, "tokenizer.model"))
        else:
            if fs.isfile(path):  # tokenizer.json or tokenizer_config.json
                spec = spec.rsplit("/", 1)[0]
            source = _stage(spec, TOKENIZER_FILES + ("config.json",))
        try:
            tok = transformers.AutoTokenizer.from_pretrained(source, local_files_only=True)
        except Exception as e:  # noqa: BLE001
            raise HFError(f"cannot load the tokenizer {spec}: {_one_line(e)[:300]}") from None
    if not tok.chat_template:
        tok.chat_template = BUILTIN_CHAT_TEMPLATE
    tok.save_pretrained(out_dir)
    if source and os.path.exists(os.path.join(source, "generation_config.json")):
        shutil.copy(os.path.join(source, "generation_config.json"), out_dir)
    else:
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        transformers.GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                      pad_token_id=pad).save_pretrained(out_dir)
    return tok


def copy_tokenizer(spec, out_dir):
    """Copy a tokenizer's files as they are into out_dir (local or gs://) -> the spec that
    names the copy. 'bytes' needs no files."""
    if spec == "bytes":
        return spec
    check_tokenizer(spec)
    src_fs, src = _fs(spec)
    dst_fs, dst = _fs(out_dir)
    dst_fs.makedirs(dst, exist_ok=True)
    if src_fs.isfile(src) and spec.endswith(".model"):
        with src_fs.open(src, "rb") as f, dst_fs.open(f"{dst}/tokenizer.model", "wb") as g:
            shutil.copyfileobj(f, g)
        return f"{out_dir.rstrip('/')}/tokenizer.model"
    if src_fs.isfile(src):
        src = src.rsplit("/", 1)[0]
    for name in TOKENIZER_FILES:
        if src_fs.exists(f"{src}/{name}"):
            with src_fs.open(f"{src}/{name}", "rb") as f, dst_fs.open(f"{dst}/{name}", "wb") as g:
                shutil.copyfileobj(f, g)
    return out_dir


# ------------------------------------------------------------------ export
def shard_size_bytes(size):
    """'5GB', '500MB', '100KB' (powers of 10, as the hub counts) or plain bytes -> bytes."""
    text = str(size).strip().upper()
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    try:
        value = int(text) if text.isdigit() else float(text[:-2]) * units[text[-2:]]
    except (KeyError, ValueError):
        value = 0
    if value <= 0:
        raise HFError(f"--max_shard_size: {size!r} is not a size like 500MB or 5GB")
    return int(value)


def check_export_dir(out_dir):
    """An export may replace an empty dir or an earlier HF export, nothing else."""
    fs, p = _fs(out_dir)
    if fs.exists(p) and (not fs.isdir(p) or (fs.ls(p) and not is_hf_dir(out_dir))):
        raise HFError(f"{out_dir} exists and is not a Hugging Face model dir; export into an "
                      "empty or new dir")


def export(params, model_cfg, tokenizer_spec, out_dir, dtype=None, max_shard_size="5GB"):
    """Write params as a Hugging Face model dir (local or gs://) that
    `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load as is:
    config.json, generation_config.json, tokenizer files and safetensors shards (with
    model.safetensors.index.json when there is more than one).

    dtype: None keeps each parameter's own dtype (the run's --param_dtype, float32 by
    default, so nothing is lost); 'bf16' | 'fp32' | 'fp16' casts. Every process must call
    it (a parameter spread over hosts is gathered one at a time); process 0 writes. The
    dir appears complete or not at all (written aside, then renamed into place)."""
    from huggingface_hub import split_state_dict_into_shards_factory
    if dtype and dtype not in DTYPES:
        raise HFError(f"--dtype: unknown {dtype!r}; use bf16, fp32 or fp16")
    shard_bytes = shard_size_bytes(max_shard_size)
    table = weight_map(model_cfg)
    flat = _flat(params)
    _check_tree(flat, table, "the parameters")
    check_export_dir(out_dir)
    check_tokenizer(tokenizer_spec)
    out_dtype = {ml: np.dtype(DTYPES[dtype]) if dtype else np.dtype(flat[ml].dtype)
                 for _, ml, _ in table}
    hf_config(model_cfg, "float32")  # fail on an unexportable config before writing anything
    is_main = jax.process_index() == 0

    shapes = {hf: (tuple(reversed(flat[ml].shape)) if t else tuple(flat[ml].shape), out_dtype[ml])
              for hf, ml, t in table}
    split = split_state_dict_into_shards_factory(
        shapes, get_storage_size=lambda s: int(np.prod(s[0])) * s[1].itemsize,
        filename_pattern="model{suffix}.safetensors", max_shard_size=shard_bytes)
    source = {hf: (ml, t) for hf, ml, t in table}

    def get(hf):  # one tensor, HF layout, on the host
        ml, transpose = source[hf]
        array = _to_host(flat[ml].astype(out_dtype[ml]))
        return np.ascontiguousarray(array.T) if transpose else array

    local_out = _is_local(out_dir)
    parent = os.path.dirname(os.path.abspath(out_dir)) if local_out else None
    if is_main and local_out:
        os.makedirs(parent, exist_ok=True)
    staging = (tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir.rstrip('/'))}.partial-",
                                dir=parent) if is_main else None)
    try:
        if is_main:
            tok = save_tokenizer(tokenizer_spec, staging)
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            first = out_dtype[table[0][1]]
            hf_config(model_cfg, _HF_DTYPE_NAMES[first], tok.bos_token_id, tok.eos_token_id,
                      pad).save_pretrained(staging)
        for filename, names in split.filename_to_tensors.items():
            entries = [(n, *shapes[n]) for n in names]
            if is_main:
                _write_safetensors(os.path.join(staging, filename), entries, get)
            else:
                for n in names:
                    get(n)  # take part in gathers of parameters spread over hosts
        if is_main and split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            with open(os.path.join(staging, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
        if is_main:
            _publish(staging, out_dir)
            staging = None
    finally:
        if staging:
            shutil.rmtree(staging, ignore_errors=True)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("meshlm-hf-export")
    return out_dir


def _publish(staging, out_dir):
    """Move a finished local staging dir to out_dir, replacing an earlier export."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp made it private
    if _is_local(out_dir):
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.rename(staging, out_dir)
        return
    fs, p = _fs(out_dir)
    _STAGED.pop(p.rstrip("/"), None)  # an earlier local copy of it is stale now
    if fs.exists(p):
        fs.rm(p, recursive=True)
    files = sorted(os.listdir(staging), key=lambda n: n == "config.json")  # config.json last
    for name in files:
        fs.put(os.path.join(staging, name), f"{p.rstrip('/')}/{name}")
    shutil.rmtree(staging, ignore_errors=True)


def push_to_hub(local_dir, repo_id, private=None):
    """Upload an exported dir to the HF hub (token: $HF_TOKEN or `hf auth login`); returns
    the commit URL. Process 0 only."""
    if jax.process_index() != 0:
        return None
    from huggingface_hub import HfApi
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise HFError(f"--push_to_hub: {repo_id!r} is not a hub repo id like user/model-name") \
            from None
    folder = _stage(local_dir)
    api = HfApi(token=os.environ.get("HF_TOKEN") or None)
    try:
        api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
        return api.upload_folder(folder_path=folder, repo_id=repo_id, repo_type="model",
                                 commit_message="Upload model exported by meshlm")
    except Exception as e:  # noqa: BLE001 -- network, auth and hub errors all land here
        raise HFError(f"--push_to_hub={repo_id}: upload failed ({_one_line(e)[:200]}); set "
                      "HF_TOKEN to a token with write access") from None
