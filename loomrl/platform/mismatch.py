"""The rollout/trainer log-prob mismatch, measured: the trainer's forward on a low-precision copy
of the policy, per rounding setting, against the log-probs a rollout engine reported.

Used by the training loop (`logging.mismatch_every`: `mismatch_metrics`) and by the tools that
report it (`loomrl doctor`, its region-by-region trace). Per setting, over every completion token:
mean and max |trainer logp - rollout logp|, and the token-level KL(rollout || trainer) estimated on
the sampled tokens with the non-negative k3 estimator E[r - 1 - log r], r = p_trainer / p_rollout.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch

from loomrl.platform.backbone.rounding import SETTINGS, Regions
from loomrl.platform.trajectory.batch import Trajectory, micro_batches, rollout_trajectories

DTYPE = torch.bfloat16
MICRO_BATCH = 16


def low_precision_copy(model, regions: Regions, dtype: torch.dtype = DTYPE):
    """An eval-mode copy of the policy whose language model is in `dtype` and rounds as `regions`
    say. The towers and the audio projector keep the policy's dtype, as the encodings a rollout
    engine gets from the policy do; `VLM.embed` rounds them to `dtype` where it splices them in."""
    m = copy.deepcopy(model).eval().requires_grad_(False)
    m.language_model.to(dtype)
    m.language_model.cfg.rounding = regions  # the copy's own config object, shared by its layers
    m.encoding_cache.clear()
    return m


trajectories = rollout_trajectories  # the engine's rollouts, to score with the trainer's forward


def completion_logprobs(logp: torch.Tensor, mb) -> list[list[float]]:
    """Per row, the log-probs at the completion positions (loss_mask), in order."""
    return [logp[i][mb.loss_mask[i].bool()].tolist() for i in range(logp.shape[0])]


@torch.no_grad()
def policy_encodings(model, trajs: list[Trajectory]) -> dict:
    """The policy's encodings of the trajectories' media by Medium.key, as a rollout engine computes
    them for a batch (`VLLMRolloutEngine._prompt_inputs`, `TorchRolloutEngine.generate`): one
    deduplicated call in eval mode, served from the policy's encoding cache where the engine just
    filled it. A tower's output depends slightly on which media share its call, so encoding per
    micro-batch would round a few elements differently from what the engine used. Not counted
    as the trainer's encoder work (`encode_totals`)."""
    was_training, totals = model.training, model.encode_totals.copy()
    model.eval()
    try:
        return model.encode_media([m for t in trajs for m in t.media])
    finally:
        model.train(was_training)
        model.encode_totals = totals


@torch.no_grad()
def trainer_logprobs(
    policy, trajs: list[Trajectory], temperature: float, encodings: Optional[dict] = None, top_p: float = 1.0
) -> list[list[float]]:
    """The trainer's log-probs of each trajectory's completion: one full-sequence forward per
    micro-batch, exactly the trainer's `sequence_logprobs` (with `encodings`: those media
    encodings, by Medium.key, instead of the policy's towers per micro-batch). top_p < 1: under
    the trainer's own top-p nucleus, as a top-p rollout's log-probs are (both engines report them so)."""
    out: list[list[float]] = []
    top_p = top_p if temperature > 0 else 1.0
    for mb in micro_batches(trajs, policy.pad_token_id, MICRO_BATCH, device=policy.device):
        got = policy.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.media, temperature, encodings, top_p=top_p)
        logp = got[0] - got[-1] if top_p < 1.0 else got[0]
        out.extend(completion_logprobs(logp, mb))
    return out


def mismatch(rollout: list[list[float]], trainer: list[list[float]]) -> dict:
    """mean / max |dlogp| and the k3 estimate of KL(rollout || trainer) over all tokens."""
    a = torch.tensor([x for row in rollout for x in row], dtype=torch.float64)
    b = torch.tensor([x for row in trainer for x in row], dtype=torch.float64)
    if a.shape != b.shape:
        raise ValueError(f"{a.numel()} rollout log-probs but {b.numel()} trainer log-probs")
    if a.numel() == 0:
        return {"mean_abs_dlogp": 0.0, "max_abs_dlogp": 0.0, "kl": 0.0}
    d = b - a  # log r, r = p_trainer / p_rollout
    return {
        "mean_abs_dlogp": float(d.abs().mean()),
        "max_abs_dlogp": float(d.abs().max()),
        "kl": float((d.exp() - 1 - d).mean()),
    }


def measure(
    model,
    trajs: list[Trajectory],
    temperature: float,
    settings: dict[str, Regions] = SETTINGS,
    dtype: torch.dtype = DTYPE,
    top_p: float = 1.0,
) -> dict[str, dict]:
    """Mismatch between the trajectories' rollout log-probs and the trainer's forward on a
    `dtype` copy of `model`, per rounding setting (top_p: the rollouts', see trainer_logprobs)."""
    rollout = [t.rollout_logprobs for t in trajs]
    encodings = policy_encodings(model, trajs)
    return {
        name: mismatch(
            rollout,
            trainer_logprobs(low_precision_copy(model, regions, dtype), trajs, temperature, encodings, top_p),
        )
        for name, regions in settings.items()
    }


def mismatch_metrics(model, trajs: list[Trajectory], temperature: float, top_p: float = 1.0) -> dict[str, float]:
    """`measure` flattened for a metrics row: mismatch_<setting>_{mean,max,kl}."""
    short = {"mean_abs_dlogp": "mean", "max_abs_dlogp": "max", "kl": "kl"}
    return {
        f"mismatch_{name}_{short[k]}": v
        for name, row in measure(model, trajs, temperature, top_p=top_p).items()
        for k, v in row.items()
    }


# --------------------------------------------------------------------------- engines
