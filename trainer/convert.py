"""python -m trainer.convert --input=A --output=B: Hugging Face <-> meshlm checkpoint.

The direction comes from what A is:
  an HF model dir (config.json + *.safetensors) -> B is a meshlm run dir holding
      B/checkpoints/0 (the weights) and B/tokenizer/ (the tokenizer files, copied), usable
      as --init_from=B, --checkpoint=B, or converted back;
  a meshlm checkpoint (run dir, checkpoints/ dir or checkpoints/<step>) -> B is an HF model
      dir that transformers loads as is; --push_to_hub=REPO then uploads it.
Weights stream one tensor at a time: peak host memory is about one copy of the model.
"""

import contextlib
import math
import os
import sys
from dataclasses import dataclass
from typing import Literal

import fsspec
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging as absl_logging

from trainer import checkpoint, hf, loading, lora
from trainer.model import DTYPES
from trainer.errors import UserError
from trainer.families import ModelConfig
from trainer.flags import ConfigError, flag, parse_or_exit

@dataclass(frozen=True)
class ConvertFlags:
    input: str = flag("", "HF model dir, or meshlm checkpoint (run dir, checkpoints/ or "
                      "checkpoints/<step>)")
    output: str = flag("", "meshlm run dir (from an HF input) or HF model dir (from a checkpoint)")
    dtype: Literal[("",) + tuple(DTYPES)] = flag("", "dtype of the written weights (empty: as "
                                                 "stored)")
    tokenizer: str = flag("", "tokenizer to ship: bytes | HF dir | SentencePiece .model "
                          "(empty: the input's own)")
    push_to_hub: str = flag("", "checkpoint -> HF only: upload the output to this hub repo id "
                            "(token from $HF_TOKEN)")
    max_shard_size: str = flag("5GB", "largest safetensors file of an HF output, e.g. 500MB, 5GB")
    overwrite: bool = flag(False, "replace an existing non-empty --output")


def _one_device():
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _abs(path):
    return path if "://" in path else os.path.abspath(path)


def _prepare_output(cfg):
    fs, path = fsspec.core.url_to_fs(cfg.output)
    if fs.exists(path) and (not fs.isdir(path) or fs.ls(path)):
        if not cfg.overwrite:
            raise ConfigError(f"--output={cfg.output} exists and is not empty; pass "
                                     "--overwrite to replace it, or pick another dir")
        fs.rm(path, recursive=True)


def hf_to_checkpoint(cfg):
    from trainer.model import build_model
    if cfg.push_to_hub:
        raise ConfigError("--push_to_hub uploads an HF model dir, but this converts an "
                                 "HF dir into a meshlm checkpoint; drop --push_to_hub")
    model_cfg = hf.model_config_from_hf(cfg.input)
    spec = hf.tokenizer_spec(cfg.input, cfg.tokenizer)
    hf.check_tokenizer(spec, "--tokenizer")
    dtype = DTYPES[cfg.dtype] if cfg.dtype else hf.stored_dtype(cfg.input)
    _prepare_output(cfg)
    abstract = loading.abstract_params(build_model(model_cfg), _one_device(), dtype)
    params = hf.load_params(cfg.input, model_cfg, abstract)
    output = _abs(cfg.output).rstrip("/")
    tokenizer = hf.copy_tokenizer(spec, output + "/tokenizer")
    meta = {"model": model_cfg.to_dict(), "tokenizer": tokenizer,
            "config": {"converted_from": _abs(cfg.input), "dtype": str(jnp.dtype(dtype))}}
    # Write a few arrays at a time (Orbax buffers all of them otherwise): the largest
    # array, at least 0.5 GB, in flight.
    largest = max(x.nbytes for x in jax.tree.leaves(params))
    with contextlib.closing(checkpoint.manager(checkpoint.checkpoint_dir(output),
                                               async_save=False,
                                               concurrent_gb=max(largest / 1e9, 0.5))) as mngr:
        # The train item must not be empty for Orbax; a converted model has taken no steps.
        checkpoint.save(mngr, 0, {"params": params, "step": jnp.int32(0)}, meta)
        mngr.wait_until_finished()
    return model_cfg, params, f"{checkpoint.checkpoint_dir(output)}/0"


def _restore_params(directory, step, dtype):
    """A checkpoint's params on one device, each cast to dtype (empty: as stored) while it
    is read, a few arrays at a time: the model is held once, already in the output dtype."""
    # The stored shapes and dtypes need a manager that knows the params' handler.
    with contextlib.closing(checkpoint.manager(directory, read_only=True,
                                               concurrent_gb=1.0)) as mngr:
        stored = mngr.item_metadata(step)["params"]
    stored = getattr(stored, "tree", stored)
    if not stored:
        raise checkpoint.CheckpointError(f"{directory}/{step}: no params metadata in it")
    largest = max(math.prod(m.shape) * jnp.dtype(m.dtype).itemsize
                  for m in jax.tree.leaves(stored))
    device = _one_device()
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(
        tuple(m.shape), DTYPES[dtype] if dtype else m.dtype, sharding=device), stored)
    with contextlib.closing(checkpoint.manager(directory, read_only=True,
                                               concurrent_gb=max(largest / 1e9, 0.5))) as mngr:
        return mngr.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract)))["params"]


def checkpoint_to_hf(cfg):
    directory, step = checkpoint.locate(cfg.input)
    meta, _ = checkpoint.load_meta(f"{directory}/{step}")
    model_cfg = ModelConfig.from_dict(meta["model"])
    spec = cfg.tokenizer or meta["tokenizer"]
    hf.check_tokenizer(spec, "--tokenizer" if cfg.tokenizer else
                       f"the tokenizer of checkpoint {directory}/{step},")
    hf.hf_config(model_cfg, "float32")  # an unexportable config fails before any work
    _prepare_output(cfg)
    lora_cfg = loading.lora_of(f"{directory}/{step}")
    # A LoRA run: its adapters, as stored (float32), merged into the weights, then cast.
    params = _restore_params(directory, step, "" if lora_cfg else cfg.dtype)
    if lora_cfg:
        params = lora.merged(params, lora_cfg)
    hf.export(params, model_cfg, spec, cfg.output, dtype=cfg.dtype if lora_cfg else None,
              max_shard_size=cfg.max_shard_size)
    url = hf.push_to_hub(cfg.output, cfg.push_to_hub) if cfg.push_to_hub else None
    return model_cfg, params, cfg.output, url


def main(argv=None):
    absl_logging.set_verbosity(absl_logging.ERROR)  # Orbax's read-only notices
    cfg = parse_or_exit("trainer.convert", ConvertFlags, argv)
    try:
        if not cfg.input or not cfg.output:
            raise ConfigError("--input and --output are both required, e.g. "
                              "--input=hf/Llama-3.2-1B --output=runs/llama1b")
        if _abs(cfg.input).rstrip("/") == _abs(cfg.output).rstrip("/"):
            raise ConfigError("--output must differ from --input")
        hf.shard_size_bytes(cfg.max_shard_size)
        url = None
        if loading.kind(cfg.input) == "hf":
            model_cfg, params, where = hf_to_checkpoint(cfg)
        else:
            model_cfg, params, where, url = checkpoint_to_hf(cfg)
    except UserError as e:
        sys.exit(f"error: {e}")
    count = sum(x.size for x in jax.tree.leaves(params))
    print(f"converted {cfg.input} ({model_cfg.model_type}, {count:,} params) -> {where}")
    if url:
        print(f"pushed to {url}")


if __name__ == "__main__":
    main()
