"""algorithm.entropy_floor: below the target entropy a micro-batch's loss gains
coef x (target - mean token entropy) x its share of the mini-batch's tokens, so its gradient is the
entropy's, scaled and with the sign that raises it; above the target (and at target 0, the default)
the loss is the plain one bit for bit. Checked through the runner's real loss on a real model."""

import torch

from loomrl.platform.algorithms.losses import policy_loss_fn
from loomrl.platform.recipe import Recipe
from loomrl.platform.trajectory.batch import Trajectory, collate


def _batch(model, samples):
    trajs = [
        Trajectory(s.id, i, s.ids, [5, 6, 7, 8][: 3 + i % 2], s.media, [0.0] * (3 + i % 2), 0.0, 0, advantage=a)
        for i, (s, a) in enumerate(zip(samples[:3], [1.0, -0.5, 0.25]))
    ]
    mb = collate(trajs, model.pad_token_id)
    mb.normaliser = float(mb.loss_mask.sum()) * 2  # this micro-batch is half the mini-batch's tokens
    mb.sequences = 6
    with torch.no_grad():
        logp, entropy = model.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.media)
    mb.rollout_logp = logp.clone()
    m = mb.loss_mask
    return mb, float((entropy * m).sum() / m.sum())


def _loss_and_grads(model, mb, target, coef=0.05):
    recipe = Recipe()
    recipe.algorithm.entropy_floor.target, recipe.algorithm.entropy_floor.coef = target, coef
    model.zero_grad()
    loss, stats = policy_loss_fn(recipe, None)(model, mb)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, stats


def test_below_the_floor_the_loss_gains_the_scaled_entropy_gap_and_its_gradient(model, samples):
    mb, h = _batch(model, samples)
    plain, g_plain, s_plain = _loss_and_grads(model, mb, 0.0)
    assert "entropy_floor_sum" not in s_plain
    target, coef = h + 1.0, 0.05
    floored, g_floor, stats = _loss_and_grads(model, mb, target, coef)
    share = 0.5
    assert torch.allclose(floored - plain, torch.tensor(coef * (target - h) * share, dtype=plain.dtype), atol=1e-6)
    assert abs(stats["entropy_floor_sum"] - (target - h) * float(mb.loss_mask.sum())) < 1e-4
    # the extra gradient is -coef * share * dH/dtheta: the entropy's, raising it
    model.zero_grad()
    _, entropy = model.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.media)
    (-(coef * share) * (entropy * mb.loss_mask).sum() / mb.loss_mask.sum()).backward()
    moved = 0
    for name, g in g_floor.items():
        want = g_plain[name] + model.get_parameter(name).grad
        assert torch.allclose(g, want, atol=1e-6), name
        moved += int(not torch.allclose(g, g_plain[name], atol=1e-7))
    assert moved > 0


def test_above_the_floor_the_loss_is_the_plain_one(model, samples):
    mb, h = _batch(model, samples)
    plain, g_plain, _ = _loss_and_grads(model, mb, 0.0)
    above, g_above, stats = _loss_and_grads(model, mb, h * 0.5)
    assert torch.equal(plain, above) and stats["entropy_floor_sum"] == 0.0
    assert all(torch.equal(g_plain[n], g_above[n]) for n in g_plain)
