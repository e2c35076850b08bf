"""python -m trainer.eval --checkpoint=C --data=D: loss and perplexity on a dataset;
python -m trainer.eval --checkpoint=C --tasks=T1,T2: lm-eval-harness tasks.

C is a meshlm checkpoint (run dir, checkpoints/ dir or one step) or a Hugging Face
model dir. With --data, every document of D is scored (no held-out split is taken) and
the last line printed is JSON: {"loss": ..., "perplexity": ..., "tokens": ...}. With
--tasks, lm-eval runs the tasks through trainer/harness.py's adapter; its results table
is printed, and the last line is JSON: {task: {metric: value}}.
"""

import functools
import json
import math
import sys
from dataclasses import dataclass

import jax
from absl import logging as absl_logging

from trainer import data, loading
from trainer.config import DataConfig, DataFormat, Dtype
from trainer.errors import UserError
from trainer.flags import ConfigError, flag, given, parse_or_exit
from trainer.model import batch_loss, loss_chunk_for

@dataclass(frozen=True)
class EvalFlags:
    checkpoint: str = flag("", "meshlm checkpoint (run dir, checkpoints/ or checkpoints/<step>) "
                           "or HF dir")
    data: str = flag("builtin", "builtin | FILE | GLOB | HF dataset name or dir (local or gs://)")
    format: DataFormat = flag("text", "text | chat (loss on assistant turns only) | fields "
                              "(see --fields); preference data is not scored here")
    text_field: str = flag("text", "JSONL / dataset field holding the text")
    messages_field: str = flag("messages", "JSONL / dataset field holding chat messages")
    fields: str = flag("", "with --format=fields, the template (as the train command's "
                       "--data.fields), e.g. '[instruction+input],output'")
    split: str = flag("train", "HF dataset split")
    cache_dir: str = flag("", "tokenization cache (empty: ~/.cache/meshlm/tokens)")
    tokenizer: str = flag("", "override the checkpoint's tokenizer")
    seq_len: int = flag(128, "tokens per scored row")
    batch_size: int = flag(8, "rows per forward pass")
    max_batches: int = flag(0, "stop after this many batches (0: all)")
    dtype: Dtype = flag("float32", "compute dtype")
    # lm-eval-harness (--tasks), instead of --data
    tasks: str = flag("", "lm-eval-harness tasks or groups, comma-separated (globs allowed), "
                      "e.g. hellaswag,arc_easy; scored instead of --data")
    num_fewshot: int | None = flag(None, "few-shot examples per prompt (none: each task's own)")
    limit: int = flag(0, "score at most this many documents per task (0: all)")
    include_path: str = flag("", "a directory of your own task YAMLs (e.g. over local JSONL)")
    gen_kwargs: str = flag("", "override the tasks' generation settings, e.g. "
                           "'max_gen_toks=64,until=###'")
    max_length: int = flag(0, "with --tasks, the context in tokens: longer requests are cut "
                           "from the left (0: the model's max_position_embeddings)")
    apply_chat_template: bool = flag(False, "prompt through the tokenizer's chat template")
    output_path: str = flag("", "write lm-eval's results JSON (and with --log_samples each "
                            "document's prompts and responses) under this directory")
    log_samples: bool = flag(False, "with --output_path, save every document's requests and "
                             "responses")
    seed: int = flag(0, "sampling seed, for tasks that sample")


def evaluate(model, params, dataset, batch_size, max_batches=0):
    """Token-weighted mean loss over the dataset's rows -> (loss, tokens)."""
    score = jax.jit(functools.partial(batch_loss, model))
    loss_sum, tokens = 0.0, 0.0
    for i, batch in enumerate(dataset.eval_batches(batch_size)):
        if max_batches and i >= max_batches:
            break
        s, n = score(params, batch)
        loss_sum, tokens = loss_sum + float(s), tokens + float(n)
    return loss_sum / max(tokens, 1.0), int(tokens)


def run_tasks(cfg, data_given):
    """--tasks: lm-eval-harness on the model -> (lm-eval's tables as text, {task: metrics})."""
    if data_given:
        raise ConfigError("--data and --tasks are two modes: score a dataset's perplexity "
                          "with --data, or lm-eval tasks with --tasks, not both")
    if cfg.log_samples and not cfg.output_path:
        raise ConfigError("--log_samples saves each document's responses under "
                          "--output_path; pass --output_path=DIR too")
    try:
        from lm_eval.utils import make_table
        from trainer import harness
    except ImportError as e:
        missing = (e.name or "?").split(".")[0]
        raise ConfigError(f"--tasks needs lm-eval-harness ({missing} is not installed): "
                          'pip install -e ".[eval]"') from None
    manager = harness.task_manager(cfg.tasks, cfg.include_path)
    model, params, tokenizer = loading.load_model(cfg.checkpoint, cfg.tokenizer, cfg.dtype)
    if cfg.max_length > model.cfg.max_position_embeddings:
        raise ConfigError(f"--max_length={cfg.max_length} is longer than the model's "
                          f"max_position_embeddings={model.cfg.max_position_embeddings}")
    lm = harness.MeshLM(model, params, tokenizer, batch_size=cfg.batch_size,
                        max_length=cfg.max_length, seed=cfg.seed)
    results = harness.run_tasks(lm, cfg.tasks, manager, num_fewshot=cfg.num_fewshot,
                                limit=cfg.limit or None, gen_kwargs=cfg.gen_kwargs or None,
                                apply_chat_template=cfg.apply_chat_template,
                                output_path=cfg.output_path, log_samples=cfg.log_samples,
                                model_name=cfg.checkpoint)
    tables = make_table(results)
    if results.get("groups"):
        tables += "\n" + make_table(results, "groups")
    return tables, harness.metrics_json(results)


def main(argv=None):
    absl_logging.set_verbosity(absl_logging.ERROR)  # Orbax's read-only notices
    cfg = parse_or_exit("trainer.eval", EvalFlags, argv)
    if cfg.tasks:
        try:
            tables, metrics = run_tasks(cfg, "data" in given(sys.argv[1:] if argv is None
                                                             else argv))
        except UserError as e:
            sys.exit(f"error: {e}")
        print(tables)
        print(json.dumps(metrics))
        return
    try:
        if cfg.format == "preference":
            raise ConfigError("--format=preference: trainer.eval scores text, chat or fields "
                              "data; score a preference set's chosen replies as chat data")
        model, params, tokenizer = loading.load_model(cfg.checkpoint, cfg.tokenizer, cfg.dtype)
        if cfg.seq_len > model.cfg.max_position_embeddings:
            raise ConfigError(f"--seq_len={cfg.seq_len} is longer than the model's "
                              f"max_position_embeddings={model.cfg.max_position_embeddings}")
        data_cfg = DataConfig(path=cfg.data, format=cfg.format, text_field=cfg.text_field,
                              messages_field=cfg.messages_field, fields=cfg.fields,
                              split=cfg.split, val_fraction=0.0, cache_dir=cfg.cache_dir)
        dataset, _ = data.load_dataset(data_cfg, tokenizer, cfg.seq_len)
        model = model.clone(loss_chunk=loss_chunk_for(cfg.batch_size, cfg.seq_len,
                                                      model.cfg.vocab_size))
        loss, tokens = evaluate(model, params, dataset, cfg.batch_size, cfg.max_batches)
    except UserError as e:
        # data.py names the train command's flags (--data.fields); here they are --fields.
        sys.exit(f"error: {str(e).replace('--data.path', '--data').replace('--data.', '--')}")
    print(json.dumps({"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": tokens}))


if __name__ == "__main__":
    main()
