"""Top-p rollouts: the log-probs compared are the nucleus's on both sides.

A top-p rollout's token is drawn from the renormalised nucleus, and both engines report its
log-prob there (vLLM's processed log-probs; the built-in engine the same way). The trainer's
comparisons (`logp_mismatch` in the loss, `mismatch.py`, `logprob_gap`) renormalise the trainer's
log-prob over its own nucleus, so they measure arithmetic and not the truncation (which is
|log nucleus mass|, up to ~0.4 at top_p 0.7 here)."""

import math

import pytest
import torch

from loomrl.platform.algorithms.losses import policy_loss_fn
from loomrl.platform.backbone.vlm import nucleus_log_mass
from loomrl.platform.mismatch import trainer_logprobs
from loomrl.platform.recipe import Recipe
from loomrl.platform.rl_step import fill_logprobs
from loomrl.platform.rollout.base import Prompt, SamplingParams
from loomrl.platform.rollout.sampling import target_distribution, target_probs
from loomrl.platform.rollout.torch_engine import TorchRolloutEngine
from loomrl.platform.trajectory.batch import collate, rollout_trajectories

T, TOP_P = 0.8, 0.7


def test_nucleus_log_mass_is_the_log_of_the_kept_mass():
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.9, 0.05, 0.03, 0.02]]))
    # 0.5 + 0.3 reaches 0.7 (tokens 0, 1 kept); 0.9 alone does (token 0 kept)
    torch.testing.assert_close(nucleus_log_mass(logp, 0.7), torch.log(torch.tensor([0.8, 0.9])))
    kept = target_probs(logp, 1.0, 0.7)  # the sampler's nucleus is the same set
    torch.testing.assert_close(kept[0, :2].log(), logp[0, :2] - math.log(0.8))
    _, log_mass = target_distribution(logp, 1.0, 0.7)  # the sampler's own log-mass: the same bits
    assert torch.equal(log_mass, nucleus_log_mass(logp, 0.7))
    assert target_distribution(logp, 1.0, 1.0)[1] is None and target_distribution(logp, 0.0, 0.7)[1] is None


@pytest.fixture()
def top_p_rollouts(model, samples):
    prompts = [Prompt(s.id, s.ids, s.media) for s in samples[:3]]
    params = SamplingParams(n=4, temperature=T, top_p=TOP_P, max_new_tokens=10)
    res = TorchRolloutEngine(model).generate(prompts, params, torch.Generator().manual_seed(0))
    return rollout_trajectories(prompts, res.rollouts)


def test_the_built_in_engine_reports_nucleus_logprobs(model, top_p_rollouts):
    mb = collate(top_p_rollouts, model.pad_token_id)
    m = mb.loss_mask.bool()
    with torch.no_grad():
        logp, _, log_mass = model.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.media, T, top_p=TOP_P)
    torch.testing.assert_close(mb.rollout_logp[m], (logp - log_mass)[m], atol=1e-5, rtol=1e-5)
    assert (log_mass[m] < -0.05).any()  # the truncation is not negligible here: the check can fail
    # mismatch.py's comparison: the same numbers
    got = trainer_logprobs(model, top_p_rollouts, T, top_p=TOP_P)
    want = [t.rollout_logprobs for t in top_p_rollouts]
    assert max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x, y)) < 1e-5


@pytest.mark.parametrize("filled", [False, True], ids=["one-mini-batch", "old-logp-filled"])
def test_the_loss_mismatch_compares_nucleus_with_nucleus(model, top_p_rollouts, filled):
    mb = collate(top_p_rollouts, model.pad_token_id)
    mb.normaliser = float(mb.loss_mask.sum())
    for t, adv in zip(top_p_rollouts, [1.0, -1.0] * 6):
        t.advantage = adv
    mb.advantages = torch.tensor([t.advantage for t in top_p_rollouts])
    recipe = Recipe()
    recipe.rollout.temperature, recipe.rollout.top_p = T, TOP_P
    if filled:  # several mini-batches or epochs: pi_old's log-probs (and nucleus) prepared
        fill_logprobs(model, [mb], T, "old_logp", top_p=TOP_P)
        assert mb.old_nucleus is not None
    model.eval()
    _, stats = policy_loss_fn(recipe, None)(model, mb)
    assert stats["mismatch_sum"] / stats["tokens"] < 1e-5
    recipe.rollout.top_p = 1.0  # compared with the full distribution: the truncation shows
    mb.old_nucleus = None
    _, stats = policy_loss_fn(recipe, None)(model, mb)
    assert stats["mismatch_sum"] / stats["tokens"] > 1e-2
