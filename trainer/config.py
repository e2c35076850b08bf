"""Every flag of meshlm, grouped into one ConfigDict per concern, and the model presets.

The command line is the whole configuration: `--seq_len=256`, `--model=llama3_8b`,
`--model.num_hidden_layers=4`, `--optimizer.lr=1e-3`. A flag's type is its
default's type. We parse by hand because no flag library offers "a preset name
plus dotted overrides of its fields" with one-line errors; it is short.
"""

import copy
import json
import sys

from ml_collections import ConfigDict


class UserError(ValueError):
    """Bad input from the user. Programs print its one-line message and exit 1."""


class ConfigError(UserError):
    """A bad flag. The message is one line that names the flag and the fix."""


# ---------------------------------------------------------------- models
# Field names are Hugging Face's, so `--model.num_hidden_layers=4` means what an
# HF user expects and config conversion is a rename at most.

def model_fields(**overrides):
    cfg = dict(
        model_type="llama",  # llama | mistral | qwen2 (the HF architecture on export)
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=0,  # 0: hidden_size // num_attention_heads
        max_position_embeddings=4096,
        rope_theta=10000.0,
        # rope_type "default" (plain RoPE) or "llama3" (LLaMA-3.1 frequency scaling).
        rope_scaling=dict(rope_type="default", factor=1.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=False,  # bias on q, k, v and o (HF Llama's flag)
        qkv_bias=False,  # bias on q, k, v only (Qwen2)
        mlp_bias=False,
    )
    for key, value in overrides.items():
        if isinstance(value, dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


MODEL_PRESETS = {
    # ~0.9M params: the demo default, trains in minutes on a laptop CPU.
    "tiny": model_fields(vocab_size=384, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
    "llama2_7b": model_fields(),
    "llama3_8b": model_fields(vocab_size=128256, intermediate_size=14336, num_key_value_heads=8,
                        max_position_embeddings=8192, rope_theta=500000.0),
    "llama3.2_1b": model_fields(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                          num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=64, max_position_embeddings=131072, rope_theta=500000.0,
                          rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                            high_freq_factor=4.0,
                                            original_max_position_embeddings=8192),
                          tie_word_embeddings=True),
    "mistral_7b": model_fields(model_type="mistral", vocab_size=32768, intermediate_size=14336,
                         num_key_value_heads=8, max_position_embeddings=32768,
                         rope_theta=1000000.0),
    "qwen2.5_0.5b": model_fields(model_type="qwen2", vocab_size=151936, hidden_size=896,
                           intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                           num_key_value_heads=2, max_position_embeddings=32768,
                           rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                           qkv_bias=True),
}


def model_config(name):
    if name not in MODEL_PRESETS:
        raise ConfigError(f"--model: unknown preset '{name}'; choose one of: "
                          + ", ".join(MODEL_PRESETS))
    return ConfigDict(copy.deepcopy(MODEL_PRESETS[name]))


# ---------------------------------------------------------------- all flags
# (default, help). Groups become dotted flags: --data.path, --optimizer.lr.

FLAGS = {
    "model": ("tiny", "model preset: " + " | ".join(MODEL_PRESETS)
              + "; override fields with --model.<field>= (HF names)"),
    "init_from": ("", "start from a HF model dir or a meshlm checkpoint (weights, config, tokenizer)"),
    "tokenizer": ("", "bytes | HF tokenizer dir | SentencePiece .model file "
                  "(empty: the one of --init_from, else bytes)"),
    "seq_len": (128, "tokens per training row"),
    "batch_size": (16, "global batch size in rows (all hosts together)"),
    "grad_accum": (1, "micro-batches per step; batch_size must divide by grad_accum"),
    "steps": (300, "total optimizer steps"),
    "seed": (0, "seed for init and data order"),
    "dtype": ("float32", "compute dtype: float32 | bfloat16 | float16"),
    "param_dtype": ("float32", "parameter (and optimizer state) dtype"),
    "remat": ("none", "activation checkpointing per block: none | full | dots | dots_no_batch"),
    "mesh": ("1,-1,1", "device mesh dp,fsdp,tp; one entry may be -1 (the devices left over)"),
    "output_dir": ("runs/tiny", "run directory (local or gs://): config.json, metrics.jsonl, checkpoints/"),
    "log_every": (10, "steps between metrics lines"),
    "eval_every": (100, "steps between held-out evaluations (0: only at the end)"),
    "eval_batches": (8, "batches of held-out data per evaluation (0: all)"),
    "save_every": (0, "steps between checkpoints (0: only at the end)"),
    "keep": (3, "keep the newest N checkpoints"),
    "keep_every": (0, "also keep every checkpoint whose step is a multiple of this (0: none)"),
    "resume": ("auto", "auto: continue from the newest checkpoint in output_dir | never: start over"),
    "overwrite": (False, "with --resume=never, allow a non-empty output_dir"),
    "max_bad_steps": (5, "stop after this many non-finite (or spiking) steps in a row"),
    "spike_sigma": (0.0, "skip updates whose loss exceeds the rolling mean by this many sigma (0: off)"),
    "debug_nan_steps": ("", "testing aid: comma-separated steps (as logged) whose loss is made NaN"),
    "export_hf": ("", "after training, write a Hugging Face model dir here"),
    "push_to_hub": ("", "after --export_hf, upload it to this HF hub repo id"),
    "peak_tflops": (0.0, "peak bf16 TFLOP/s per device for MFU (0: look up the device kind)"),
    "coordinator_address": ("", "multi-host: host:port of process 0 (empty: auto-detect or single host)"),
    "num_processes": (0, "multi-host: number of processes (0: auto)"),
    "process_id": (-1, "multi-host: this process's index (-1: auto)"),
    "data": {
        "path": ("builtin", "builtin | FILE | GLOB | HF dataset name or dir (local or gs://)"),
        "format": ("text", "text | chat (messages with loss on assistant turns only)"),
        "text_field": ("text", "JSONL / dataset field holding the text"),
        "messages_field": ("messages", "JSONL / dataset field holding chat messages"),
        "split": ("train", "HF dataset split"),
        "val_fraction": (0.05, "fraction of documents held out for validation"),
        "cache_dir": ("", "tokenization cache (empty: ~/.cache/meshlm/tokens)"),
    },
    "optimizer": {
        "name": ("adamw", "adamw | adafactor | sgd"),
        "lr": (3e-3, "peak learning rate"),
        "warmup_steps": (20, "linear warmup steps"),
        "schedule": ("cosine", "cosine | linear | constant (after warmup)"),
        "min_lr_ratio": (0.1, "final lr as a fraction of the peak"),
        "weight_decay": (0.1, "decoupled weight decay (not on norms and biases)"),
        "b1": (0.9, "Adam beta1"),
        "b2": (0.95, "Adam beta2"),
        "eps": (1e-8, "Adam epsilon"),
        "clip_norm": (1.0, "clip gradients to this global norm (0: off)"),
    },
}


def _defaults(spec):
    return {k: _defaults(v) if isinstance(v, dict) else v[0] for k, v in spec.items()}


def default_config(spec=FLAGS):
    cfg = _defaults(spec)
    if "model" in spec:  # a preset name that expands into its fields
        cfg["model_name"] = cfg["model"]
        cfg["model"] = model_config(cfg["model"]).to_dict()
    return ConfigDict(cfg)


def _coerce(flag, text, default):
    """Parse a flag's text as the type of its default."""
    if isinstance(default, bool):
        if text.lower() in ("1", "true", "yes", ""):
            return True
        if text.lower() in ("0", "false", "no"):
            return False
        raise ConfigError(f"--{flag}: expected true or false, got '{text}'")
    for kind, word in ((int, "an integer"), (float, "a number")):
        if isinstance(default, kind):
            try:
                return kind(text)
            except ValueError:
                raise ConfigError(f"--{flag}: expected {word}, got '{text}'") from None
    return text


def _split_args(argv):
    """['--a=1', '--b', '2', '--c'] -> [('a', '1'), ('b', '2'), ('c', None)]."""
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}'; flags look like --name=value")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is not None and not nxt.startswith("--"):
                value, i = nxt, i + 1
            else:
                value = None  # a bare boolean flag
        pairs.append((name.replace("-", "_"), value))
        i += 1
    return pairs


def parse_flags(argv, spec=FLAGS, base_model=None):
    """argv (without the program name) -> ConfigDict. Raises ConfigError.

    base_model: model fields taken from --init_from instead of a preset."""
    cfg = default_config(spec).to_dict()
    pairs = _split_args(argv)
    if base_model is not None:
        if any(name == "model" for name, _ in pairs):
            raise ConfigError("--model and --init_from both name a model; drop --model "
                              "(override single fields with --model.<field>=)")
        cfg["model"], cfg["model_name"] = dict(base_model), "init_from"
    # The preset goes first so that --model.<field> overrides it wherever it appears.
    for name, value in pairs:
        if name == "model" and "model" in spec and base_model is None:
            cfg["model"] = model_config(value).to_dict()
            cfg["model_name"] = value
    for name, value in pairs:
        if name == "model" and "model" in spec:
            continue
        *parents, leaf = name.split(".")
        node = cfg
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise ConfigError(f"--{name}: unknown flag; see --help")
            node = node[part]
        if leaf not in node or isinstance(node[leaf], dict):
            raise ConfigError(f"--{name}: unknown flag; see --help")
        if value is None and not isinstance(node[leaf], bool):
            raise ConfigError(f"--{name}: needs a value, e.g. --{name}=...")
        node[leaf] = _coerce(name, value or "", node[leaf])
    return ConfigDict(cfg)


def help_text(program, spec=FLAGS):
    lines = [f"usage: python -m {program} [--flag=value ...]", ""]

    def walk(spec, prefix):
        for key, value in spec.items():
            if isinstance(value, dict):
                lines.append("")
                walk(value, f"{prefix}{key}.")
            else:
                default, doc = value
                lines.append(f"  --{prefix}{key}={default!r}".ljust(40) + f" {doc}")
    walk(spec, "")
    if "model" not in spec:
        return "\n".join(lines)
    lines.append("")
    lines.append("  model fields (--model.<field>=, Hugging Face names), shown for the tiny preset:")
    for key, value in MODEL_PRESETS["tiny"].items():
        lines.append(f"    --model.{key}={value!r}")
    return "\n".join(lines)


def parse_or_exit(program, spec=FLAGS, argv=None):
    """Parse sys.argv for a command-line program: --help prints help, errors exit 2."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "--helpfull") for a in argv):
        print(help_text(program, spec))
        sys.exit(0)
    try:
        return parse_flags(argv, spec)
    except ConfigError as e:
        sys.exit(f"error: {e}")


def to_json(cfg):
    return json.dumps(cfg.to_dict(), indent=2, sort_keys=True)
