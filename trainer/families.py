"""Model families: the one config every family shares, and each family declared once.

`ModelConfig` is the model's whole description, in Hugging Face's field names, so that
`--model.num_hidden_layers=4` means what an HF user expects. Its `model_type` selects a
`Family`, and the family decides the model's structure through its `Switches`.

A family entry holds everything meshlm knows about that architecture:
  - its HF architecture and transformers config class,
  - the config mapping both ways (`from_hf`, `to_hf`: the fields that differ from the
    shared mapping in hf.py),
  - its weight map (names follow HF; `fused` lists HF tensors that hold several of our
    parameters, such as a fused qkv_proj),
  - extra sharding rules (tried before sharding.PARAM_RULES),
  - the model switches it turns on, and its presets.

How to add a family (say, one with a fused qkv_proj and post-norms):
  1. If its structure needs something model.py lacks, add a switch to `Switches` and
     implement it in model.py (one `if` where the paper puts it).
  2. Add one `Family(...)` to FAMILIES below: architecture, config class, switches,
     `from_hf`/`to_hf` for its own config fields, `fused` tensors and presets.
  3. Add a random tiny model of it to tests/tiny_hf.py: logits parity both ways,
     greedy generation and the bitwise round trip then cover it.
"""

import dataclasses
from dataclasses import dataclass
from typing import Callable, Literal, NamedTuple

import jax

from trainer.flags import ConfigError, flag

LayerType = Literal["full_attention", "sliding_attention"]

# The gated MLP's activation, by HF's name: silu is SwiGLU, the gelus GeGLU.
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # Gemma
}

# RoPE scaling types, and the RopeScaling fields each one reads (HF names them alike).
ROPE_TYPES = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "attention_factor", "mscale", "mscale_all_dim", "truncate"),
}


# ------------------------------------------------------------------ the shared config
@dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are stretched for long context (HF's rope_scaling)."""
    rope_type: Literal[tuple(ROPE_TYPES)] = flag(
        "default", "default: plain RoPE | linear: positions / factor | llama3: LLaMA 3.1's "
        "band-wise scaling | yarn: YaRN")
    factor: float = flag(1.0, "context extension factor (linear, llama3, yarn)")
    low_freq_factor: float = flag(1.0, "llama3: wavelengths above original/low_freq_factor "
                                  "are slowed by factor")
    high_freq_factor: float = flag(4.0, "llama3: wavelengths below original/high_freq_factor "
                                   "are kept")
    original_max_position_embeddings: int | None = flag(
        None, "llama3, yarn: the context before extension (none: max_position_embeddings)")
    beta_fast: float = flag(32.0, "yarn: rotations below which frequencies extrapolate")
    beta_slow: float = flag(1.0, "yarn: rotations above which frequencies interpolate")
    attention_factor: float | None = flag(None, "yarn: cos/sin scale (none: from factor)")
    mscale: float | None = flag(None, "yarn: DeepSeek-style attention scale numerator")
    mscale_all_dim: float | None = flag(None, "yarn: DeepSeek-style denominator")
    truncate: bool = flag(True, "yarn: round the correction range to whole dims")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer of one of FAMILIES, in Hugging Face's field names."""
    model_type: str = flag("llama", "the family (HF model_type); it fixes the structure")
    vocab_size: int = flag(32000, "tokens in the embedding table")
    hidden_size: int = flag(4096, "width of the residual stream, D")
    intermediate_size: int = flag(11008, "MLP hidden width, F")
    num_hidden_layers: int = flag(32, "transformer blocks, L")
    num_attention_heads: int = flag(32, "query heads, H")
    num_key_value_heads: int = flag(32, "key/value heads, K (grouped-query attention)")
    head_dim: int | None = flag(None, "channels per head (none: hidden_size // "
                                "num_attention_heads)")
    max_position_embeddings: int = flag(4096, "longest sequence the model is meant for")
    rope_theta: float = flag(10000.0, "RoPE base wavelength")
    rope_scaling: RopeScaling = flag(RopeScaling(), "RoPE scaling of full-attention layers "
                                     "(of all layers unless sliding_rope_theta is set)")
    sliding_rope_theta: float | None = flag(None, "RoPE base of sliding-window layers, when "
                                            "it differs (Gemma 3)")
    sliding_rope_scaling: RopeScaling | None = flag(None, "RoPE scaling of sliding-window "
                                                    "layers (with sliding_rope_theta)")
    rms_norm_eps: float = flag(1e-5, "RMSNorm epsilon")
    tie_word_embeddings: bool = flag(False, "the output head reuses the embedding table")
    attention_bias: bool = flag(False, "bias on the q, k, v and o projections")
    mlp_bias: bool = flag(False, "bias on the MLP projections")
    hidden_act: Literal[tuple(ACTIVATIONS)] = flag(
        "silu", "gated-MLP activation: silu (SwiGLU) or gelu (GeGLU; tanh-approximated)")
    sliding_window: int | None = flag(None, "sliding_attention layers see this many tokens, "
                                      "their own included")
    layer_types: tuple[LayerType, ...] | None = flag(
        None, "attention kind per layer (none: the family's pattern; for most, every layer "
        "slides when sliding_window is set)")
    query_pre_attn_scalar: int | None = flag(None, "attention scores are scaled by its "
                                               "-1/2 power (none: head_dim)")
    final_logit_softcapping: float | None = flag(None, "logits = cap * tanh(logits / cap)")

    # Fields filled in on creation when left none, and the fields they follow: a flag that
    # changes one of those re-derives them (flags.parse), unless it sets them too.
    DERIVED = {"head_dim": ("hidden_size", "num_attention_heads"),
               "layer_types": ("model_type", "num_hidden_layers", "sliding_window")}

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        if self.model_type not in FAMILIES:
            raise ConfigError(f"model.model_type: unknown '{self.model_type}'; choose one of: "
                              + ", ".join(FAMILIES))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be at least 1, got {getattr(self, name)}")
        H, K = self.num_attention_heads, self.num_key_value_heads
        if H % K:
            raise ConfigError(f"model.num_attention_heads={H} must be a multiple of "
                              f"model.num_key_value_heads={K}")
        if self.head_dim is None:
            if self.hidden_size % H:
                raise ConfigError(f"model.hidden_size={self.hidden_size} is not a multiple of "
                                  f"model.num_attention_heads={H}; set model.head_dim")
            set_("head_dim", self.hidden_size // H)
        if self.head_dim < 2 or self.head_dim % 2:
            raise ConfigError(f"model.head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"model.sliding_window must be at least 1 (or none), got "
                              f"{self.sliding_window}")
        L = self.num_hidden_layers
        if self.layer_types is None:
            set_("layer_types", self.family.default_layer_types(L, self.sliding_window))
        if len(self.layer_types) != L:
            raise ConfigError(f"model.layer_types has {len(self.layer_types)} entries but "
                              f"model.num_hidden_layers={L}; pass one per layer, e.g. "
                              f"--model.layer_types={','.join(self.layer_types[:1] * L)}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ConfigError("model.layer_types has sliding_attention layers but "
                              "model.sliding_window is none; set --model.sliding_window=N")
        if self.sliding_rope_scaling is not None and self.sliding_rope_theta is None:
            raise ConfigError("model.sliding_rope_scaling needs model.sliding_rope_theta")

    @property
    def family(self):
        return FAMILIES[self.model_type]

    @property
    def switches(self):
        return self.family.switches

    def rope(self, layer_type):
        """(theta, RopeScaling) of one kind of layer."""
        if layer_type == "sliding_attention" and self.sliding_rope_theta is not None:
            return self.sliding_rope_theta, self.sliding_rope_scaling or RopeScaling()
        return self.rope_theta, self.rope_scaling

    def to_dict(self):
        from trainer.flags import to_dict
        return to_dict(self)

    @classmethod
    def from_dict(cls, data, prefix="model."):
        """A dict (JSON) -> a checked ModelConfig; also reads the layout of meshlm <= 0.1
        (head_dim 0 for "derived", a qkv_bias field, rope_scaling without newer keys)."""
        from trainer.flags import from_dict
        data = dict(data)
        if data.get("head_dim") == 0:
            data["head_dim"] = None
        data.pop("qkv_bias", None)  # now the qwen2 family's switch
        for name in ("rope_scaling", "sliding_rope_scaling"):  # fields its type never reads
            scaling = data.get(name)
            if isinstance(scaling, dict) and scaling.get("rope_type", "default") in ROPE_TYPES:
                used = ROPE_TYPES[scaling.get("rope_type", "default")]
                data[name] = {k: v for k, v in scaling.items() if k == "rope_type" or k in used}
        return from_dict(cls, data, prefix)

    # ---------------------------------------------------------------- counts
    def num_params(self):
        """Parameter count from the config alone (embeddings included)."""
        s = self.switches
        D, F, L, V = self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.vocab_size
        H, K, Dh = self.num_attention_heads, self.num_key_value_heads, self.head_dim
        attn = D * H * Dh + 2 * D * K * Dh + H * Dh * D
        if self.attention_bias or s.qkv_bias:
            attn += (H + 2 * K) * Dh
        attn += self.attention_bias * D + s.qk_norm * 2 * Dh
        mlp = 3 * D * F + self.mlp_bias * (2 * F + D)
        per_layer = attn + mlp + (4 if s.sandwich_norms else 2) * D
        head = 0 if self.tie_word_embeddings else D * V
        return V * D + L * per_layer + D + head

    def flops_per_token(self, seq_len):
        """Training FLOPs per token (forward + backward = 3x forward), PaLM-style:
        6 x (matmul params, the lm head included) plus attention scores over the keys each
        query sees (the full square for full layers, the window for sliding ones)."""
        D, V = self.hidden_size, self.vocab_size
        H, Dh = self.num_attention_heads, self.head_dim
        matmul_params = self.num_params() - V * D  # the embedding lookup is no matmul...
        if self.tie_word_embeddings:
            matmul_params += V * D  # ...but a tied embedding still does the lm-head matmul
        keys = sum(min(seq_len, self.sliding_window) if kind == "sliding_attention" else seq_len
                   for kind in self.layer_types)
        attention = 2 * 2 * H * Dh * keys  # QK^T and PV, forward
        return 6 * matmul_params + 3 * attention


# ------------------------------------------------------------------ families
@dataclass(frozen=True)
class Switches:
    """Structural choices that set families apart; model.py reads these."""
    qkv_bias: bool = False  # q, k and v (not o) always have a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head's q and k, before RoPE (Qwen3, Gemma 3)
    norm_plus_one: bool = False  # RMSNorm scales by (1 + w), w starting at 0 (Gemma)
    sandwich_norms: bool = False  # norms before and after attention and MLP (Gemma 2, 3)
    scale_embeddings: bool = False  # token embeddings times sqrt(hidden_size) (Gemma)


class Tensor(NamedTuple):
    """One HF tensor and the meshlm parameter(s) it holds. Several params: the HF tensor is
    their concatenation along its first (output) axis. transpose: HF Linear [out, in]."""
    hf: str
    params: tuple
    transpose: bool


@dataclass(frozen=True)
class Family:
    model_type: str  # HF's model_type; selects the family
    architecture: str  # the transformers model class
    config_class: str  # the transformers config class
    switches: Switches = Switches()
    from_hf: Callable = None  # transformers config -> this family's ModelConfig fields
    to_hf: Callable = None  # ModelConfig -> this family's transformers config kwargs
    hf_names: dict = dataclasses.field(default_factory=dict)  # our field -> its HF name
    per_layer_rope: bool = False  # HF rope_parameters nested by layer kind (Gemma 3)
    default_layer_types: Callable = None  # (layers, window) -> layer_types; None: all alike
    fused: tuple = ()  # (HF module, (our modules...)) per layer, e.g. qkv_proj
    sharding_rules: tuple = ()  # (regex, PartitionSpec), tried before sharding.PARAM_RULES
    presets: dict = dataclasses.field(default_factory=dict)  # name -> ModelConfig fields

    def __post_init__(self):
        if self.default_layer_types is None:  # one window for all layers, or none
            object.__setattr__(self, "default_layer_types", lambda layers, window: (
                ("sliding_attention" if window else "full_attention"),) * layers)


# --- config mapping helpers shared by the families (each names what it refuses)
def _require(ok, what):
    if not ok:
        raise ConfigError(what)


def _no_sliding(cfg, arch):
    _require("sliding_attention" not in cfg.layer_types,
             f"{arch} has no sliding-window attention; set model.sliding_window=none or use "
             "a family that has it (mistral, qwen2, qwen3, gemma3_text)")


def _one_window(cfg, arch):
    """Mistral-style: one window for every layer, or none."""
    kinds = set(cfg.layer_types)
    _require(len(kinds) == 1, f"{arch} applies one sliding window to every layer; mixed "
             "model.layer_types need qwen2, qwen3 or gemma3_text")
    return {"sliding_window": cfg.sliding_window if kinds == {"sliding_attention"} else None}


def _per_layer_window(cfg):
    """Qwen-style: layer_types with use_sliding_window."""
    sliding = "sliding_attention" in cfg.layer_types
    return {"use_sliding_window": sliding, "sliding_window": cfg.sliding_window if sliding else None,
            "layer_types": list(cfg.layer_types)}


def _no_gemma_scaling(cfg, arch):
    """Fields only Gemma's config carries: exported elsewhere they would be lost."""
    _require(cfg.final_logit_softcapping is None and cfg.query_pre_attn_scalar is None,
             f"{arch} has no final_logit_softcapping or query_pre_attn_scalar; set them to "
             "none, or use model_type=gemma3_text")


def _no_bias(cfg, arch):
    _require(not (cfg.attention_bias or cfg.mlp_bias), f"{arch} has no biases; set "
             "model.attention_bias=false and model.mlp_bias=false, or model_type=llama")


def _read_window(hfc):
    """sliding_window and layer_types of a transformers config (either may be absent)."""
    types_ = getattr(hfc, "layer_types", None)
    window = getattr(hfc, "sliding_window", None)
    if types_ is not None and "sliding_attention" not in types_:
        window = None  # the window applies to no layer
    return {"sliding_window": window, "layer_types": tuple(types_) if types_ else None}


def _llama_from_hf(hfc):
    return {"attention_bias": bool(hfc.attention_bias), "mlp_bias": bool(hfc.mlp_bias)}


def _llama_to_hf(cfg):
    _no_sliding(cfg, "LlamaForCausalLM")
    _no_gemma_scaling(cfg, "LlamaForCausalLM")
    return {"attention_bias": cfg.attention_bias, "mlp_bias": cfg.mlp_bias}


def _mistral_from_hf(hfc):
    return {"sliding_window": hfc.sliding_window}


def _mistral_to_hf(cfg):
    _no_bias(cfg, "MistralForCausalLM")
    _no_gemma_scaling(cfg, "MistralForCausalLM")
    return _one_window(cfg, "MistralForCausalLM")


def _phi3_to_hf(cfg):
    _no_bias(cfg, "Phi3ForCausalLM")
    _no_gemma_scaling(cfg, "Phi3ForCausalLM")
    _require(cfg.rope_scaling.rope_type == "default", "transformers' Phi-3 takes only default (or "
             "longrope) RoPE; set model.rope_scaling.rope_type=default or use model_type=llama")
    return _one_window(cfg, "Phi3ForCausalLM")


def _qwen2_from_hf(hfc):
    return _read_window(hfc)


def _qwen2_to_hf(cfg):
    _require(not (cfg.attention_bias or cfg.mlp_bias), "Qwen2ForCausalLM has q/k/v bias only "
             "(always on); set model.attention_bias=false and model.mlp_bias=false")
    _no_gemma_scaling(cfg, "Qwen2ForCausalLM")
    return _per_layer_window(cfg)


def _qwen3_from_hf(hfc):
    return {"attention_bias": bool(hfc.attention_bias), **_read_window(hfc)}


def _qwen3_to_hf(cfg):
    _require(not cfg.mlp_bias, "Qwen3ForCausalLM has no MLP bias; set model.mlp_bias=false")
    _no_gemma_scaling(cfg, "Qwen3ForCausalLM")
    return {"attention_bias": cfg.attention_bias, **_per_layer_window(cfg)}


def _gemma3_from_hf(hfc):
    _require(not getattr(hfc, "use_bidirectional_attention", False),
             "use_bidirectional_attention=true (an encoder) is not supported")
    # attn_logit_softcapping is not read: transformers' Gemma 3 does not apply it either.
    return {"attention_bias": bool(hfc.attention_bias),
            "query_pre_attn_scalar": int(hfc.query_pre_attn_scalar),
            "final_logit_softcapping": hfc.final_logit_softcapping, **_read_window(hfc)}


def _gemma3_to_hf(cfg):
    _require(not cfg.mlp_bias, "Gemma3ForCausalLM has no MLP bias; set model.mlp_bias=false")
    window = cfg.sliding_window or cfg.max_position_embeddings  # a window no layer uses
    return {"attention_bias": cfg.attention_bias, "sliding_window": window,
            "layer_types": list(cfg.layer_types),
            "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_dim,
            "final_logit_softcapping": cfg.final_logit_softcapping}


def gemma_layer_types(num_layers, window, pattern=6):
    """Gemma's interleave: every `pattern`-th layer is global, the rest slide."""
    return tuple("full_attention" if (i + 1) % pattern == 0 or not window else
                 "sliding_attention" for i in range(num_layers))


_LLAMA3_SCALING = RopeScaling(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                              high_freq_factor=4.0, original_max_position_embeddings=8192)

FAMILIES = {f.model_type: f for f in [
    Family("llama", "LlamaForCausalLM", "LlamaConfig",
           from_hf=_llama_from_hf, to_hf=_llama_to_hf,
           presets={
               # ~0.9M params: the demo default, trains in minutes on a laptop CPU.
               "tiny": dict(vocab_size=384, hidden_size=128, intermediate_size=384,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=1024),
               "llama2_7b": dict(),
               "llama3_8b": dict(vocab_size=128256, intermediate_size=14336,
                                 num_key_value_heads=8, max_position_embeddings=8192,
                                 rope_theta=500000.0),
               "llama3.2_1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                   num_hidden_layers=16, num_attention_heads=32,
                                   num_key_value_heads=8, head_dim=64,
                                   max_position_embeddings=131072, rope_theta=500000.0,
                                   rope_scaling=_LLAMA3_SCALING, tie_word_embeddings=True),
           }),
    Family("mistral", "MistralForCausalLM", "MistralConfig",
           from_hf=_mistral_from_hf, to_hf=_mistral_to_hf,
           presets={"mistral_7b": dict(vocab_size=32768, intermediate_size=14336,
                                       num_key_value_heads=8, max_position_embeddings=32768,
                                       rope_theta=1000000.0)}),
    # LLaMA with fused q/k/v and gate/up tensors: the weight map splits them.
    Family("phi3", "Phi3ForCausalLM", "Phi3Config",
           from_hf=_mistral_from_hf, to_hf=_phi3_to_hf,
           fused=(("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj",
                                          "self_attn.v_proj")),
                  ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"))),
           presets={"phi3_mini": dict(vocab_size=32064, hidden_size=3072,
                                      intermediate_size=8192, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=32,
                                      max_position_embeddings=4096, sliding_window=2047)}),
    Family("qwen2", "Qwen2ForCausalLM", "Qwen2Config", Switches(qkv_bias=True),
           from_hf=_qwen2_from_hf, to_hf=_qwen2_to_hf,
           presets={"qwen2.5_0.5b": dict(vocab_size=151936, hidden_size=896,
                                         intermediate_size=4864, num_hidden_layers=24,
                                         num_attention_heads=14, num_key_value_heads=2,
                                         max_position_embeddings=32768, rope_theta=1000000.0,
                                         rms_norm_eps=1e-6, tie_word_embeddings=True)}),
    Family("qwen3", "Qwen3ForCausalLM", "Qwen3Config", Switches(qk_norm=True),
           from_hf=_qwen3_from_hf, to_hf=_qwen3_to_hf,
           presets={"qwen3_0.6b": dict(vocab_size=151936, hidden_size=1024,
                                       intermediate_size=3072, num_hidden_layers=28,
                                       num_attention_heads=16, num_key_value_heads=8,
                                       head_dim=128, max_position_embeddings=40960,
                                       rope_theta=1000000.0, rms_norm_eps=1e-6,
                                       tie_word_embeddings=True)}),
    Family("gemma3_text", "Gemma3ForCausalLM", "Gemma3TextConfig",
           Switches(qk_norm=True, norm_plus_one=True, sandwich_norms=True,
                    scale_embeddings=True),
           from_hf=_gemma3_from_hf, to_hf=_gemma3_to_hf,
           hf_names={"hidden_act": "hidden_activation"}, per_layer_rope=True,
           default_layer_types=gemma_layer_types,
           presets={"gemma3_1b": dict(vocab_size=262144, hidden_size=1152,
                                      intermediate_size=6912, num_hidden_layers=26,
                                      num_attention_heads=4, num_key_value_heads=1,
                                      head_dim=256, max_position_embeddings=32768,
                                      rope_theta=1000000.0, sliding_rope_theta=10000.0,
                                      rms_norm_eps=1e-6, tie_word_embeddings=True,
                                      hidden_act="gelu_pytorch_tanh", sliding_window=512,
                                      query_pre_attn_scalar=256)}),
]}

PRESETS = {name: ModelConfig(model_type=f.model_type, **fields)
           for f in FAMILIES.values() for name, fields in f.presets.items()}

ARCHITECTURES = {f.architecture: f for f in FAMILIES.values()}


def family_for_hf(architecture, model_type):
    """The family of an HF config.json's architectures[0] and model_type (None: unknown)."""
    family = ARCHITECTURES.get(architecture) if architecture else FAMILIES.get(model_type)
    if family is None or (model_type and family.model_type != model_type):
        return None
    return family


def supported_text():
    return ", ".join(f"{f.architecture} ({f.model_type})" for f in FAMILIES.values())


# ------------------------------------------------------------------ weights
def weight_map(cfg):
    """[Tensor(HF name, meshlm param paths, transpose)] of a model config, in HF's order."""
    s = cfg.switches
    out = [Tensor("model.embed_tokens.weight", ("embed_tokens/embedding",), False)]

    def add(hf, ml, transpose=False):
        out.append(Tensor(hf, (ml,), transpose))

    for i in range(cfg.num_hidden_layers):
        hf, ml = f"model.layers.{i}", f"layers_{i}"
        start = len(out)
        for p in ("q", "k", "v", "o"):
            add(f"{hf}.self_attn.{p}_proj.weight", f"{ml}/self_attn/{p}_proj/kernel", True)
            if cfg.attention_bias or (s.qkv_bias and p != "o"):
                add(f"{hf}.self_attn.{p}_proj.bias", f"{ml}/self_attn/{p}_proj/bias")
        if s.qk_norm:
            add(f"{hf}.self_attn.q_norm.weight", f"{ml}/self_attn/q_norm/scale")
            add(f"{hf}.self_attn.k_norm.weight", f"{ml}/self_attn/k_norm/scale")
        for p in ("gate", "up", "down"):
            add(f"{hf}.mlp.{p}_proj.weight", f"{ml}/mlp/{p}_proj/kernel", True)
            if cfg.mlp_bias:
                add(f"{hf}.mlp.{p}_proj.bias", f"{ml}/mlp/{p}_proj/bias")
        norms = (("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm") if s.sandwich_norms
                 else ("input_layernorm", "post_attention_layernorm"))
        for norm in norms:
            add(f"{hf}.{norm}.weight", f"{ml}/{norm}/scale")
        out[start:] = _fuse(out[start:], hf, cfg.family.fused)
    add("model.norm.weight", "norm/scale")
    if not cfg.tie_word_embeddings:
        add("lm_head.weight", "lm_head/kernel", True)
    return out


def _fuse(tensors, prefix, fused):
    """Replace the tensors of each fused group by one HF tensor holding all of them."""
    for fused_name, parts in fused:
        for kind in ("weight", "bias"):
            names = [f"{prefix}.{p}.{kind}" for p in parts]
            group = [t for t in tensors if t.hf in names]
            if not group:
                continue
            at = tensors.index(group[0])
            tensors = [t for t in tensors if t.hf not in names]
            tensors.insert(at, Tensor(f"{prefix}.{fused_name}.{kind}",
                                      tuple(p for t in group for p in t.params),
                                      group[0].transpose))
    return tensors

