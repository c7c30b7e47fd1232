"""The draft-length controller: it settles on the arm with the best measured rate, climbs to a
long draft where drafting pays, and spends few forwards on arms that do not."""
import pytest

from loomrl.platform.rollout.draft_control import EXPLORE_MAX, DraftController, arms


def run(controller: DraftController, rate_of, forwards: int) -> list[int]:
    """Drive the controller with a workload whose rate (tokens/s) per draft length is rate_of(k)."""
    chosen = []
    for _ in range(forwards):
        k = controller.choose()
        chosen.append(k)
        controller.observe(int(rate_of(k)), 1.0)
    return chosen


def test_arms():
    assert arms(8) == [0, 1, 2, 4, 8] and arms(5) == [0, 1, 2, 4, 5] and arms(1) == [0, 1]


def test_climbs_to_the_best_length_where_drafting_pays():
    rates = {0: 100, 1: 150, 2: 190, 4: 230, 8: 210}  # memory-bound: extra positions nearly free
    chosen = run(DraftController(8), rates.get, 300)
    assert chosen[:5] == [0, 1, 2, 4, 8]  # each unmeasured neighbour tried at once
    assert chosen[-200:].count(4) >= 190  # settled on k = 4, a rare recheck of 2 and 8


@pytest.mark.parametrize("slowdown", [1.2, 3.0])
def test_drafting_that_does_not_pay_costs_at_most_one_forward_in_32(slowdown):
    rates = {0: 100, 1: 100 / slowdown, 2: 90 / slowdown, 4: 80 / slowdown, 8: 70 / slowdown}
    c = DraftController(8)
    chosen = run(c, rates.get, 1000)
    drafted = sum(k > 0 for k in chosen)
    assert set(chosen) == {0, 1}  # k = 1 lost, so longer drafts are never tried
    assert drafted <= 1000 / 32
    assert sum(k > 0 for k in chosen[-500:]) <= 500 / EXPLORE_MAX + 1  # steady state: one in 256
    s = c.summary()
    assert s["draft_k_best"] == 0 and s["draft_k0_row_tokens_per_s"] == pytest.approx(100) and 0 < s["draft_k_mean"] < 0.1


def test_follows_a_workload_that_changes():
    """Drafting does not pay at first (no history yet), then it does: the controller finds out
    on a recheck and moves."""
    c = DraftController(8)
    run(c, {0: 100, 1: 60, 2: 50, 4: 40, 8: 30}.get, 200)
    later = run(c, {0: 100, 1: 150, 2: 200, 4: 260, 8: 240}.get, 400)  # a recheck within 256 forwards
    assert later[-50:].count(4) >= 45


def test_state_round_trip():
    a = DraftController(8)
    run(a, {0: 100, 1: 150, 2: 90, 4: 80, 8: 70}.get, 50)
    b = DraftController(8)
    b.load_state_dict(a.state_dict())
    assert [b.choose() for _ in range(1)] == [a.choose()] and b.state_dict() == a.state_dict()
