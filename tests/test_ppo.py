"""PPO: per-token rewards, GAE, whitening and the clipped value loss against hand-computed
values; the value head and the separate critic in real short runs (checkpoint + resume)."""

import json
from pathlib import Path

import pytest
import torch

from loomrl.platform.algorithms.critic import Critic, ValueHead, build_critic
from loomrl.platform.algorithms.grpo import policy_loss
from loomrl.platform.algorithms.ppo import gae, token_rewards, value_loss, whiten
from loomrl.platform.metrics import comparable

ROOT = Path(__file__).resolve().parent.parent


def test_token_rewards_terminal_and_kl():
    mask = torch.tensor([[0.0, 1, 1, 1], [0, 1, 1, 0]])
    r = token_rewards(torch.tensor([1.0, -1.0]), mask)
    torch.testing.assert_close(r, torch.tensor([[0.0, 0, 0, 1], [0, 0, -1, 0]]))
    kl = torch.tensor([[5.0, 0.1, 0.2, 0.3], [5.0, 0.4, 0.5, 9.0]])  # off-mask entries must not count
    r = token_rewards(torch.tensor([1.0, -1.0]), mask, kl, kl_coef=0.5)
    torch.testing.assert_close(r, torch.tensor([[0.0, -0.05, -0.1, 1 - 0.15], [0, -0.2, -1 - 0.25, 0]]))
    with pytest.raises(ValueError, match="without completion tokens"):
        token_rewards(torch.tensor([1.0]), torch.zeros(1, 3))


def test_gae_by_hand():
    # row 0: prompt position, then 3 completion states; row 1: 2 completion states, then padding
    mask = torch.tensor([[0.0, 1, 1, 1], [0, 1, 1, 0]])
    values = torch.tensor([[9.0, 0.5, 0.2, 0.1], [9.0, 0.3, 0.4, 7.0]])
    rewards = torch.tensor([[0.0, 0, 0, 1], [0, 0, -1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0: d3 = 1 - .1 = .9; d2 = .9*.1 - .2 = -.11, A2 = -.11 + .72*.9 = .538;
    #        d1 = .9*.2 - .5 = -.32, A1 = -.32 + .72*.538 = .06736
    # row 1: d2 = -1 - .4 = -1.4 (the padding's value 7 is not bootstrapped); d1 = .9*.4 - .3 = .06,
    #        A1 = .06 + .72*(-1.4) = -.948
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.06736, 0.538, 0.9], [0, -0.948, -1.4, 0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.56736, 0.738, 1.0], [0, -0.648, -1.0, 0]]))
    # lambda = 1, gamma = 1: A_t = R - V_t (Monte Carlo)
    adv, _ = gae(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.5, 0.8, 0.9], [0, -1.3, -1.4, 0]]))


def test_whiten_across_micro_batches_of_different_widths():
    a, b = torch.tensor([[1.0, 2.0, 99.0]]), torch.tensor([[3.0, 4.0], [5.0, 6.0]])
    ma, mb = torch.tensor([[1.0, 1.0, 0.0]]), torch.ones(2, 2)
    wa, wb = whiten([a, b], [ma, mb])
    flat = torch.tensor([1.0, 2, 3, 4, 5, 6])
    expect = (flat - flat.mean()) / flat.std()
    torch.testing.assert_close(torch.cat([wa[0, :2], wb.flatten()]), expect, atol=1e-5, rtol=1e-5)
    assert wa[0, 2] == 0


def test_value_loss_by_hand():
    values, old = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.5]])
    returns, mask = torch.tensor([[2.0, 0.0]]), torch.ones(1, 2)
    # token 0: (1-2)^2 = 1, clipped V = .5 + .2 = .7 -> 1.69; token 1: 0, clipped V = .3 -> .09
    loss, stats = value_loss(values, old, returns, mask, clip=0.2, normaliser=2.0)
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.09) / 2)
    assert stats["value_clipped_tokens"] == 2
    loss, _ = value_loss(values, old, returns, mask, clip=0.0, normaliser=2.0)
    assert loss.item() == pytest.approx(0.5 * (1 + 0) / 2)


def test_ppo_policy_loss_with_token_advantages_by_hand():
    logp = torch.log(torch.tensor([[0.6, 0.2, 0.5]]))
    old = torch.log(torch.tensor([[0.4, 0.4, 0.5]]))
    adv = torch.tensor([[1.0, -1.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # ratio 1.5, A = 1: min(1.5, 1.2) = 1.2; ratio .5, A = -1: min(-.5, -.8) = -.8; third is padding
    loss, stats = policy_loss(logp, old, adv, mask, 0.2, normaliser=2.0)
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2, rel=1e-6)
    assert stats["clipped_tokens"] == 2


def test_value_head_and_critic_shapes_and_start(model, samples):
    from loomrl.platform.trajectory.batch import Trajectory, collate

    trajs = [Trajectory(s.id, i, s.ids, [5, 6, 7], s.media, [0.0] * 3, 1.0, 0) for i, s in enumerate(samples[:3])]
    mb = collate(trajs, model.pad_token_id)
    logp, _, hidden = model.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.media, return_hidden=True)
    logp2, _ = model.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.media)
    torch.testing.assert_close(logp, logp2)  # the option changes nothing else
    assert hidden.shape == (*mb.input_ids.shape, model.cfg.hidden_size)
    head = ValueHead(model.cfg.hidden_size)
    assert head(hidden).shape == mb.loss_mask.shape and torch.all(head(hidden) == 0)  # V = 0 at the start
    critic = build_critic(model, lambda: type(model)(model.cfg, _tok()))
    for (n, p), (n2, q) in zip(model.state_dict().items(), critic.body.state_dict().items()):
        assert n == n2 and torch.equal(p, q)  # starts from the policy's weights
    with torch.no_grad():
        critic.head.proj.bias.fill_(0.25)
    assert isinstance(critic, Critic) and torch.allclose(critic(mb), torch.full(mb.loss_mask.shape, 0.25))


def _tok():
    from loomrl.platform.backbone.tokenizer import load_tokenizer

    return load_tokenizer("demo")


def cli(tmp: Path, out: str, *extra: str) -> int:
    from loomrl.cli import main

    return main(
        [
            "run",
            str(ROOT / "recipes" / "demo-ppo.yaml"),
            "--out",
            str(tmp / out),
            f"data.shards={tmp}/shards/demo-*.tar",
            "data.demo.samples=48",
            "data.shuffle_buffer=20",
            "training.steps=4",
            "training.warmup.steps=2",
            "training.mini_batches=1",
            "training.prompts_per_step=4",
            "rollout.n=2",
            "checkpoint.every=1",
            "checkpoint.keep_last=3",
            "rollout.drafter.compare_every=0",
            "logging.tensorboard=false",
            "goal=null",
            "training.threads=1",
            "algorithm.reward=rewards_for_tests:distinct_words",
            *extra,
        ]
    )


def rows(path: Path) -> list[dict]:
    return [comparable(json.loads(line)) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("critic", ["value_head", "separate"])
def test_ppo_run_learns_values_checkpoints_and_resumes_exactly(tmp_path, critic):
    extra = (
        f"algorithm.ppo.critic={critic}",
        "algorithm.epochs=2",
        "algorithm.kl_coef=0.05",
        "algorithm.kl_placement=reward",
    )
    assert cli(tmp_path, "full", *extra) == 0
    got = rows(tmp_path / "full" / "metrics.jsonl")
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    for r in got:
        assert {"value_loss", "value_mean", "return_mean", "is_ratio_mean", "kl_reward_mean"} <= set(r)
        assert r["value_loss"] > 0 and r["grad_norm"] > 0
    assert got[0]["value_mean"] == 0.0 and got[-1]["value_mean"] != 0.0  # the critic is trained
    ckpt = tmp_path / "full" / "checkpoints" / "step-000004"
    name = "value_head" if critic == "value_head" else "critic"
    assert (ckpt / f"{name}.safetensors").is_file()
    # stop after 2 steps, resume: the critic (and its optimizer) come back, metrics match
    assert cli(tmp_path, "part", *extra, "--max-steps", "2") == 0
    assert cli(tmp_path, "part", *extra, "--resume") == 0
    assert rows(tmp_path / "part" / "metrics.jsonl") == got
