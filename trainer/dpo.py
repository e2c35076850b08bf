"""Direct Preference Optimization (Rafailov et al., 2023): learn from pairs of responses to
one prompt, one preferred, without a reward model.

A batch row is a pair: `inputs`, `targets` and `loss_mask` are [B, 2, T], index 0 the
chosen sequence and 1 the rejected one, loss_mask 1 on the response tokens (data.py,
--data.format=preference). logp is a response's log-probability, summed over its tokens,
under the policy being trained and under the frozen reference (the starting weights):

  reward = beta * (logp_policy - logp_reference)
  loss   = -log sigmoid(reward_chosen - reward_rejected), averaged over the global batch's pairs

At the start policy = reference, so every reward is 0 and the loss is log 2.
"""

import jax
import jax.numpy as jnp

from trainer.model import batch_loss

# What dpo_loss sums over pairs besides the loss; the step divides them by the pair count.
METRICS = ("reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward")


def dpo_loss(model, params, reference_params, batch, beta, dropout_rng=None):
    """(loss summed over pairs, number of pairs, {metric: sum over pairs}). Pairs whose
    masks are empty (an evaluation batch's padding) count for nothing."""
    pairs = batch["inputs"].shape[0]
    rows = {k: v.reshape(pairs * 2, v.shape[-1]) for k, v in batch.items()}  # [2B, T]
    nll, count = batch_loss(model, params, rows, dropout_rng, per_row=True)
    ref_nll, _ = batch_loss(model, jax.lax.stop_gradient(reference_params), rows, per_row=True)
    rewards = beta * (ref_nll - nll).reshape(pairs, 2)  # beta * (logp - logp_ref)
    margin = rewards[:, 0] - rewards[:, 1]
    real = jnp.all(count.reshape(pairs, 2) > 0, axis=-1).astype(jnp.float32)
    per_pair = {"reward_accuracy": (margin > 0).astype(jnp.float32), "reward_margin": margin,
                "chosen_reward": rewards[:, 0], "rejected_reward": rewards[:, 1]}
    loss = -jax.nn.log_sigmoid(margin)
    return (jnp.sum(loss * real), jnp.sum(real),
            {k: jnp.sum(v * real) for k, v in per_pair.items()})
