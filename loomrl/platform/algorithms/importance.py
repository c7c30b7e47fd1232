"""Importance correction for the rollout/trainer mismatch.

The rollout engine and the trainer compute different log-probs for the same tokens
under the same weights (different kernels, rounding, top-p), so the samples come from
pi_rollout while the objective assumes pi_old under the trainer. Per token,

    ratio = pi_old_trainer(y_t) / pi_rollout(y_t) = exp(old_logp - rollout_logp)

weights the PPO/GRPO surrogate:
- none:     w = 1 (the ratio is still measured and reported);
- truncate: w = min(ratio, cap), truncated importance sampling (TIS; Yao et al. 2025,
            "Your efficient RL framework secretly brings you off-policy RL training");
- mask:     w = ratio inside [low, high], 0 outside: tokens whose ratio leaves the band
            are dropped from the gradient (masked importance sampling, as IcePop in
            Ling Team 2025, "Every step evolves"; verl's rollout_is mask mode).

Whatever the mode, two figures say how far off-policy the tokens are: the KL(rollout || trainer)
estimated on the sampled tokens with the non-negative k3 estimator E[r - 1 - log r] (the same as
`mismatch.mismatch`), and the share of tokens whose ratio leaves the band [low, high] (the
tokens mask mode would drop).
"""

from __future__ import annotations

import torch


def importance_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token weights [B, T] (no gradient) and sums over the masked tokens:
    is_ratio_sum, is_clipped (ratio > cap, truncate mode), is_masked (outside the band,
    mask mode), is_outside (outside the band, every mode), is_kl (the k3 terms r - 1 - log r),
    and is_ratio_max (a max, not a sum)."""
    mask = mask.float()
    log_ratio = old_logp.detach() - rollout_logp.detach()
    ratio = torch.exp(log_ratio)
    on = mask > 0
    outside = ((ratio < low) | (ratio > high)) & on
    clipped = torch.zeros_like(on)
    masked = torch.zeros_like(on)
    if mode == "none":
        w = torch.ones_like(ratio)
    elif mode == "truncate":
        clipped = (ratio > cap) & on
        w = ratio.clamp(max=cap)
    elif mode == "mask":
        masked = outside
        w = ratio.masked_fill(masked, 0.0)
    else:
        raise ValueError(f"unknown importance correction mode {mode!r}")
    stats = {
        "is_ratio_sum": float((ratio * mask).sum()),
        "is_ratio_max": float(ratio[on].max()) if on.any() else 1.0,
        "is_clipped": float(clipped.sum()),
        "is_masked": float(masked.sum()),
        "is_outside": float(outside.sum()),
        "is_kl": float(((ratio - 1 - log_ratio) * mask).sum()),
    }
    return w * mask, stats
