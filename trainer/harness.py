"""lm-eval-harness on meshlm: an `lm_eval` LM over a meshlm model, and `run_tasks` behind
`python -m trainer.eval --tasks=...`.

Importing this module imports lm_eval (and with it torch); trainer.eval imports it only
when --tasks is given. The adapter tokenizes, truncates and windows requests exactly as
lm-eval's own `hf` model does (TemplateLM's context/continuation split, the same left
truncation, the same rolling windows), so a model scores the same through either.
"""

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import normalize_gen_kwargs

from trainer.errors import UserError, one_line
from trainer.generate import bucket, cut_at_stops, generate
from trainer.tokenizer import BUILTIN_CHAT_TEMPLATE

@functools.partial(jax.jit, static_argnums=0)
def _token_scores(model, params, tokens, targets):
    """tokens, targets [B, T] -> (log p(target) [B, T], target is the argmax [B, T])."""
    logits = model.apply({"params": params}, tokens)  # [B, T, V] float32
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    target_logp = target_logits - jax.nn.logsumexp(logits, axis=-1)  # no [B, T, V] log_softmax
    return target_logp, jnp.argmax(logits, axis=-1) == targets


class MeshLM(TemplateLM):
    """An lm_eval model: loglikelihood, loglikelihood_rolling and generate_until, batched.

    Scoring rows are right-padded to a few length buckets and the batch to `batch_size`
    rows, so jit compiles at most one program per bucket."""

    def __init__(self, model, params, tokenizer, batch_size=8, max_length=0, seed=0):
        super().__init__()
        self.model, self.params, self.tok = model, params, tokenizer
        self._batch_size = batch_size
        self.max_length = max_length or model.cfg.max_position_embeddings
        self.seed = seed
        self.stop_ids = tokenizer.stop_ids

    # ------------------------------------------------------------ what lm-eval asks of a model
    @property
    def eot_token_id(self):
        return self.tok.eos_id

    @property
    def prefix_token_id(self):
        # Scored before an empty context: BOS where the tokenizer has one, as in lm-eval's hf.
        return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

    @property
    def tokenizer_name(self):
        return self.tok.name.replace("/", "__")

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        """With add_special_tokens None: the tokenizer's own specials (BOS), unless the string
        already starts with the prefix token's text."""
        if add_special_tokens is None:
            prefix = {i: text for text, i in self.tok.specials.items()}.get(self.prefix_token_id)
            add_special_tokens = not (prefix and string.startswith(prefix))
        return self.tok.encode_text(string) if add_special_tokens else self.tok.encode(string)

    def apply_chat_template(self, chat_history, add_generation_prompt=True):
        text = self.tok.render_chat(chat_history, add_generation_prompt)
        if not add_generation_prompt:  # the last message is a prefill to continue, unclosed
            last = chat_history[-1]["content"]
            text = text[:text.rindex(last) + len(last)] if last in text else text
        return text

    def chat_template(self, chat_template=False):
        """The template --apply_chat_template renders with (lm-eval records it)."""
        return getattr(self.tok, "chat_template", BUILTIN_CHAT_TEMPLATE)

    # ------------------------------------------------------------------------- scoring
    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        """requests: (key, context ids, continuation ids) -> (log p(continuation), greedy)."""
        rows = []
        for _, context, continuation in requests:
            # As lm-eval's hf: keep the last max_length + 1 tokens; score the continuation.
            whole = (context + continuation)[-(self.max_length + 1):]
            rows.append((whole, len(continuation)))
        results = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        for start in range(0, len(order), self._batch_size):
            chunk = order[start:start + self._batch_size]
            T = bucket(max(len(rows[i][0]) - 1 for i in chunk), self.max_length)
            tokens = np.full((self._batch_size, T), self.tok.pad_id, np.int32)
            targets = np.zeros((self._batch_size, T), np.int32)
            for r, i in enumerate(chunk):
                whole = rows[i][0]
                tokens[r, :len(whole) - 1] = whole[:-1]
                targets[r, :len(whole) - 1] = whole[1:]
            logp, greedy = jax.device_get(_token_scores(self.model, self.params, tokens, targets))
            for r, i in enumerate(chunk):
                end = len(rows[i][0]) - 1
                span = slice(end - rows[i][1], end)
                results[i] = (float(logp[r, span].astype(np.float64).sum()),
                              bool(greedy[r, span].all()))
        for (key, _, _), result in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        """Each text's log-likelihood over disjoint windows of max_length tokens, each window
        with as much preceding context as fits (lm-eval's windows, as its hf model)."""
        windows, owner = [], []
        for n, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(lm_utils.make_disjoint_window,
                                             lm_utils.get_rolling_token_windows(
                                                 token_list=self.tok_encode(text),
                                                 prefix_token=self.prefix_token_id,
                                                 max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logp, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[n] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ----------------------------------------------------------------------- generation
    def generate_until(self, requests, disable_tqdm=False):
        """Greedy (or the task's sampling) continuations, cut at the first stop string."""
        out = [None] * len(requests)
        groups = {}  # requests with the same generation settings run together
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(requests[indices[0]].args[1], 256)
            until, max_new = kwargs["until"], kwargs["max_gen_toks"]
            if max_new >= self.max_length:
                raise UserError(f"a task asks for max_gen_toks={max_new}, not less than the "
                                f"context of {self.max_length} tokens; pass a smaller "
                                "--gen_kwargs=max_gen_toks=N")
            sampled = kwargs["do_sample"] and kwargs["temperature"] > 0
            # An empty context (no BOS to add) starts from the prefix token, as in scoring.
            prompts = {i: self.tok_encode(requests[i].args[0])[-(self.max_length - max_new):]
                       or [self.prefix_token_id] for i in indices}
            order = sorted(indices, key=lambda i: -len(prompts[i]))
            for start in range(0, len(order), self._batch_size):
                chunk = order[start:start + self._batch_size]
                batch = [prompts[i] for i in chunk]
                batch += [batch[-1]] * (self._batch_size - len(batch))  # a fixed batch shape
                new = generate(self.model, self.params, batch, self.tok.eos_id, self.tok.pad_id,
                               max_new, kwargs["temperature"] if sampled else 0.0,
                               kwargs.get("top_p", 1.0) or 1.0, kwargs.get("top_k", 0) or 0,
                               self.seed)
                for i, ids in zip(chunk, new):
                    # As HF's generate: up to and including the first end token.
                    ids = ids[:next((n + 1 for n, t in enumerate(ids) if t in self.stop_ids),
                                    len(ids))]
                    out[i] = cut_at_stops(self.tok.decode(ids), until)
                    self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        return out


def task_manager(tasks, include_path=""):
    """lm-eval's TaskManager for these task names, once every name is known. Tasks all found
    under include_path skip the scan of lm-eval's own ~15k task files (about 20 s)."""
    from lm_eval.tasks import TaskManager
    if include_path and not os.path.isdir(include_path):
        raise UserError(f"--include_path={include_path}: no such directory")
    names = task_names(tasks)
    if not names:
        raise UserError(f"--tasks={tasks!r}: name at least one task, e.g. --tasks=hellaswag")
    if include_path:
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if all(manager.match_tasks([n]) for n in names):
            return manager
    manager = TaskManager(include_path=include_path or None)
    unknown = [n for n in names if not manager.match_tasks([n])]
    if unknown:
        where = (f"in lm-eval or under --include_path={include_path}" if include_path else
                 "in lm-eval (your own task YAMLs go in a directory given as --include_path)")
        raise UserError(f"--tasks: no task {', '.join(map(repr, unknown))} {where}")
    return manager


def task_names(tasks):
    return [t.strip() for t in tasks.split(",") if t.strip()]


def run_tasks(lm, tasks, manager, num_fewshot=None, limit=None, gen_kwargs=None,
              apply_chat_template=False, output_path="", log_samples=False, model_name=""):
    """simple_evaluate over task names (or globs) -> lm-eval's results dict; with
    output_path, lm-eval's own results (and samples) files are written there."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    tracker = EvaluationTracker(output_path=output_path) if output_path else None
    try:
        results = lm_eval.simple_evaluate(
            model=lm, model_args={"pretrained": model_name}, tasks=task_names(tasks),
            num_fewshot=num_fewshot, limit=limit, gen_kwargs=gen_kwargs, task_manager=manager,
            apply_chat_template=apply_chat_template, log_samples=log_samples,
            evaluation_tracker=tracker)
    except OSError as e:  # a task's data files missing, or its hub dataset out of reach
        raise UserError(f"--tasks={tasks}: cannot load a task's data: {one_line(e)} (a task "
                        "YAML's local data_files are read from the current directory)") from None
    if tracker:
        samples = results.pop("samples", {})
        tracker.save_results_aggregated(results=results,
                                        samples=samples if log_samples else None)
        for task in results["configs"] if log_samples else []:
            tracker.save_results_samples(task_name=task, samples=samples[task])
    return results


def metrics_json(results):
    """task -> {"metric,filter": value} from lm-eval's results (tasks and groups), NaN as
    None (strict JSON)."""
    clean = lambda v: None if isinstance(v, float) and not math.isfinite(v) else v
    return {task: {k: clean(v) for k, v in metrics.items() if "," in k}
            for task, metrics in {**results.get("results", {}),
                                  **results.get("groups", {})}.items()}
