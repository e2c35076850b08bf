"""The train command's flags, grouped by concern.

The command line is the whole configuration: `--seq_len=256`, `--model=llama3_8b`,
`--model.num_hidden_layers=4`, `--optimizer.lr=1e-3`. Each group is a frozen dataclass
(flags.py parses them); the model group is families.ModelConfig, with presets.
"""

import re
from dataclasses import dataclass
from typing import Literal

from trainer.families import PRESETS, ModelConfig
from trainer.attention import IMPLEMENTATIONS
from trainer.flags import ConfigError, flag
from trainer.model import DTYPES, REMAT_POLICIES
from trainer.optim import DECAYS, OPTIMIZERS
from trainer.tokenizer import parse_fields

# Choices of flags several commands share; each comes from the table that implements it.
Dtype = Literal[tuple(DTYPES)]
DataFormat = Literal["text", "chat", "fields", "preference"]


@dataclass(frozen=True)
class DataConfig:
    path: str = flag("builtin", "builtin | FILE | GLOB (.txt, .jsonl, .gz, .zst) | shard DIR from "
                     "trainer.tokenize | HF dataset name or dir (local or gs://)")
    format: DataFormat = flag(
        "text", "row layouts: text {\"text\": str} or .txt files | chat {\"messages\": "
        "[{\"role\": system|user|assistant, \"content\": str}, ...]}, loss on assistant turns | "
        "fields: any JSON row, rendered by --data.fields | preference {\"prompt\": str or "
        "messages, \"chosen\": str, \"rejected\": str}, loss on the responses")
    text_field: str = flag("text", "JSONL / dataset field holding the text")
    messages_field: str = flag("messages", "JSONL / dataset field holding chat messages")
    fields: str = flag(
        "", "with --data.format=fields, the template: comma-separated parts concatenated in "
        "order; a [bracketed] part is prompt (no loss), others carry loss; a part is pieces "
        "joined by +: a field name, a \"JSON literal\" or a special token like <|im_start|>; "
        "pieces and parts are separated by a newline, except next to a special token; empty "
        "fields add nothing. E.g. '[instruction+input],output'")
    packing: Literal["auto", "stream", "isolated"] = flag(
        "auto", "stream: documents concatenated and cut into rows (text only) | isolated: whole "
        "documents per row, each its own segment (segment_ids, positions; no attention or loss "
        "across them); longer text documents are cut into row-sized segments | auto: stream "
        "for text, else isolated")
    long: Literal["truncate", "drop"] = flag(
        "truncate", "a conversation or preference prompt longer than a row: truncate drops its "
        "earliest exchanges (keeping a system turn) | drop drops it; both are counted")
    skip_bad_rows: bool = flag(False, "skip rows that are malformed (and count them in a "
                               "warning) instead of stopping at the first")
    split: str = flag("train", "HF dataset split")
    val_fraction: float = flag(0.05, "fraction of documents held out for validation")
    cache_dir: str = flag("", "tokenization cache (empty: ~/.cache/meshlm/tokens)")
    mix: str = flag("", "weighted sources instead of --data.path: NAME=WEIGHT:PATH,... e.g. "
                    "'web=0.7:gs://b/web,code=0.3:gs://b/code'; each PATH as --data.path (shard "
                    "dirs from trainer.tokenize, files, globs); each step draws rows by weight")

    def __post_init__(self):
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"--data.val_fraction: {self.val_fraction} must be in [0, 1)")
        if self.format == "fields":
            if not self.fields:
                raise ConfigError("--data.format=fields needs --data.fields=TEMPLATE, e.g. "
                                  "--data.fields='[instruction+input],output'")
            parse_fields(self.fields)  # a bad template fails here, before anything runs
        elif self.fields:
            raise ConfigError(f"--data.fields is read only with --data.format=fields, not "
                              f"--data.format={self.format}")
        if self.mix:
            if self.path != "builtin":
                raise ConfigError("--data.mix names every source with its path; leave out --data.path")
            parse_mix(self.mix)
        if self.format != "text" and self.packing == "stream":
            raise ConfigError(f"--data.packing=stream would run {self.format} documents into "
                              "each other; use --data.packing=isolated (or auto)")

    @property
    def isolated(self) -> bool:
        """Whether documents are packed whole, each its own segment."""
        return self.packing == "isolated" or (self.packing == "auto" and self.format != "text")


def parse_mix(spec: str) -> list[tuple[str, float, str]]:
    """--data.mix='web=0.7:PATH,code=0.3:PATH' -> [(name, weight, path), ...]."""
    out = []
    for part in spec.split(","):
        name, eq, rest = part.partition("=")
        weight, colon, path = rest.partition(":")
        try:
            w = float(weight)
        except ValueError:
            w = -1.0
        if not (eq and colon and name.strip() and path.strip()) or not w > 0:
            raise ConfigError(f"--data.mix: cannot read {part!r}: each source is NAME=WEIGHT:PATH "
                              "with a positive weight, e.g. 'web=0.7:gs://b/web,code=0.3:code/*.jsonl'")
        out.append((name.strip(), w, path.strip()))
    names = [n for n, _, _ in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"--data.mix: source names must differ, got {', '.join(names)}")
    return out


@dataclass(frozen=True)
class OptimizerConfig:
    name: Literal[tuple(OPTIMIZERS)] = flag("adamw", "the optimizer")
    lr: float = flag(3e-3, "peak learning rate")
    warmup_steps: int = flag(20, "linear warmup steps")
    schedule: Literal[tuple(DECAYS)] = flag("cosine", "decay after warmup")
    min_lr_ratio: float = flag(0.1, "final lr as a fraction of the peak")
    weight_decay: float = flag(0.1, "decoupled weight decay (not on norms and biases)")
    b1: float = flag(0.9, "Adam beta1 (SGD momentum)")
    b2: float = flag(0.95, "Adam beta2")
    eps: float = flag(1e-8, "Adam epsilon")
    clip_norm: float = flag(1.0, "clip gradients to this global norm (0: off)")


def _check_regex(flag_name, pattern):
    try:
        re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"{flag_name}: {pattern!r} is not a regular expression ({e})") from None


@dataclass(frozen=True)
class LoraConfig:
    rank: int = flag(0, "LoRA adapter rank (0: off: train every weight --freeze leaves free)")
    alpha: float = flag(16.0, "the adapters' update x A B is scaled by alpha / rank")
    dropout: float = flag(0.0, "dropout on the adapters' input, during training")
    targets: str = flag(r"self_attn/[qkvo]_proj|mlp/(gate|up|down)_proj",
                        "regex over parameter paths (layers_0/self_attn/q_proj/kernel): the "
                        "attention and MLP kernels that get adapters")
    base_dtype: Literal[("",) + tuple(DTYPES)] = flag(
        "", "dtype the frozen base weights are stored in (empty: --param_dtype)")

    def __post_init__(self):
        if self.rank < 0 or self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise ConfigError(f"--lora: rank={self.rank}, alpha={self.alpha}, dropout="
                              f"{self.dropout}; need rank >= 0, alpha > 0, 0 <= dropout < 1")
        _check_regex("--lora.targets", self.targets)


@dataclass(frozen=True)
class DpoConfig:
    beta: float = flag(0.1, "DPO's beta (with --data.format=preference): larger keeps the "
                       "policy closer to the reference model")

    def __post_init__(self):
        if self.beta <= 0:
            raise ConfigError(f"--dpo.beta must be positive, got {self.beta}")


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = flag(PRESETS["tiny"], "model preset; override fields with "
                              "--model.<field>= (Hugging Face names)", presets=PRESETS)
    init_from: str = flag("", "start from a HF model dir or a meshlm checkpoint (weights, "
                          "config, tokenizer)")
    tokenizer: str = flag("", "bytes | HF tokenizer dir | SentencePiece .model file "
                          "(empty: the one of --init_from, else bytes)")
    seq_len: int = flag(128, "tokens per training row")
    batch_size: int = flag(16, "global batch size in rows (all hosts together)")
    grad_accum: int = flag(1, "micro-batches per step; batch_size must divide by grad_accum")
    steps: int = flag(300, "total optimizer steps")
    seed: int = flag(0, "seed for init and data order")
    dtype: Dtype = flag("float32", "compute dtype")
    param_dtype: Dtype = flag("float32", "parameter (and optimizer state) dtype")
    remat: Literal[("auto", "none") + tuple(REMAT_POLICIES)] = flag(
        "auto", "activation checkpointing per block: what each block keeps for the backward "
        "pass (offload: full, with block inputs in host memory on GPU/TPU; auto: none when "
        "the step fits the device's memory, else full)")
    scan_layers: Literal["auto", "true", "false"] = flag(
        "auto", "run the layers as one scan, so the step's memory follows one layer "
        "(auto: when the weights are split over devices, fsdp x tp > 1, or remat is on)")
    attention: Literal[IMPLEMENTATIONS] = flag(
        "auto", "attention kernel (auto: cudnn on GPU in bf16, splash on TPU, else blockwise)")
    loss_chunk: int = flag(0, "sequence positions per cross-entropy chunk, so that full logits "
                           "never exist (0: auto, by vocab and batch size)")
    mesh: str = flag("1,-1,1", "device mesh dp,fsdp,tp; one entry may be -1 (the devices "
                     "left over)")
    output_dir: str = flag("runs/tiny", "run directory (local or gs://): config.json, "
                           "metrics.jsonl, checkpoints/")
    log_every: int = flag(10, "steps between metrics lines")
    eval_every: int = flag(100, "steps between held-out evaluations (0: only at the end)")
    eval_batches: int = flag(8, "batches of held-out data per evaluation (0: all)")
    save_every: int = flag(0, "steps between checkpoints (0: only at the end)")
    keep: int = flag(3, "keep the newest N checkpoints (0: all)")
    keep_every: int = flag(0, "also keep every checkpoint whose step is a multiple of this "
                           "(0: none)")
    resume: Literal["auto", "never"] = flag("auto", "auto: continue from the newest checkpoint "
                                            "in output_dir | never: start over")
    overwrite: bool = flag(False, "with --resume=never, allow a non-empty output_dir")
    max_bad_steps: int = flag(5, "stop after this many non-finite (or spiking) steps in a row")
    spike_sigma: float = flag(0.0, "skip updates whose loss exceeds the rolling mean by this "
                              "many sigma (0: off)")
    debug_nan_steps: tuple[int, ...] = flag((), "testing aid: comma-separated steps (as "
                                            "logged) whose loss is made NaN")
    freeze: str = flag("", "regex over parameter paths to keep frozen, e.g. "
                       "'embed_tokens|layers_[0-7]/' (empty: train every weight)")
    export_hf: str = flag("", "after training, write a Hugging Face model dir here (with "
                          "LoRA: the merged model)")
    export_peft: str = flag("", "after training with --lora.rank, write the adapters here as "
                            "a PEFT adapter dir")
    push_to_hub: str = flag("", "after --export_hf, upload it to this HF hub repo id")
    async_loop: bool = flag(True, "prepare the next batch while the device runs, and fetch "
                            "metrics only on logging steps (false: wait on every step)")
    compile_cache: str = flag("~/.cache/meshlm/jax", "persistent XLA compilation cache dir, so "
                              "a re-run skips compiling (empty: off)")
    peak_tflops: float = flag(0.0, "peak bf16 TFLOP/s per device for MFU (0: look up the "
                              "device kind)")
    coordinator_address: str = flag("", "multi-host: host:port of process 0 (empty: "
                                    "auto-detect or single host)")
    num_processes: int = flag(0, "multi-host: number of processes (0: auto)")
    process_id: int = flag(-1, "multi-host: this process's index (-1: auto)")
    data: DataConfig = flag(DataConfig(), "where the training text comes from")
    optimizer: OptimizerConfig = flag(OptimizerConfig(), "how the weights move")
    lora: LoraConfig = flag(LoraConfig(), "low-rank adapters: train them, not the weights")
    dpo: DpoConfig = flag(DpoConfig(), "preference tuning")

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be at least 1, got {getattr(self, name)}")
        for name in ("eval_every", "eval_batches", "save_every", "keep", "keep_every",
                     "loss_chunk"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name} must be 0 or more, got {getattr(self, name)}")
        if self.seq_len > self.model.max_position_embeddings:
            raise ConfigError(
                f"--seq_len={self.seq_len} is longer than the model's max_position_embeddings="
                f"{self.model.max_position_embeddings}; lower --seq_len or raise "
                "--model.max_position_embeddings")
        if self.loss_chunk and self.seq_len % self.loss_chunk:
            raise ConfigError(f"--loss_chunk={self.loss_chunk} must divide --seq_len="
                              f"{self.seq_len}")
        _check_regex("--freeze", self.freeze)
        if self.freeze and self.lora.rank:
            raise ConfigError("--freeze and --lora.rank both choose what trains (LoRA freezes "
                              "every base weight); pick the layers with --lora.targets")
        if self.export_peft and not self.lora.rank:
            raise ConfigError("--export_peft writes LoRA adapters; pass --lora.rank too")
        if self.push_to_hub and not self.export_hf:
            raise ConfigError("--push_to_hub uploads the --export_hf dir; pass --export_hf=DIR "
                              "as well")
