"""The draft-length controller: it settles on the arm with the best measured rate, climbs to a
long draft where drafting pays, and spends few forwards on arms that do not."""
import pytest

from loomrl.platform.rollout.draft_control import EXPLORE_MAX, DraftController, arms

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
    assert s["draft_control_accept_pos0"] == pytest.approx(0.8) and s["draft_control_accept_pos1"] == pytest.approx(0.64)
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
    assert s["draft_k_best"] == 0 and s["draft_k0_row_tokens_per_s"] == pytest.approx(100) and 0 < s["draft_k_mean"] < 0.1


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
