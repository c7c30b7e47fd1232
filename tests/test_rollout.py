import torch

from loomrl.platform.rollout.base import Prompt, SamplingParams
from loomrl.platform.rollout.sampling import target_probs
from loomrl.platform.rollout.torch_engine import TorchRolloutEngine
from loomrl.platform.trajectory.batch import collate, rollout_trajectories


def test_rollout_logprobs_equal_a_plain_forward(model, samples):
    prompts = [Prompt(s.id, s.ids, s.media) for s in samples[:3]]  # image, audio, both
    assert {len(p.media) for p in prompts} == {1, 2}
    engine = TorchRolloutEngine(model)
    res = engine.generate(
        prompts, SamplingParams(n=3, temperature=0.8, max_new_tokens=10), torch.Generator().manual_seed(0)
    )
    assert len(res.rollouts) == 9 and res.forwards >= 2
    trajs = rollout_trajectories(prompts, res.rollouts)
    mb = collate(trajs, model.pad_token_id)
    with torch.no_grad():
        logp, _ = model.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.media, temperature=0.8)
    m = mb.loss_mask.bool()
    assert m.sum() == sum(len(r.completion_ids) for r in res.rollouts)
    torch.testing.assert_close(logp[m], mb.rollout_logp[m], atol=1e-5, rtol=1e-5)


def test_rollouts_stop_at_eos_and_are_grouped(model, samples):
    prompts = [Prompt(s.id, s.ids, s.media) for s in samples[:2]]
    res = TorchRolloutEngine(model).generate(
        prompts, SamplingParams(n=4, max_new_tokens=6), torch.Generator().manual_seed(1)
    )
    assert [(r.prompt_index, r.sample_index) for r in res.rollouts] == [(p, j) for p in range(2) for j in range(4)]
    for r in res.rollouts:
        assert 1 <= len(r.completion_ids) <= 6 and len(r.logprobs) == len(r.completion_ids)
        assert model.eos_token_id not in r.completion_ids[:-1]
        assert r.finish_reason == ("stop" if r.completion_ids[-1] == model.eos_token_id else "length")
        assert not set(r.completion_ids) & set(model.banned_token_ids.tolist())


def test_top_p_samples_only_inside_the_nucleus():
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(2000, 4)
    g = torch.Generator().manual_seed(0)
    drawn = torch.multinomial(target_probs(logp, 1.0, 0.7), 1, generator=g).squeeze(-1)
    assert set(drawn.tolist()) == {0, 1}  # 0.5 + 0.3 covers 0.7; tokens 2, 3 never
    frac0 = (drawn == 0).float().mean().item()
    assert abs(frac0 - 0.5 / 0.8) < 0.04
    assert set(torch.multinomial(target_probs(logp, 1.0, 1.0), 1, generator=g).squeeze(-1).tolist()) == {0, 1, 2, 3}
