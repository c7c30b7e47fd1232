"""The draft-length controller: it settles on the arm with the best measured rate, climbs to a
long draft where drafting pays, and spends few forwards on arms that do not; and the draft lengths
it chooses leave the sampled tokens, and so their distribution, as without drafting."""

import pytest
import torch
from chi_square import assert_fits, tally_prefixes
from model_probs import prefix_probs

from loomrl.platform.recipe import DrafterConfig, ModelConfig
from loomrl.platform.rollout.base import Prompt, SamplingParams
from loomrl.platform.rollout.draft_control import EXPLORE_MAX, Choice, DraftController, arms
from loomrl.platform.rollout.torch_engine import TorchRolloutEngine

ROWS = 100


def run(controller: DraftController, cost: dict, accept: float, forwards: int) -> list[int]:
    """Drive the controller with a workload whose forward drafting k tokens costs cost[k] seconds per
    row, and where each draft position is accepted with probability `accept` given its predecessor."""
    chosen = []
    for _ in range(forwards):
        k = controller.choose().k
        chosen.append(k)
        controller.observe(cost[k] * ROWS, ROWS, [round(ROWS * accept ** (p + 1)) for p in range(k)])
    return chosen


MEMORY_BOUND = {0: 0.01, 1: 0.0105, 2: 0.011, 4: 0.012, 8: 0.016}  # extra positions nearly free


def test_arms():
    assert arms(8) == [0, 1, 2, 4, 8] and arms(5) == [0, 1, 2, 4, 5] and arms(1) == [0, 1]


def test_climbs_to_the_best_length_where_drafting_pays():
    # gains 1.8, 2.44, 3.36, 4.33 tokens per row for k = 1, 2, 4, 8: rates 171, 222, 280, 271 vs 100
    c = DraftController(8)
    chosen = run(c, MEMORY_BOUND, 0.8, 300)
    assert chosen[:5] == [0, 1, 2, 4, 8]  # each unmeasured neighbour tried at once
    assert chosen[-200:].count(4) >= 190  # settled on k = 4, a rare recheck of 2 and 8
    assert c.gain(4) == pytest.approx(1 + 0.8 + 0.64 + 0.51 + 0.41, abs=0.01)
    s = c.summary()
    assert s["draft_control_accept_pos0"] == pytest.approx(0.8) and s["draft_control_accept_pos1"] == pytest.approx(
        0.64
    )
    assert s["draft_k_best"] == 4 and s["draft_k_gain"] == pytest.approx(c.gain(4))
    assert s["draft_k_row_cost_s"] == pytest.approx(MEMORY_BOUND[4])


@pytest.mark.parametrize("slowdown", [1.2, 3.0])
def test_drafting_that_does_not_pay_costs_at_most_one_forward_in_32(slowdown):
    cost = {k: 0.01 * (1 if k == 0 else slowdown) * (1 + k / 16) for k in (0, 1, 2, 4, 8)}
    c = DraftController(8)
    chosen = run(c, cost, 0.1, 1000)
    drafted = sum(k > 0 for k in chosen)
    assert set(chosen) == {0, 1}  # k = 1 lost, so longer drafts are never tried
    assert drafted <= 1000 / 32
    assert sum(k > 0 for k in chosen[-500:]) <= 500 / EXPLORE_MAX + 1  # steady state: one in 256
    s = c.summary()
    assert (
        s["draft_k_best"] == 0 and s["draft_k0_row_tokens_per_s"] == pytest.approx(100) and 0 < s["draft_k_mean"] < 0.1
    )


def test_follows_a_workload_that_changes():
    """Drafting does not pay at first (no history yet), then it does: the controller finds out
    on a recheck and moves."""
    c = DraftController(8)
    run(c, MEMORY_BOUND, 0.02, 200)
    later = run(c, MEMORY_BOUND, 0.8, 400)  # a recheck within 256 forwards
    assert later[-50:].count(4) >= 45


def test_state_round_trip():
    a = DraftController(8)
    run(a, MEMORY_BOUND, 0.5, 50)
    b = DraftController(8)
    b.load_state_dict(a.state_dict())
    assert b.choose() == a.choose() and b.state_dict() == a.state_dict()


def test_a_tried_arm_runs_until_it_has_seen_16_rows():
    """A batch of 4 rows: one forward says little (4 rows that all rejected is no rarity), so a tried
    arm keeps going for 4 forwards before it is judged."""
    c = DraftController(8)
    chosen = []
    for _ in range(12):
        k = c.choose().k
        chosen.append(k)
        c.observe(MEMORY_BOUND[k] * 4, 4, [round(4 * 0.8 ** (p + 1)) for p in range(k)])
    assert chosen[:9] == [0, 1, 1, 1, 1, 2, 2, 2, 2]


def test_state_round_trip_in_the_middle_of_a_check():
    a = DraftController(8)
    for _ in range(3):  # k = 0, then two of the four forwards that check k = 1 on a 4-row batch
        k = a.choose().k
        a.observe(MEMORY_BOUND[k] * 4, 4, [4] * k)
    b = DraftController(8)
    b.load_state_dict(a.state_dict())
    assert [b.choose().k for _ in range(1)] == [a.choose().k] == [1] and b.state_dict() == a.state_dict()


class Scripted(DraftController):
    """The real controller (its observe() and summary()) choosing the arms of a fixed cycle, the tree
    included, whatever the timings: the draft length changes every forward, deterministically."""

    def __init__(self, k_max: int, tree_nodes: int, cycle: list[Choice]):
        super().__init__(k_max, tree_nodes)
        self.cycle, self.turn, self.used = cycle, 0, set()

    def choose(self) -> Choice:
        want = self.cycle[self.turn % len(self.cycle)]
        self.turn += 1
        self._pending = next(i for i, a in enumerate(self.arms) if (a.k, a.nodes) == want)
        self.chosen.append(want)
        self.used.add(want)
        return want


CYCLE = [Choice(4), Choice(4, 8), Choice(1), Choice(0), Choice(2), Choice(4, 8), Choice(2), Choice(4)]


@pytest.fixture()
def peaky_model(tokenizer):
    """A random model whose next-token distributions are concentrated on a few tokens, so drafts
    from earlier samples are often (not always) accepted (as in test_speculative.py)."""
    from loomrl.platform.backbone.vlm import build_policy

    return build_policy(ModelConfig(init_std=0.5), tokenizer, seed=3)


def controlled_engine(model, prompts: list[Prompt], params: SamplingParams) -> TorchRolloutEngine:
    """An adaptive engine (prefetching too) whose controller is `Scripted`, its histories warmed with
    sampled completions so drafts are partly accepted."""
    eng = TorchRolloutEngine(
        model,
        DrafterConfig(enabled=True, k=4, tree_nodes=8, prefetch_budget=4, max_history=64, max_history_tokens=10**6),
    )
    assert eng.control is not None
    eng.control = Scripted(4, 8, CYCLE)
    g = torch.Generator().manual_seed(9)
    for _ in range(2):
        for r in eng.generate(prompts, params, g).rollouts:
            eng.observe(prompts[r.prompt_index].id, r.completion_ids)
    return eng


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 1.0), (1.5, 0.9)])
def test_draft_lengths_chosen_by_the_controller_leave_the_tokens_unchanged(peaky_model, temperature, top_p):
    """With the controller changing the draft length (and single drafts vs trees) every forward, the
    same seed commits the same tokens, with the same log-probs, as plain decoding: greedy and sampled
    (position-keyed sampling: a token does not depend on how many were drafted around it)."""
    prompts = [Prompt(f"p{i}", [8 + i, 9, 12 + 2 * i, 15, 20 + i], []) for i in range(4)]
    params = SamplingParams(n=6, temperature=temperature, top_p=top_p, max_new_tokens=12)
    eng = controlled_engine(peaky_model, prompts, SamplingParams(n=6, temperature=1.0, max_new_tokens=12))
    a = TorchRolloutEngine(peaky_model).generate(prompts, params, torch.Generator().manual_seed(11))
    b = eng.generate(prompts, params, torch.Generator().manual_seed(11))
    eng.shutdown()
    stats = eng.last_stats
    assert eng.control.used == set(CYCLE) and 0 < sum(stats.accepted_by_pos) < sum(stats.drafted_by_pos)
    assert b.forwards < a.forwards  # drafts were accepted
    assert [r.completion_ids for r in a.rollouts] == [r.completion_ids for r in b.rollouts]
    for x, y in zip(a.rollouts, b.rollouts):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)


def test_sampled_tokens_follow_the_model_probabilities_under_the_controller(peaky_model):
    """1500 completions (T = 1.5, top_p = 0.9) with the draft length changing every forward: their
    first 4 tokens, jointly, against the model's own probabilities (model_probs: a full forward per
    prefix, apart from the engine's sampling code), goodness of fit at p = 0.001."""
    prompt = [Prompt("p0", [8, 9, 12, 15, 20], [])]
    params = SamplingParams(n=500, temperature=1.5, top_p=0.9, max_new_tokens=4)
    eng = controlled_engine(peaky_model, prompt, SamplingParams(n=30, temperature=1.5, top_p=0.9, max_new_tokens=4))
    g = torch.Generator().manual_seed(1)
    counts: dict = {}
    accepted = 0
    for _ in range(3):
        tally_prefixes(counts, eng.generate(prompt, params, g).rollouts, 4)
        accepted += sum(eng.last_stats.accepted_by_pos)
    eng.shutdown()
    assert eng.control.used == set(CYCLE) and accepted > 500  # drafting really happened, every arm
    exact = prefix_probs(peaky_model, prompt[0].ids, 4, 1.5, 0.9, min_p=1 / 1500)
    assert_fits(counts, exact, 1500, "first 4 tokens", min_df=10)
