"""Hugging Face files <-> meshlm: config and weight mapping, tokenizer files, export, hub.

Every family in families.py converts both ways: its transformers config class parses the
config.json (filling defaults, reading both the transformers 4 and 5 layouts), the shared
mapping below plus the family's own `from_hf` / `to_hf` turn it into a ModelConfig and
back, and `families.weight_map` is the one tensor table both directions use. meshlm's
params carry HF's names, so a tensor maps by a rename and, for Linear layers (HF stores
[out, in], Flax [in, out]), a transpose; a fused HF tensor splits along its first axis.
RoPE in model.py uses HF's rotate-half channel order, so q/k need no permutation.

Memory: import reads one tensor at a time (safetensors `safe_open`, and only the slice
each device holds); export fetches one tensor at a time and writes shard files tensor
by tensor. A model never exists twice in host memory.

Paths may be local or gs://: transformers and safetensors read local files only, so HF
dirs on gs:// are staged through a local temporary directory (storage.stage).
"""

import json
import os
import re
import shutil
import struct
import tempfile

import jax
import ml_dtypes
import numpy as np

from trainer import families, storage
from trainer import tokenizer as tokenizers
from trainer.errors import UserError, one_line
from trainer.families import ModelConfig
from trainer.flags import ConfigError
from trainer.model import DTYPES

_SAFETENSORS_DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16}
_SAFETENSORS_CODES = {np.dtype(t): code for code, t in _SAFETENSORS_DTYPES.items()}


class HFError(UserError):
    """A Hugging Face model, file or hub problem; one line naming it and the fix."""


# ------------------------------------------------------------------ config
def is_hf_dir(path):
    """A directory holding an HF config.json (one with a model_type or architectures;
    a meshlm run dir's config.json holds flags instead)."""
    if not path or path == "bytes":
        return False
    try:
        fs, p = storage.fs_and_path(path)
        if not fs.isfile(f"{p.rstrip('/')}/config.json"):
            return False
        raw = storage.read_json(f"{path.rstrip('/')}/config.json")
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and ("model_type" in raw or "architectures" in raw)


def _hf_config(path):
    """(family, transformers config, where) of an HF dir: its config.json parsed by the
    family's own transformers config class."""
    import transformers
    where = f"{path.rstrip('/')}/config.json"
    if not is_hf_dir(path):
        raise HFError(f"{path} is not a Hugging Face model dir (no config.json with a model_type)")
    raw = storage.read_json(where)
    archs = raw.get("architectures") or []
    family = families.family_for_hf(archs[0] if archs else None, raw.get("model_type"))
    if family is None:
        name = archs[0] if archs else raw.get("model_type")
        raise HFError(f"{where}: architecture {name!r} is not supported; meshlm reads "
                      + families.supported_text())
    try:
        return family, getattr(transformers, family.config_class).from_dict(raw), where
    except Exception as e:  # noqa: BLE001 -- transformers validates in many ways
        raise HFError(f"{where}: transformers rejects it: {one_line(e)[:300]}") from None


def _scaling_from_hf(params, max_positions, nested, top_level_original=None):
    """One HF rope_parameters dict -> (rope_theta, RopeScaling fields), read as transformers
    reads it: a config's top-level original_max_position_embeddings (Phi-3 keeps it there)
    wins for llama3 and yarn, and a zero beta_fast / beta_slow means the default."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in families.ROPE_TYPES:
        raise ConfigError(f"rope_type={rope_type!r} is not supported (meshlm has "
                          + ", ".join(families.ROPE_TYPES) + ")")
    if float(params.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ConfigError("partial_rotary_factor != 1 is not supported")
    params = dict(params)
    if top_level_original is not None and rope_type in ("llama3", "yarn"):
        params["original_max_position_embeddings"] = top_level_original
    scaling = {"rope_type": rope_type}
    for name in families.ROPE_TYPES[rope_type]:
        value = params.get(name)
        if value is None or (name in ("beta_fast", "beta_slow") and not value):
            continue
        if name == "original_max_position_embeddings" and float(value) == int(value):
            value = int(value)  # 8192.0 in some configs
        scaling[name] = value
    if rope_type == "yarn":
        old = scaling.get("original_max_position_embeddings") or max_positions
        scaling.setdefault("factor", max_positions / old)  # DeepSeek's convention, as in HF
        if nested:  # transformers reads `truncate` from the top-level dict only
            scaling.pop("truncate", None)
    return {"rope_theta": float(params.get("rope_theta", 10000.0)), "rope_scaling": scaling}


def model_config_from_hf(path):
    """An HF model dir's config.json -> its ModelConfig."""
    family, hfc, where = _hf_config(path)
    names = family.hf_names
    try:
        fields = dict(
            model_type=family.model_type,
            vocab_size=int(hfc.vocab_size),
            hidden_size=int(hfc.hidden_size),
            intermediate_size=int(hfc.intermediate_size),
            num_hidden_layers=int(hfc.num_hidden_layers),
            num_attention_heads=int(hfc.num_attention_heads),
            num_key_value_heads=int(hfc.num_key_value_heads or hfc.num_attention_heads),
            head_dim=getattr(hfc, "head_dim", None),
            max_position_embeddings=int(hfc.max_position_embeddings),
            rms_norm_eps=float(hfc.rms_norm_eps),
            tie_word_embeddings=bool(hfc.tie_word_embeddings),
            hidden_act=getattr(hfc, names.get("hidden_act", "hidden_act")),
        )
        rope = dict(hfc.rope_parameters or {})
        if any(isinstance(v, dict) for v in rope.values()):  # per layer kind (Gemma 3)
            full = _scaling_from_hf(rope.get("full_attention") or {}, fields[
                "max_position_embeddings"], nested=True)
            sliding = _scaling_from_hf(rope.get("sliding_attention") or {}, fields[
                "max_position_embeddings"], nested=True)
            fields.update(full, sliding_rope_theta=sliding["rope_theta"],
                          sliding_rope_scaling=sliding["rope_scaling"])
        else:
            fields.update(_scaling_from_hf(rope, fields["max_position_embeddings"], False, getattr(
                hfc, "original_max_position_embeddings", None)))
        fields.update(family.from_hf(hfc))
        return ModelConfig.from_dict(fields)
    except ConfigError as e:
        raise HFError(f"{where}: {e}") from None


def _scaling_to_hf(theta, scaling):
    out = {"rope_type": scaling.rope_type, "rope_theta": float(theta)}
    for name in families.ROPE_TYPES[scaling.rope_type]:
        if getattr(scaling, name) is not None:
            out[name] = getattr(scaling, name)
    return out


def hf_config(model_cfg: ModelConfig, dtype, bos_id=None, eos_id=None, pad_id=None):
    """A ModelConfig -> the transformers config object of its family's architecture."""
    import transformers
    family, c = model_cfg.family, model_cfg
    try:
        if family.per_layer_rope:
            rope = {kind: _scaling_to_hf(*c.rope(kind))
                    for kind in ("full_attention", "sliding_attention")}
        elif c.sliding_rope_theta is not None:
            raise ConfigError(f"{family.architecture} has one RoPE for all layers; set "
                              "model.sliding_rope_theta=none")
        else:
            rope = _scaling_to_hf(c.rope_theta, c.rope_scaling)
        kwargs = dict(
            architectures=[family.architecture], vocab_size=c.vocab_size,
            hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
            max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
            tie_word_embeddings=c.tie_word_embeddings, rope_parameters=rope,
            bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id, dtype=dtype)
        kwargs[family.hf_names.get("hidden_act", "hidden_act")] = c.hidden_act
        kwargs.update(family.to_hf(c))
    except ConfigError as e:
        raise HFError(f"cannot export as {family.architecture}: {e}") from None
    try:
        return getattr(transformers, family.config_class)(**kwargs)
    except Exception as e:  # noqa: BLE001 -- transformers validates in many ways
        raise HFError(f"cannot export as {family.architecture}: transformers rejects the "
                      f"config: {one_line(e)[:300]}") from None


# ------------------------------------------------------------------ weights
def _flat(tree):
    from trainer.sharding import path_str
    return {path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _unflat(flat, like):
    from trainer.sharding import path_str
    return jax.tree_util.tree_map_with_path(lambda p, _: flat[path_str(p)], like)


def _check_tree(flat, table, what):
    expected = {ml for t in table for ml in t.params}
    extra, missing = sorted(set(flat) - expected), sorted(expected - set(flat))
    if extra or missing:
        raise HFError(f"{what} do not match the model config: "
                      + (f"unexpected {extra[0]}" if extra else f"missing {missing[0]}"))


def _hf_shape(tensor, shapes):
    """The HF shape of a table entry, from its params' shapes (fused: stacked on axis 0)."""
    parts = [tuple(reversed(shapes[ml])) if tensor.transpose else tuple(shapes[ml])
             for ml in tensor.params]
    return (sum(p[0] for p in parts),) + parts[0][1:]


def _weight_files(path):
    """{HF tensor name: file name} of an HF dir's safetensors weights."""
    fs, root = storage.fs_and_path(path)
    root = root.rstrip("/")
    if fs.exists(f"{root}/model.safetensors.index.json"):
        index = storage.read_json(f"{path.rstrip('/')}/model.safetensors.index.json")
        return dict(index["weight_map"])
    files = sorted(os.path.basename(f) for f in fs.glob(f"{root}/*.safetensors"))
    if not files:
        others = [os.path.basename(f) for f in fs.glob(f"{root}/*.bin")]
        hint = (" (it has PyTorch .bin weights: re-save them with transformers, "
                "model.save_pretrained(dir), which writes safetensors)" if others else "")
        raise HFError(f"{path}: no *.safetensors weights found{hint}")
    from safetensors import safe_open
    local = storage.stage(path, files)
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
    local = storage.stage(path, [files[name]])
    with safe_open(os.path.join(local, files[name]), framework="numpy") as f:
        code = f.get_slice(name).get_dtype()
    if code not in _SAFETENSORS_DTYPES:
        raise HFError(f"{path}: {name} is stored as {code}; expected F32, BF16 or F16")
    return np.dtype(_SAFETENSORS_DTYPES[code])


def _shifted(index, offset, size):
    """A slice of one part of a fused axis -> the same slice of the whole axis."""
    start = (index.start or 0) + offset
    stop = (size if index.stop is None else index.stop) + offset
    return slice(start, stop)


def load_params(path, model_cfg: ModelConfig, abstract_params):
    """An HF dir's safetensors weights -> params placed on abstract_params' shardings.

    abstract_params: a pytree of jax.ShapeDtypeStruct with .sharding. Each device reads only
    its own slice of each tensor, cast to the abstract dtype; nothing is held twice."""
    from safetensors import safe_open
    table = families.weight_map(model_cfg)
    abstract = _flat(abstract_params)
    _check_tree(abstract, table, "the model's parameters")
    files = _weight_files(path)
    wanted = {t.hf for t in table}
    for name in files:  # a tensor of another layout means another model
        if name in wanted or name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and model_cfg.tie_word_embeddings:
            continue  # some tied checkpoints store the (identical) head anyway
        raise HFError(f"{path}: tensor {name} has no place in a meshlm "
                      f"{model_cfg.model_type} model with this config.json")
    missing = [t.hf for t in table if t.hf not in files]
    if missing:
        raise HFError(f"{path}: tensor {missing[0]} is missing from its safetensors files")
    local = storage.stage(path, sorted(set(files.values())))
    shapes = {ml: abstract[ml].shape for ml in abstract}
    handles = {}
    try:
        tensors = {}  # first every name and shape, so a mismatch fails before any reading
        for t in table:
            if files[t.hf] not in handles:  # pread: mmap'd pages would stay counted as ours
                handles[files[t.hf]] = safe_open(os.path.join(local, files[t.hf]),
                                                 framework="numpy", backend="pread")
            tensors[t.hf] = handles[files[t.hf]].get_slice(t.hf)
            shape, want = tuple(tensors[t.hf].get_shape()), _hf_shape(t, shapes)
            if shape != want:
                raise HFError(f"{path}: tensor {t.hf} has shape {list(shape)} but config.json "
                              f"implies {list(want)}")
        out = {}
        for t in table:
            offset = 0
            for ml in t.params:
                target = abstract[ml]
                size = target.shape[-1] if t.transpose else target.shape[0]  # its HF rows

                def read(index, tensor=tensors[t.hf], transpose=t.transpose, dtype=target.dtype,
                         offset=offset, size=size, ndim=len(target.shape)):
                    index = tuple(index) + (slice(None),) * (ndim - len(index))
                    if transpose:  # our [in, out] slice is HF's [out, in] slice, transposed
                        rows = _shifted(index[1], offset, size)
                        return tensor[rows, index[0]].T.astype(dtype, order="C")
                    index = (_shifted(index[0], offset, size),) + index[1:]
                    return np.ascontiguousarray(tensor[index].astype(dtype, copy=False))

                # Wait for each copy, so that host buffers don't pile up behind async transfers.
                out[ml] = jax.make_array_from_callback(target.shape, target.sharding,
                                                       read).block_until_ready()
                offset += size
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
        header[name] = {"dtype": _SAFETENSORS_CODES[np.dtype(dtype)], "shape": list(shape),
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
    fs, p = storage.fs_and_path(path)
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
    if not spec or not storage.exists(spec):
        raise HFError(f"{context} {spec!r} does not exist; pass "
                      "--tokenizer=bytes|HF_DIR|FILE.model")


def save_tokenizer(spec, out_dir):
    """Write the tokenizer a meshlm spec names as HF files into the local dir out_dir, with
    its chat template and generation_config.json; returns the transformers tokenizer."""
    import transformers
    check_tokenizer(spec)
    try:
        tok = tokenizers.to_hf(spec)
    except tokenizers.TokenizerError as e:
        raise HFError(f"cannot load the tokenizer {spec}: {e}") from None
    tok.save_pretrained(out_dir)
    generation = (f"{spec.rstrip('/')}/generation_config.json"
                  if spec != "bytes" and not spec.endswith(".model") else None)
    if generation and storage.exists(generation):
        shutil.copy(os.path.join(storage.stage(spec, ["generation_config.json"]),
                                 "generation_config.json"), out_dir)
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
    src_fs, src = storage.fs_and_path(spec)
    dst_fs, dst = storage.fs_and_path(out_dir)
    dst_fs.makedirs(dst, exist_ok=True)
    if src_fs.isfile(src) and spec.endswith(".model"):
        with src_fs.open(src, "rb") as f, dst_fs.open(f"{dst}/tokenizer.model", "wb") as g:
            shutil.copyfileobj(f, g)
        return f"{out_dir.rstrip('/')}/tokenizer.model"
    if src_fs.isfile(src):
        src = src.rsplit("/", 1)[0]
    for name in storage.TOKENIZER_FILES:
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


def is_peft_dir(path):
    """A directory holding a PEFT adapter (adapter_config.json)."""
    return storage.exists(f"{path.rstrip('/')}/adapter_config.json")


def check_export_dir(out_dir, peft=False):
    """An export may replace an empty dir or an earlier export of its kind, nothing else."""
    fs, p = storage.fs_and_path(out_dir)
    earlier = is_peft_dir(out_dir) if peft else is_hf_dir(out_dir)
    if fs.exists(p) and (not fs.isdir(p) or (fs.ls(p) and not earlier)):
        raise HFError(f"{out_dir} exists and is not a {'PEFT adapter' if peft else 'Hugging Face model'} "
                      "dir; export into an empty or new dir")


def peft_modules(model_cfg: ModelConfig, targets):
    """{kernel path: HF module name} of the kernels --lora.targets adapts. A fused HF tensor
    (Phi-3's qkv_proj) holds several of ours; peft's one adapter per module can't say that."""
    out = {}
    for t in families.weight_map(model_cfg):
        hits = [p for p in t.params if p.endswith("/kernel") and re.search(targets, p)]
        if hits and len(t.params) > 1:
            raise HFError(f"{t.hf} is fused from {len(t.params)} meshlm "
                          "kernels, which a PEFT adapter can't express; leave it out of "
                          "--lora.targets, or use --export_hf (the merged model)")
        if hits:
            out[hits[0]] = t.hf.removesuffix(".weight")
    return out


def export_peft(params, model_cfg: ModelConfig, lora, tokenizer_spec, out_dir, base_model=""):
    """Write the LoRA adapters in params as a PEFT adapter dir (adapter_config.json,
    adapter_model.safetensors, the tokenizer) that `PeftModel.from_pretrained(base, dir)`
    loads onto the base model. Every process calls it; process 0 writes."""
    check_export_dir(out_dir, peft=True)
    flat = _flat(params)
    modules = peft_modules(model_cfg, lora.targets)
    tensors = {}
    for kernel, module in modules.items():
        layer = kernel.removesuffix("/kernel")
        # peft's lora_A is a Linear(in, r): weight [r, in]; lora_B a Linear(r, out): [out, r].
        for ours, theirs in (("lora_a", "lora_A"), ("lora_b", "lora_B")):
            tensors[f"base_model.model.{module}.{theirs}.weight"] = np.ascontiguousarray(
                _to_host(flat[f"{layer}/{ours}"]).T)
    if jax.process_index() == 0:
        _write_peft(tensors, modules, lora, tokenizer_spec, out_dir, base_model)
    if jax.process_count() > 1:  # nobody goes on before the adapter is there
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("meshlm-peft-export")
    return out_dir


def _write_peft(tensors, modules, lora, tokenizer_spec, out_dir, base_model):
    from safetensors.numpy import save_file
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
              "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none",
              "target_modules": sorted(modules.values()), "fan_in_fan_out": False,
              "use_rslora": False, "inference_mode": True,
              "base_model_name_or_path": base_model}
    local_out = storage.is_local(out_dir)
    parent = os.path.dirname(os.path.abspath(out_dir)) if local_out else None
    if local_out:
        os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir.rstrip('/'))}.partial-",
                               dir=parent)
    try:
        save_file(tensors, os.path.join(staging, "adapter_model.safetensors"))
        save_tokenizer(tokenizer_spec, staging)
        with open(os.path.join(staging, "adapter_config.json"), "w") as f:
            json.dump(config, f, indent=2)
        _publish(staging, out_dir, last="adapter_config.json")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def export(params, model_cfg: ModelConfig, tokenizer_spec, out_dir, dtype=None, max_shard_size="5GB"):
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
    table = families.weight_map(model_cfg)
    flat = _flat(params)
    _check_tree(flat, table, "the parameters")
    check_export_dir(out_dir)
    check_tokenizer(tokenizer_spec)
    out_dtype = {ml: np.dtype(DTYPES[dtype]) if dtype else np.dtype(flat[ml].dtype)
                 for ml in flat}
    hf_config(model_cfg, "float32")  # fail on an unexportable config before writing anything
    is_main = jax.process_index() == 0

    param_shapes = {ml: flat[ml].shape for ml in flat}
    shapes = {t.hf: (_hf_shape(t, param_shapes), out_dtype[t.params[0]]) for t in table}
    split = split_state_dict_into_shards_factory(
        shapes, get_storage_size=lambda s: int(np.prod(s[0])) * s[1].itemsize,
        filename_pattern="model{suffix}.safetensors", max_shard_size=shard_bytes)
    source = {t.hf: t for t in table}

    def get(hf):  # one tensor, HF layout, on the host (a fused one stacked from its parts)
        t = source[hf]
        parts = [_to_host(flat[ml].astype(out_dtype[ml])) for ml in t.params]
        parts = [p.T if t.transpose else p for p in parts]
        return np.ascontiguousarray(np.concatenate(parts) if len(parts) > 1 else parts[0])

    local_out = storage.is_local(out_dir)
    parent = os.path.dirname(os.path.abspath(out_dir)) if local_out else None
    if is_main and local_out:
        os.makedirs(parent, exist_ok=True)
    staging = (tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir.rstrip('/'))}.partial-",
                                dir=parent) if is_main else None)
    try:
        if is_main:
            tok = save_tokenizer(tokenizer_spec, staging)
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            first = out_dtype[table[0].params[0]]
            hf_config(model_cfg, first.name, tok.bos_token_id, tok.eos_token_id,
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


def _publish(staging, out_dir, last="config.json"):
    """Move a finished local staging dir to out_dir, replacing an earlier export; on an
    object store the file that marks the dir as complete (`last`) is uploaded last."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp made it private
    if storage.is_local(out_dir):
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.rename(staging, out_dir)
        return
    fs, p = storage.fs_and_path(out_dir)
    storage.forget_staged(out_dir)  # an earlier local copy of it is stale now
    if fs.exists(p):
        fs.rm(p, recursive=True)
    files = sorted(os.listdir(staging), key=lambda n: n == last)
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
    folder = storage.stage(local_dir)
    api = HfApi(token=os.environ.get("HF_TOKEN") or None)
    try:
        api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
        return api.upload_folder(folder_path=folder, repo_id=repo_id, repo_type="model",
                                 commit_message="Upload model exported by meshlm")
    except Exception as e:  # noqa: BLE001 -- network, auth and hub errors all land here
        raise HFError(f"--push_to_hub={repo_id}: upload failed ({one_line(e)[:200]}); set "
                      "HF_TOKEN to a token with write access") from None
