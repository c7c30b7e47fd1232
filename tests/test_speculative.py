"""NgramRL in the built-in engine: exact speculative verification, prefetch fallback,
bounded histories."""

import random
from collections import Counter

import pytest
import torch
from chi_square import (
    assert_fits,
    assert_same_per_position,
    chi2_critical,
    tally_positions,
    tally_prefixes,
    two_sample_chi2,
)
from model_probs import prefix_probs, reference_probs

from loomrl.platform.recipe import DrafterConfig, ModelConfig
from loomrl.platform.rollout.base import Prompt, SamplingParams
from loomrl.platform.rollout.drafter import NgramDrafter, Tree, _split, grow_tree
from loomrl.platform.rollout.sampling import target_probs
from loomrl.platform.rollout.torch_engine import TorchRolloutEngine, position_keyed_sample
from loomrl.platform.trajectory.batch import Trajectory, collate


@pytest.fixture()
def peaky_model(tokenizer):
    """A random model whose next-token distributions are concentrated on a few tokens, so
    drafts from earlier samples are often (not always) accepted."""
    from loomrl.platform.backbone.vlm import build_policy

    model = build_policy(ModelConfig(init_std=0.5), tokenizer, seed=3)
    return model


def text_prompts(n=4):
    return [Prompt(f"p{i}", [8 + i, 9, 12 + 2 * i, 15, 20 + i], []) for i in range(n)]


def warm(engine, prompts, params, rounds=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(rounds):
        for r in engine.generate(prompts, params, g).rollouts:
            engine.observe(prompts[r.prompt_index].id, r.completion_ids)


MODES = {"single": 0, "tree": 8}  # rollout.drafter.tree_nodes: single drafts, draft trees of 8 tokens


@pytest.mark.parametrize("mode", MODES)
def test_greedy_tokens_identical_with_and_without_drafting(peaky_model, samples, mode):
    prompts = text_prompts() + [Prompt(s.id, s.ids, s.media) for s in samples[:3]]
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=14)
    plain = TorchRolloutEngine(peaky_model)
    spec = TorchRolloutEngine(
        peaky_model, DrafterConfig(enabled=True, k=5, prefetch_budget=4, adaptive=False, tree_nodes=MODES[mode])
    )
    # seed histories with *sampled* completions so drafts are partly wrong: varied acceptance
    warm(spec, prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=14))
    a, b = plain.generate(prompts, params), spec.generate(prompts, params)
    assert [r.completion_ids for r in a.rollouts] == [r.completion_ids for r in b.rollouts]
    for x, y in zip(a.rollouts, b.rollouts):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)  # logits of this peaky model are ~10x the demo's
    acc = spec.last_stats.acceptance_by_position()
    assert b.forwards < a.forwards and 0 < acc[0] < 1  # some drafts accepted, some rejected
    assert b.tokens_per_forward > 1.0 and a.tokens_per_forward == 1.0


@pytest.mark.parametrize("mode", MODES)
def test_drafted_logprobs_equal_a_plain_forward(peaky_model, mode):
    prompts = text_prompts(3)
    spec = TorchRolloutEngine(peaky_model, DrafterConfig(enabled=True, k=4, adaptive=False, tree_nodes=MODES[mode]))
    params = SamplingParams(n=4, temperature=0.7, top_p=0.9, max_new_tokens=12)
    warm(spec, prompts, params)
    res = spec.generate(prompts, params, torch.Generator().manual_seed(5))
    assert spec.last_stats.accepted_by_pos[0] > 0
    trajs = [
        Trajectory(
            prompts[r.prompt_index].id,
            r.prompt_index,
            prompts[r.prompt_index].ids,
            r.completion_ids,
            [],
            r.logprobs,
            0.0,
            0,
        )
        for r in res.rollouts
    ]
    mb = collate(trajs, peaky_model.pad_token_id)
    with torch.no_grad():  # top-p: the rollout's log-probs are under the nucleus (test_top_p_logprobs.py)
        logp, _, log_mass = peaky_model.sequence_logprobs(
            mb.input_ids, mb.attention_mask, mb.media, temperature=0.7, top_p=0.9
        )
    m = mb.loss_mask.bool()
    torch.testing.assert_close((logp - log_mass)[m], mb.rollout_logp[m], atol=1e-5, rtol=1e-5)


def keyed_draws(probs: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """[n, W]: position_keyed_sample on n rows, each with probs [W, V] at W consecutive positions from
    a random start, and a seed drawn as the engine draws them."""
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(0, 1 << 62, (n,), generator=g)
    positions = torch.randint(1, 512, (n, 1), generator=g) + torch.arange(probs.shape[0])
    return position_keyed_sample(probs.expand(n, *probs.shape), seeds, positions)


def test_position_keyed_sample_draws_the_given_probabilities():
    """Goodness of fit of position_keyed_sample against known probabilities, not against itself:
    20000 rows each drawing from p at one position and from q at the next (zeros included: never
    drawn). Per position, and jointly against p x q: a sampler that skews the probabilities fails
    the first, one whose uniform ignores the position (a row's tokens all from one uniform) the second."""
    p = torch.tensor([0.30, 0.0, 0.20, 0.15, 0.10, 0.08, 0.0, 0.10, 0.05, 0.02])
    q = torch.tensor([0.02, 0.05, 0.0, 0.40, 0.13, 0.10, 0.10, 0.0, 0.12, 0.08])
    n = 20000
    draws = [tuple(d) for d in keyed_draws(torch.stack([p, q]), n, seed=0).tolist()]
    for col, dist in enumerate((p.tolist(), q.tolist())):
        seen = Counter(d[col] for d in draws)
        assert all(dist[t] > 0 for t in seen), f"position {col}: a token of probability 0 drawn"
        assert_fits(seen, dict(enumerate(dist)), n, f"position {col}", min_df=6)
    joint = {(a, b): pa * qb for a, pa in enumerate(p.tolist()) for b, qb in enumerate(q.tolist())}
    assert_fits(Counter(draws), joint, n, "pairs", min_df=30)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.5, 1.0), (1.5, 0.8), (0.8, 0.6)])
def test_sampling_draws_the_softmax_at_temperature_in_the_nucleus(peaky_model, temperature, top_p):
    """The engine's sampling path on fixed logits (the model's token_logprobs at T, target_probs,
    position_keyed_sample), 20000 draws, against softmax(logits / T) cut to the top-p nucleus as
    model_probs computes it apart from the engine: goodness of fit at p = 0.001 and no token outside
    the nucleus; then a two-sample test against torch.multinomial on those reference probabilities
    (an independent sampler, the same logits). A sampler that squares the probabilities, ignores the
    temperature or gets the nucleus one token off fails."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(peaky_model.language_model.lm_head.out_features, generator=g)
    ref = reference_probs(logits, peaky_model.banned_token_ids, temperature, top_p)
    probs = target_probs(peaky_model.token_logprobs(logits, temperature), temperature, top_p)
    n = 20000
    keyed = Counter(keyed_draws(probs[None], n, seed=1)[:, 0].tolist())
    assert all(ref[t] > 0 for t in keyed), "a token outside the nucleus (or banned) drawn"
    assert_fits(keyed, dict(enumerate(ref.tolist())), n, f"T {temperature}, top_p {top_p}", min_df=2)
    multi = Counter(torch.multinomial(ref, n, replacement=True, generator=g).tolist())
    chi2, df = two_sample_chi2(keyed, multi)
    assert df >= 2 and chi2 < chi2_critical(df), f"vs torch.multinomial: chi2 {chi2:.1f} over {df} df"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (1.5, 0.9)], ids=["plain", "top_p"])
def test_sampling_distribution_unchanged_by_drafting(peaky_model, temperature, top_p, mode):
    """Two-sample chi-square on the token at each of the first 4 positions: 3000 samples
    with drafting vs 3000 without, fixed threshold p = 0.001 per position. `top_p`: a nucleus
    (top_p 0.9 at temperature 1.5): drafts are accepted against the truncated, renormalised
    distribution, so every sampled token must stay inside it too. Both engines use the same
    sampler, which that comparison alone cannot fault: first each engine's first 4 tokens (jointly)
    are fitted to the model's own probabilities (model_probs: a full forward per prefix, apart from
    the engine's sampling code)."""
    prompt = [Prompt("p0", [8, 9, 12, 15, 20], [])]
    params = SamplingParams(n=500, temperature=temperature, top_p=top_p, max_new_tokens=5)
    plain = TorchRolloutEngine(peaky_model)
    spec = TorchRolloutEngine(
        peaky_model,
        DrafterConfig(
            enabled=True, k=4, max_history=64, max_history_tokens=10**6, adaptive=False, tree_nodes=MODES[mode]
        ),
    )
    warm(spec, prompt, SamplingParams(n=30, temperature=temperature, top_p=top_p, max_new_tokens=5), rounds=1, seed=9)
    counts = {"plain": [{} for _ in range(4)], "spec": [{} for _ in range(4)]}
    prefixes: dict = {"plain": {}, "spec": {}}
    g = torch.Generator().manual_seed(1)
    accepted = 0
    for _ in range(6):
        for name, eng in (("plain", plain), ("spec", spec)):
            rollouts = eng.generate(prompt, params, g).rollouts
            tally_positions(counts[name], rollouts)
            tally_prefixes(prefixes[name], rollouts, 4)
        accepted += sum(spec.last_stats.accepted_by_pos)
    assert accepted > 1000  # drafting really happened
    exact = prefix_probs(peaky_model, prompt[0].ids, 4, temperature, top_p, min_p=1 / 3000)
    for name in ("plain", "spec"):
        assert_fits(prefixes[name], exact, 3000, f"{name}: first 4 tokens", min_df=4)
    assert_same_per_position(counts["plain"], counts["spec"], min_df=1)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_tokens_do_not_depend_on_the_draft_length(peaky_model, temperature, top_p):
    """Position-keyed sampling: with the same seed, no drafter, drafting up to 1, up to 4, or as the
    adaptive controller chooses commit the same tokens (what makes timing-driven draft lengths
    reproducible, and drafting on / off the same run)."""
    prompts = text_prompts()
    params = SamplingParams(n=6, temperature=temperature, top_p=top_p, max_new_tokens=12)
    outs, forwards = [], []
    for cfg in (
        None,
        DrafterConfig(enabled=True, k=1, adaptive=False, tree_nodes=0),
        DrafterConfig(enabled=True, k=4, adaptive=False, tree_nodes=0),
        DrafterConfig(enabled=True, k=4),
        DrafterConfig(enabled=True, k=4, adaptive=False, tree_nodes=8),
    ):
        eng = TorchRolloutEngine(peaky_model, cfg)
        warm(eng, prompts, SamplingParams(n=6, temperature=1.0, max_new_tokens=12), seed=3)
        res = eng.generate(prompts, params, torch.Generator().manual_seed(11))
        outs.append([r.completion_ids for r in res.rollouts])
        forwards.append(res.seq_forwards)
    assert outs[0] == outs[1] == outs[2] == outs[3] == outs[4]
    assert forwards[4] < forwards[2] < forwards[1] < forwards[0]  # k = 4 drafted more than k = 1, a tree more still


def test_trace_replay_counts_tokens_per_forward_as_worked_by_hand():
    """bench_drafter.replay on a fixture: a drafter that always gets 2 of its 3 tokens right.
    Row `a` (7 tokens): forward 1 gives token 1; then [c1, c2, X] accepts 2 + the bonus (3 tokens),
    twice: 3 forwards, 7 tokens. Row `b` (round 0, a warm-up) is replayed but not counted."""
    from loomrl.commands.bench_drafter import replay

    rows = [{"round": 0, "completion_ids": [9, 9, 9, 9]}, {"round": 1, "completion_ids": [1, 2, 3, 4, 5, 6, 7]}]

    def make():
        state = {"row": None, "pos": 0}

        def start(row):
            state.update(row=row["completion_ids"], pos=0)

        def propose(n):
            truth = state["row"][state["pos"] :]
            return (truth[:2] + [-1])[:n]

        def commit(tokens):
            state["pos"] += len(tokens)

        return start, propose, commit, lambda row: None

    tally = replay(rows, 3, make)
    assert (tally.tokens, tally.forwards, tally.drafts, tally.accepted) == (7, 3, 2, 4)
    summary = tally.summary()
    assert summary["tokens_per_forward"] == 7 / 3 and summary["mean_accepted"] == 2.0
    assert summary["acceptance_by_position"] == [1.0, 1.0, 0.0]


def test_tree_replay_counts_tokens_per_forward_as_worked_by_hand():
    """A tree whose first-choice branch is wrong and whose second holds the next 3 tokens: each
    forward accepts 3 + the bonus. 9 tokens: the prefill's token, then 4 + 4: 3 forwards."""
    from loomrl.commands.bench_drafter import replay

    rows = [{"round": 1, "completion_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9]}]

    def make():
        state = {"row": None, "pos": 0}

        def start(row):
            state.update(row=row["completion_ids"], pos=0)

        def propose(n):
            t = state["row"][state["pos"] :] + [0, 0, 0]
            # node 0 (wrong) -> node 2 (wrong); node 1 = t0 -> node 3 = t1 -> node 4 = t2
            return Tree([-5, t[0], -6, t[1], t[2]], [-1, -1, 0, 1, 3])

        def commit(tokens):
            state["pos"] += len(tokens)

        return start, propose, commit, lambda row: None

    tally = replay(rows, 8, make)
    assert (tally.tokens, tally.forwards, tally.drafts, tally.accepted) == (9, 3, 2, 6)
    assert tally.summary()["acceptance_by_position"][:4] == [1.0, 1.0, 1.0, 0.0]


def test_bonus_token_seen_after_the_last_accepted_token_is_looked_up_in_every_history():
    """bench drafter's ceiling of history-based prefetch: was (last accepted, bonus) ever seen, in the
    prompt's history, the cross-prompt history or the request so far (its accepted tokens included)?"""
    from loomrl.commands.bench_drafter import _bigram_seen

    d = NgramDrafter(DrafterConfig(global_history=4))
    d.observe("p", [1, 2, 3])  # prompt p's history: (2, 3); the cross-prompt history too
    d.observe("q", [6, 2, 8])  # the cross-prompt history only, for p: (2, 8)
    st = d.start("p", [5, 2])
    assert _bigram_seen(d, st, [3])  # context 5 2, bonus 3: (2, 3) in p's history
    assert _bigram_seen(d, st, [8])  # (2, 8): the cross-prompt history
    assert not _bigram_seen(d, st, [9])  # (2, 9): nowhere
    assert _bigram_seen(d, st, [2, 2])  # accepted 2 (context 5 2 2), bonus 2: (2, 2), made by the accepted
    assert not _bigram_seen(d, st, [2, 5])  # (2, 5): nowhere
    st2 = d.start("p", [2, 4, 7])
    assert _bigram_seen(d, st2, [2, 4])  # accepted 2 (context 2 4 7 2), bonus 4: (2, 4) in the request
    assert not _bigram_seen(d, st2, [7, 9])
    assert st2.tokens == [2, 4, 7] and st.tokens == [5, 2]  # the checks leave the request as it was


def test_grow_tree_expands_the_most_probable_nodes_first():
    # two earlier continuations of the context, weights 2 and 1: [5, 6, 7] and [5, 8, 9]
    cands = [([5, 6, 7], 0, 2.0), ([5, 8, 9], 0, 1.0)]
    full = grow_tree(cands, k=3, nodes=10, smooth=0.0)
    assert (full.tokens, full.parents, full.depths()) == ([5, 6, 7, 8, 9], [-1, 0, 1, 0, 3], [1, 2, 3, 2, 3])
    assert grow_tree(cands, k=3, nodes=3, smooth=0.0).tokens == [5, 6, 7]  # P: 1, 2/3, 2/3 before 1/3
    assert grow_tree(cands, k=2, nodes=10, smooth=0.0).tokens == [5, 6, 8]  # at most k deep
    assert full.walk([5, 8, 9, 4]) == [0, 3, 4] and full.walk([6]) == []


def test_prefetch_and_fallback_commit_the_same_tokens(peaky_model):
    prompts = text_prompts()
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12)
    outs = {}
    for budget in (0, 16):
        eng = TorchRolloutEngine(
            peaky_model, DrafterConfig(enabled=True, k=4, prefetch_budget=budget, adaptive=False, tree_nodes=0)
        )
        warm(eng, prompts, params, seed=2)
        res = eng.generate(prompts, params, torch.Generator().manual_seed(7))
        outs[budget] = ([r.completion_ids for r in res.rollouts], eng.last_stats)
        eng.shutdown()
    assert outs[0][0] == outs[16][0]
    assert outs[0][1].coverage == 0.0 and outs[16][1].coverage > 0.2


def test_history_caps_hold_over_a_long_run():
    cfg = DrafterConfig(max_history=5, max_history_tokens=200, max_prompts=7, global_history=9)
    d = NgramDrafter(cfg)
    rng = random.Random(0)
    for step in range(3000):
        key = f"p{rng.randrange(20)}"
        d.observe(key, [rng.randrange(50) for _ in range(rng.randrange(1, 80))])
        if step % 7 == 0:  # a lookup indexes what is pending: evictions meet indexed and pending sequences
            d.propose(d.start(key, [rng.randrange(50) for _ in range(3)]), 4)
        assert len(d.histories) <= 7
        for h in d.histories.values():
            assert len(h.seqs) <= 5 and h.tokens <= 200
            assert h.tokens == sum(len(s) for s in h.seqs.values())
        assert len(d.global_history.seqs) <= 9
    # completions are indexed when a lookup first needs them; then the indexes hold only live sequences
    for h in list(d.histories.values()) + [d.global_history]:
        live = set(h.ready().seqs)
        assert all(_split(o)[0] in live for occ in h.index.values() for o in occ)
        assert sum(len(o) for o in h.unigram.values()) == h.tokens


def test_drafter_proposes_from_the_prompt_history():
    d = NgramDrafter(DrafterConfig(global_history=0))
    d.observe("q", [1, 2, 3, 4, 5, 6])
    d.observe("q", [1, 2, 3, 9, 9, 9])
    d.observe("q", [1, 2, 3, 4, 5, 7])
    st = d.start("q", [100, 101])
    st.extend([1, 2, 3])
    draft = d.propose(st, 3)
    assert draft.tokens == [4, 5, 7]  # majority at position 0, then the newest
    # support: history weight 2 x (1 + 0.01 x (16 - age)); ages 2, 1, 0 for the three completions
    assert draft.alternatives[0] == pytest.approx({4: 2 * 1.14 + 2 * 1.16, 9: 2 * 1.15})
    other = d.start("other", [100, 101])
    other.extend([1, 2, 3])
    assert d.propose(other, 3).tokens == []  # no history for this prompt, no cross-prompt source
    mark = len(st.tokens)
    st.extend([4, 5])
    st.truncate(mark)
    assert d.propose(st, 3).tokens == [4, 5, 7]
