"""Random tiny Hugging Face models of every family, and tokenizers for them, built offline.

The test oracle is transformers itself (torch on CPU): these helpers only make the
inputs. Every weight is random (norms near their neutral value) so that a swapped or
misplaced tensor shows in the logits.
"""

import os

import numpy as np
import torch
import transformers
from safetensors import safe_open

from trainer.tokenizer import ByteTokenizer

CHATML = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=256)
WINDOW = 8  # sliding windows shorter than the test sequences (40 tokens, 72 with generation)

# name -> (transformers config class, its kwargs, tokenizer: bytes | bos | plain)
FAMILIES = {
    "llama_gqa": (transformers.LlamaConfig, dict(
        num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
        "bos"),
    # original_max_position_embeddings=32 puts the scaling band inside head_dim 16's
    # wavelengths, so llama3 scaling really changes the frequencies.
    "llama3_tied": (transformers.LlamaConfig, dict(
        num_key_value_heads=2, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}), "bytes"),
    "llama_untied_bias": (transformers.LlamaConfig, dict(
        num_key_value_heads=4, attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5), "bytes"),
    "llama_linear": (transformers.LlamaConfig, dict(
        num_key_value_heads=2, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                "factor": 4.0}), "plain"),
    # One kv head (multi-query); the old context of 64 puts YaRN's ramp inside head_dim 16.
    "llama_yarn": (transformers.LlamaConfig, dict(
        num_key_value_heads=1, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 64, "beta_fast": 16.0}), "bos"),
    "mistral": (transformers.MistralConfig, dict(
        num_key_value_heads=2, head_dim=24, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}), "bytes"),
    "mistral_window": (transformers.MistralConfig, dict(
        num_key_value_heads=2, sliding_window=WINDOW,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}), "bos"),
    # Fused qkv_proj and gate_up_proj tensors, one window for all layers.
    "phi3": (transformers.Phi3Config, dict(
        num_key_value_heads=2, sliding_window=WINDOW,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), "bos"),
    "qwen2": (transformers.Qwen2Config, dict(
        num_key_value_heads=2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}), "plain"),
    "qwen3": (transformers.Qwen3Config, dict(
        num_key_value_heads=2, head_dim=24, rope_parameters={"rope_type": "default",
                                                             "rope_theta": 1e6}), "plain"),
    # Layer 0 full, layer 1 sliding (max_window_layers=1), with q/k/v/o bias.
    "qwen3_window": (transformers.Qwen3Config, dict(
        num_key_value_heads=2, head_dim=16, attention_bias=True, use_sliding_window=True,
        sliding_window=WINDOW, max_window_layers=1, tie_word_embeddings=True), "plain"),
    # Sliding, sliding, global; each kind its own RoPE; logit soft-capping on.
    "gemma3": (transformers.Gemma3TextConfig, dict(
        num_hidden_layers=3, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
        sliding_window=WINDOW, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1e6}}), "bos"),
}


def randomize(model, seed):
    """Every weight random, norms near their neutral value ((1 + w) norms: w near 0)."""
    plus_one = "Gemma" in type(model).__name__
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(0.1 * noise if plus_one else 1 + 0.1 * noise)
            else:
                p.copy_(0.05 * noise)


def corpus_lines():
    from pydoc_data.topics import topics
    return [line for t in sorted(topics)[:20] for line in topics[t].splitlines() if line.strip()]


def bpe_tokenizer(add_bos):
    """A byte-level BPE tokenizer of 300 ids: with add_bos, `tok(text)` puts <s> first (as
    Llama's and Gemma's do); without, it adds nothing and has no BOS (as Qwen's)."""
    import tokenizers
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=COMMON["vocab_size"], special_tokens=specials,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus_lines(), trainer)
    if add_bos:
        bpe.post_processor = tokenizers.processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>" if add_bos else None,
        eos_token="</s>" if add_bos else "<|im_end|>", pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = CHATML
    return tok


def make_tokenizer(kind):
    if kind == "bytes":
        tok = ByteTokenizer().to_hf()
        tok.chat_template = CHATML
        return tok
    return bpe_tokenizer(add_bos=kind == "bos")


def make_hf_dir(path, family, seed=0, tokenizer=True):
    """A random tiny HF model dir of one of FAMILIES (with its tokenizer); returns the model."""
    cls, kw, kind = FAMILIES[family]
    tok = make_tokenizer(kind)
    torch.manual_seed(seed)
    cfg = cls(**{**COMMON, **kw}, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    randomize(model, seed)
    model.save_pretrained(path)
    if tokenizer:
        tok.save_pretrained(path)
    return model


def torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def hf_tensors(directory):
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), framework="numpy") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out
