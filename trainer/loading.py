"""Open a model from wherever it lives: a meshlm checkpoint or a Hugging Face model dir.

The one place that tells the two apart. train (--init_from), convert, eval, generate and
serve all come through here for a model's config, tokenizer and weights.
"""

import jax
import jax.numpy as jnp

from trainer import checkpoint, hf
from trainer.errors import UserError
from trainer.families import ModelConfig


class SourceError(UserError):
    """A path that holds no model; one line naming it."""


def kind(path):
    """'hf' for a Hugging Face model dir, 'checkpoint' for a meshlm checkpoint."""
    if hf.is_hf_dir(path):
        return "hf"
    try:
        if not path:
            raise checkpoint.CheckpointError("no path")
        checkpoint.locate(path)
        return "checkpoint"
    except checkpoint.UnfinishedCheckpoint:
        raise
    except checkpoint.CheckpointError:
        pass
    raise SourceError(f"{path!r} is neither a Hugging Face model dir (with config.json) nor a "
                      "meshlm checkpoint (a run dir, its checkpoints/ or checkpoints/<step>)")


def model_source(path, tokenizer=""):
    """(ModelConfig, tokenizer spec) of a model source; `tokenizer` overrides its own."""
    if kind(path) == "hf":
        return hf.model_config_from_hf(path), hf.tokenizer_spec(path, tokenizer)
    meta, _ = checkpoint.load_meta(path)
    return ModelConfig.from_dict(meta["model"]), tokenizer or meta["tokenizer"]


def load_weights(path, model_cfg: ModelConfig, abstract_params):
    """The weights of a model source, onto abstract_params' shardings. A LoRA run's
    checkpoint gives its weights with the adapters merged in (as --export_hf writes them)."""
    if kind(path) == "hf":
        return hf.load_params(path, model_cfg, abstract_params)
    lora = lora_of(path)
    if lora is None:
        return checkpoint.load_params(path, abstract_params)
    from trainer import lora as lora_lib
    from trainer.model import build_model
    shapes = jax.eval_shape(build_model(model_cfg, lora=lora).init, jax.random.PRNGKey(0),
                            jnp.zeros((1, 1), jnp.int32))["params"]
    some = jax.tree.leaves(abstract_params)[0].sharding
    whole = (jax.sharding.NamedSharding(some.mesh, jax.sharding.PartitionSpec())
             if isinstance(some, jax.sharding.NamedSharding) else some)  # adapters are small
    adapters = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=whole),
                            lora_lib.only_adapters(shapes))
    params = checkpoint.load_params(path, lora_lib.join(abstract_params, adapters))
    merged = lora_lib.merged(params, lora)
    return jax.device_put(merged, jax.tree.map(lambda a: a.sharding, abstract_params))


def abstract_params(model, sharding, dtype=None):
    """ShapeDtypeStructs of a model's params (in `dtype`, default the model's param dtype),
    on one sharding or a pytree of them."""
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0),
                                               jnp.zeros((1, 1), jnp.int32)))["params"]
    if isinstance(sharding, jax.sharding.Sharding):
        sharding = jax.tree.map(lambda _: sharding, shapes)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, dtype or model.param_dtype,
                                                          sharding=s), shapes, sharding)


def lora_of(path):
    """The LoRA settings (config.LoraConfig) a checkpoint was trained with, or None."""
    from trainer.config import LoraConfig
    from trainer.flags import from_dict
    if kind(path) != "checkpoint":
        return None
    meta, _ = checkpoint.load_meta(path)
    saved = meta.get("config", {}).get("lora")
    lora = from_dict(LoraConfig, saved, "lora.") if saved else None
    return lora if lora and lora.rank else None


def load_model(path, tokenizer="", dtype="float32", mesh=None):
    """A model source -> (model, params, tokenizer) on one device, or sharded over `mesh`
    by the training rules, for eval, generate and serve. `tokenizer` overrides the
    source's own."""
    from trainer.model import build_model
    from trainer.sharding import param_rules, state_shardings
    from trainer.tokenizer import load_tokenizer
    if not path:
        raise SourceError("--checkpoint is required: a meshlm checkpoint or HF model dir")
    model_cfg, tokenizer = model_source(path, tokenizer)
    model = build_model(model_cfg, dtype=dtype, param_dtype=dtype)
    where = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if mesh is not None:
        where = state_shardings(abstract_params(model, where), mesh, param_rules(model_cfg, mesh))
    params = load_weights(path, model_cfg, abstract_params(model, where))
    return model, params, load_tokenizer(tokenizer)
