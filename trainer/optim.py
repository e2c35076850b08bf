"""The optimizer: global-norm clipping, then AdamW (or Adafactor, SGD) on a warmup schedule.

Weight decay skips norms and biases (any parameter with fewer than two dimensions).
Gradient accumulation is not here: it lives in the train step.
"""

import jax
import optax


def learning_rate_schedule(cfg, total_steps):
    """Linear warmup to cfg.lr, then cosine / linear decay to cfg.lr * min_lr_ratio, or constant."""
    warmup = min(cfg.warmup_steps, total_steps)
    decay_steps = max(total_steps - warmup, 1)
    end = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        decay = optax.linear_schedule(cfg.lr, end, decay_steps)
    elif cfg.schedule == "constant":
        decay = optax.constant_schedule(cfg.lr)
    else:
        raise ValueError(f"--optimizer.schedule: unknown '{cfg.schedule}'; "
                         "use cosine, linear or constant")
    warm = optax.linear_schedule(0.0, cfg.lr, warmup) if warmup else optax.constant_schedule(cfg.lr)
    return optax.join_schedules([warm, decay], [warmup])


def decay_mask(params):
    """True where weight decay applies: matrices and embeddings, not norms or biases."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg, total_steps):
    """cfg: the optimizer ConfigDict. Returns (optax transformation, lr schedule)."""
    schedule = learning_rate_schedule(cfg, total_steps)
    if cfg.name == "adamw":
        core = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay, mask=decay_mask)
    elif cfg.name == "adafactor":
        core = optax.adafactor(schedule, weight_decay_rate=cfg.weight_decay or None,
                               weight_decay_mask=decay_mask)
    elif cfg.name == "sgd":
        core = optax.chain(optax.add_decayed_weights(cfg.weight_decay, decay_mask),
                           optax.sgd(schedule, momentum=cfg.b1))
    else:
        raise ValueError(f"--optimizer.name: unknown '{cfg.name}'; use adamw, adafactor or sgd")
    clip = optax.clip_by_global_norm(cfg.clip_norm) if cfg.clip_norm > 0 else optax.identity()
    return optax.chain(clip, core), schedule
