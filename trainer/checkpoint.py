"""Checkpoints through Orbax: sharded, asynchronous, atomic, keep-N, local or gs://.

A checkpoint lives at `<output_dir>/checkpoints/<step>/` and holds three items:
  params  the model weights (what eval, generate and convert need)
  train   everything else of the train state: optimizer state, step, RNG, counters
  meta    JSON: the model config, tokenizer, and the run's flags
Orbax writes each step into a temporary directory and renames it (or, on GCS, writes
a commit marker) when complete, so a killed save is never seen as a checkpoint; the
leftovers of one are removed the next time a run opens the directory for writing.

Saves are asynchronous: `save` copies the arrays to host memory and returns, and the
files are written in the background while training goes on.
"""

import contextlib
import os

import fsspec
import jax
import orbax.checkpoint as ocp
from etils import epath

from trainer.errors import UserError

ITEMS = ("params", "train", "meta")


class CheckpointError(UserError):
    """A checkpoint that can't be found or doesn't fit; one line naming the path."""


class UnfinishedCheckpoint(CheckpointError):
    """A step dir whose save was cut off."""


def checkpoint_dir(output_dir):
    return output_dir.rstrip("/") + "/checkpoints"


def manager(directory, keep=0, keep_every=0, async_save=True, read_only=False,
            concurrent_gb=None):
    """An Orbax CheckpointManager over `directory` (local or gs://).

    keep: the newest N checkpoints survive (0: all); keep_every: so do those whose step is
    a multiple of it. A writable manager removes unfinished saves of earlier runs.
    concurrent_gb: cap on the params bytes written or read at once (at least the largest
    array); convert sets it so that a save or a casting restore adds little to the one copy
    of the model in memory."""
    policies = [ocp.checkpoint_managers.LatestN(n=keep or None)]
    if keep_every:
        policies.append(ocp.checkpoint_managers.EveryNSteps(interval_steps=keep_every))
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=not read_only,
        create=not read_only,
        read_only=read_only,
    )
    if "://" not in directory:
        directory = os.path.abspath(directory)  # Orbax needs absolute local paths
    if concurrent_gb:
        handlers = {"params": ocp.StandardCheckpointHandler(save_concurrent_gb=concurrent_gb,
                                                            restore_concurrent_gb=concurrent_gb),
                    "train": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        return ocp.CheckpointManager(epath.Path(directory), options=options,
                                     item_handlers=handlers)
    return ocp.CheckpointManager(epath.Path(directory), options=options, item_names=ITEMS)


def save(mngr, step, state, meta, force=True):
    """Start an (async) save of the train state; returns at once."""
    train = {k: v for k, v in state.items() if k != "params"}
    mngr.save(step, force=force, args=ocp.args.Composite(
        params=ocp.args.StandardSave(state["params"]),
        train=ocp.args.StandardSave(train),
        meta=ocp.args.JsonSave(meta)))


def restore(mngr, step, abstract_state):
    """Restore the whole train state onto the shardings given in abstract_state
    (jax.ShapeDtypeStruct leaves with .sharding), whatever mesh it was saved on."""
    train = {k: v for k, v in abstract_state.items() if k != "params"}
    out = mngr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_state["params"]),
        train=ocp.args.StandardRestore(train)))
    return {"params": out["params"], **out["train"]}


def read_meta(mngr, step):
    return mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def locate(path):
    """A run dir, its checkpoints/ dir, or one step dir -> (checkpoints dir, step).
    Only complete checkpoints count: an interrupted save is never picked."""
    path = path.rstrip("/")
    fs, _, _ = fsspec.get_fs_token_paths(path)
    if not fs.exists(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    parent, leaf = path.rsplit("/", 1) if "/" in path else (".", path)
    if leaf.isdigit() and fs.exists(path + "/meta"):
        if int(leaf) not in _complete_steps(fs, parent):
            raise UnfinishedCheckpoint(f"{path} is an unfinished checkpoint (its save was "
                                  "interrupted); point at its run dir to use the newest "
                                  "complete one")
        return parent, int(leaf)
    directory = checkpoint_dir(path) if fs.exists(checkpoint_dir(path)) else path
    steps = _complete_steps(fs, directory)
    if not steps:
        raise CheckpointError(f"no complete checkpoint under {path}; point at a run dir, its "
                              "checkpoints/ dir or a checkpoints/<step> dir")
    return directory, max(steps)


def _complete_steps(fs, directory):
    if not fs.exists(directory):
        return []
    with contextlib.closing(manager(directory, read_only=True)) as mngr:
        return list(mngr.all_steps())


def load_meta(path):
    directory, step = locate(path)
    with contextlib.closing(manager(directory, read_only=True)) as mngr:
        return read_meta(mngr, step), step


def load_params(path, abstract_params):
    """Only the weights of a checkpoint, onto abstract_params' shardings."""
    directory, step = locate(path)
    with contextlib.closing(manager(directory, read_only=True)) as mngr:
        out = mngr.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_params)))
    return out["params"]


def abstract_with_shardings(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


def to_json_meta(model_cfg, tokenizer, config):
    """The meta item: the model config, the tokenizer spec and the run's flags."""
    from trainer.flags import to_dict
    return {"model": model_cfg.to_dict(), "tokenizer": tokenizer, "config": to_dict(config)}
