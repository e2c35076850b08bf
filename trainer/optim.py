"""The optimizer: global-norm clipping, then AdamW (or Adafactor, SGD) on a warmup schedule.

Weight decay skips norms and biases (any parameter with fewer than two dimensions).
Gradient accumulation is not here: it lives in the train step. The names of DECAYS and
OPTIMIZERS are the choices of --optimizer.schedule and --optimizer.name.
"""

import jax
import optax

# After warmup, the lr goes from its peak to peak * min_lr_ratio over `steps` steps.
DECAYS = {
    "cosine": lambda cfg, steps: optax.cosine_decay_schedule(cfg.lr, steps,
                                                             alpha=cfg.min_lr_ratio),
    "linear": lambda cfg, steps: optax.linear_schedule(cfg.lr, cfg.lr * cfg.min_lr_ratio, steps),
    "constant": lambda cfg, steps: optax.constant_schedule(cfg.lr),
}


def decay_mask(params):
    """True where weight decay applies: matrices and embeddings, not norms or biases."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


OPTIMIZERS = {
    "adamw": lambda cfg, lr: optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                                         weight_decay=cfg.weight_decay, mask=decay_mask),
    "adafactor": lambda cfg, lr: optax.adafactor(lr, weight_decay_rate=cfg.weight_decay or None,
                                                 weight_decay_mask=decay_mask),
    "sgd": lambda cfg, lr: optax.chain(optax.add_decayed_weights(cfg.weight_decay, decay_mask),
                                       optax.sgd(lr, momentum=cfg.b1)),
}


def learning_rate_schedule(cfg, total_steps):
    """Linear warmup to cfg.lr, then the decay cfg.schedule names."""
    warmup = min(cfg.warmup_steps, total_steps)
    decay = DECAYS[cfg.schedule](cfg, max(total_steps - warmup, 1))
    warm = optax.linear_schedule(0.0, cfg.lr, warmup) if warmup else optax.constant_schedule(cfg.lr)
    return optax.join_schedules([warm, decay], [warmup])


def make_optimizer(cfg, total_steps):
    """cfg: config.OptimizerConfig. Returns (optax transformation, lr schedule)."""
    schedule = learning_rate_schedule(cfg, total_steps)
    clip = optax.clip_by_global_norm(cfg.clip_norm) if cfg.clip_norm > 0 else optax.identity()
    return optax.chain(clip, OPTIMIZERS[cfg.name](cfg, schedule)), schedule
