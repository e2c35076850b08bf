"""What trains: the trainable-parameter mask, and LoRA's adapters that hang on it.

The mask is a pytree of bools over the params, True where a weight trains. The train step
differentiates only the trainable part and the optimizer only sees that part (so only it
carries optimizer state); the checkpoint saves whatever state results. Full fine-tuning
(all True), `--freeze=REGEX` and LoRA (only the adapters) are one code path.

LoRA (Hu et al., 2021) puts two small matrices beside a frozen kernel W [in, out]:
A [in, r] and B [r, out], and the layer computes x W + (alpha / r) x A B. model.py makes
them (params `lora_a` and `lora_b` beside `kernel`) for the kernels --lora.targets names.
This module merges them into W for a plain HF export; hf.export_peft writes them for peft.
"""

import re

import jax
import jax.numpy as jnp

from trainer.flags import ConfigError
from trainer.sharding import path_str

ADAPTERS = ("lora_a", "lora_b")


def is_adapter(path):
    """'layers_0/self_attn/q_proj/lora_a' -> True."""
    return path.rsplit("/", 1)[-1] in ADAPTERS


def trainable_mask(params, lora_rank=0, freeze=""):
    """True where a parameter trains: with LoRA the adapters only; else every parameter
    whose path --freeze does not match. A mask that trains nothing is an error."""
    def trains(path, _):
        p = path_str(path)
        return is_adapter(p) if lora_rank else not (freeze and re.search(freeze, p))
    mask = jax.tree_util.tree_map_with_path(trains, params)
    if freeze and all(jax.tree.leaves(mask)):
        raise ConfigError(f"--freeze={freeze!r} matches no parameter (paths look like "
                          "layers_0/self_attn/q_proj/kernel)")
    if not any(jax.tree.leaves(mask)):
        raise ConfigError(
            "--lora.targets matches no attention or MLP kernel (paths look like "
            "layers_0/self_attn/q_proj/kernel)" if lora_rank else
            f"--freeze={freeze!r} matches every parameter, so nothing would train")
    return mask


def check_targets(params, lora):
    """Every kernel --lora.targets names must have got adapters: model.py gives them to the
    attention and MLP projections only, not the embedding or the lm_head."""
    flat = {path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    for p in sorted(flat):
        if p.endswith(("/kernel", "/embedding")) and re.search(lora.targets, p):
            if p.rsplit("/", 1)[0] + "/lora_a" not in flat:
                raise ConfigError(f"--lora.targets={lora.targets!r} matches {p}, which cannot "
                                  "take adapters; target attention and MLP projections only")


def _empty(x):
    return isinstance(x, dict) and not x


def split(tree, mask):
    """(trainable, frozen): two nested dicts holding only the leaves mask puts there."""
    if not isinstance(tree, dict):
        return (tree, {}) if mask else ({}, tree)
    parts = {k: split(v, mask[k]) for k, v in tree.items()}
    side = lambda i: {k: p[i] for k, p in parts.items() if not _empty(p[i])}  # noqa: E731
    return side(0), side(1)


def join(a, b):
    """The inverse of split: two nested dicts of disjoint leaves -> one."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return a if _empty(b) else b
    return {k: join(a.get(k, {}), b.get(k, {})) for k in a.keys() | b.keys()}


def _map_layers(params, fn):
    """Apply fn to every dict that holds adapters (a layer: kernel, lora_a, lora_b, ...)."""
    if not isinstance(params, dict):
        return params
    if "lora_a" in params:
        return fn(params)
    return {k: _map_layers(v, fn) for k, v in params.items()}


def adapters_off(params):
    """The base model: every B zero, so x A B adds exactly nothing (DPO's reference)."""
    return _map_layers(params, lambda layer: {**layer, "lora_b": jnp.zeros_like(layer["lora_b"])})


def merged(params, lora):
    """Plain params of the same model: W + (alpha / r) A B for every adapted kernel, in the
    kernel's dtype, and no adapters. What --export_hf writes after a LoRA run."""
    scale = lora.alpha / lora.rank

    def merge(layer):
        kernel = layer["kernel"]
        update = jnp.matmul(layer["lora_a"].astype(jnp.float32),
                            layer["lora_b"].astype(jnp.float32)) * scale
        rest = {k: v for k, v in layer.items() if k not in ADAPTERS}
        return {**rest, "kernel": (kernel.astype(jnp.float32) + update).astype(kernel.dtype)}
    return jax.jit(lambda p: _map_layers(p, merge))(params)


def cast_frozen(params, mask, dtype):
    """Frozen weights stored in `dtype` (--lora.base_dtype); trainable ones as they are."""
    if not dtype:
        return params
    return jax.tree.map(lambda p, m: p if m else p.astype(dtype), params, mask)


def adapter_mask(tree):
    """True on the adapters of a params tree."""
    return jax.tree_util.tree_map_with_path(lambda p, _: is_adapter(path_str(p)), tree)


def only_adapters(tree):
    """The adapters of a params tree, nothing else."""
    return split(tree, adapter_mask(tree))[0]


def without_adapters(tree):
    """The base model's part of a params tree (what an HF dir or a full checkpoint holds)."""
    return split(tree, adapter_mask(tree))[1]
