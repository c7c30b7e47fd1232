"""The draft-length controller: it settles on the arm with the best measured rate, climbs to a
long draft where drafting pays, and spends few forwards on arms that do not; and the draft lengths
it chooses leave the sampled tokens, and so their distribution, as without drafting."""

import fcntl
import json
import random
from types import SimpleNamespace

import pytest
import torch
from chi_square import assert_fits, tally_prefixes
from model_probs import prefix_probs

from loomrl.platform.recipe import DrafterConfig, ModelConfig
from loomrl.platform.rollout import draft_control
from loomrl.platform.rollout.base import Prompt, SamplingParams
from loomrl.platform.rollout.draft_control import (
    CALIBRATION,
    EXPLORE_MAX,
    Choice,
    CostCache,
    CostModel,
    DraftController,
    arms,
)
from loomrl.platform.rollout.torch_engine import TorchRolloutEngine

ROWS = 100


def run(
    controller: DraftController, cost: CostModel, accept: float, forwards: int, noise: float = 0.05, seed: int = 0
) -> list[int]:
    """Drive the controller with a workload whose forwards cost what `cost` says of their work
    (times a random factor within +-noise: the clock), with 100 rows shrinking as a batch's do, and
    where each draft position is accepted with probability `accept` given its predecessor."""
    rng = random.Random(seed)
    chosen = []
    for f in range(forwards):
        k = controller.choose().k
        chosen.append(k)
        rows = ROWS - 8 * (f % 10)
        positions, lookups = rows * (1 + k), rows if k else 0
        seconds = cost.seconds(rows, positions, lookups) * (1 + noise * rng.uniform(-1, 1))
        controller.observe(seconds, rows, [round(rows * accept ** (p + 1)) for p in range(k)], 0, positions, lookups)
    return chosen


def best_arm(cost: CostModel, accept: float, rows: int = ROWS) -> int:
    """The draft length with the most committed tokens per second under `cost`."""
    gain = {k: sum(accept**p for p in range(k + 1)) for k in arms(8)}
    return max(gain, key=lambda k: gain[k] * rows / cost.seconds(rows, rows * (1 + k), rows if k else 0))


# extra positions nearly free (a memory-bound accelerator), lookups cheap
MEMORY_BOUND = CostModel(forward_s=0.2, row_s=0.002, position_s=0.0002, lookup_s=0.0003)
# the demo's tiny model on a CPU: lookups in Python cost as much as a row's forward
LOOKUP_BOUND = CostModel(forward_s=0.01, row_s=0.001, position_s=0.0004, lookup_s=0.002)
SCHEDULE = [0, 1, 0, 2, 0, 4, 0, 8]


def test_arms():
    assert arms(8) == [0, 1, 2, 4, 8] and arms(5) == [0, 1, 2, 4, 5] and arms(1) == [0, 1]


def test_calibrates_on_a_fixed_schedule_then_fits_the_cost_model():
    """The first forwards run plain every other forward and each drafting arm in turn between,
    whatever the clock says; then the fitted model is within a few % of the workload's."""
    for cost in (MEMORY_BOUND, LOOKUP_BOUND):
        c = DraftController(8)
        chosen = run(c, cost, 0.8, CALIBRATION)
        assert chosen == SCHEDULE * (CALIBRATION // len(SCHEDULE))
        assert c.model is not None and c.summary()["draft_calibrated"] == 1
        for rows, k in ((100, 0), (100, 8), (30, 2)):
            work = (rows, rows * (1 + k), rows if k else 0)
            assert c.model.seconds(*work) == pytest.approx(cost.seconds(*work), rel=0.05)
    late = DraftController(8)  # drafts land only from forward 40 on (no histories before)
    drafted, f = 0, 0
    while late.model is None:
        k = late.choose().k
        drafted += k > 0 and f >= 40
        late.observe(0.1, ROWS, [0] * k, 0, ROWS * (1 + k) if f >= 40 else ROWS, ROWS if k else 0)
        f += 1
    assert drafted == 8 and f == 40 + 16  # fitted at the 8th forward that scored drafts


def test_climbs_to_the_best_length_where_drafting_pays():
    c = DraftController(8)
    chosen = run(c, MEMORY_BOUND, 0.8, 300)
    best = best_arm(MEMORY_BOUND, 0.8)
    assert best == 8 and chosen[-200:].count(best) >= 190  # settled, a rare recheck of 4
    assert c.gain(4) == pytest.approx(1 + 0.8 + 0.64 + 0.51 + 0.41, abs=0.01)
    s = c.summary()
    assert s["draft_control_accept_pos0"] == pytest.approx(0.8, abs=0.01)
    assert s["draft_k_best"] == 8 and s["draft_k_gain"] == pytest.approx(c.gain(8))


@pytest.mark.parametrize("cost,accept", [(LOOKUP_BOUND, 0.05), (MEMORY_BOUND, 0.02)])
def test_drafting_that_does_not_pay_costs_at_most_one_forward_in_32_after_calibration(cost, accept):
    c = DraftController(8)
    chosen = run(c, cost, accept, 1000)[CALIBRATION:]
    assert best_arm(cost, accept) == best_arm(cost, accept, rows=ROWS - 72) == 0  # at every width of the batch
    assert sum(k > 0 for k in chosen) <= len(chosen) / 32
    assert sum(k > 0 for k in chosen[-500:]) <= 500 / EXPLORE_MAX + 1  # steady state: one in 256
    s = c.summary()
    assert s["draft_k_best"] == 0 and 0 < s["draft_k_mean"] < 0.1


def test_after_calibration_the_clock_is_not_read():
    """Two runs of one workload on clocks that disagree by up to 10x after calibration: the same
    draft lengths, forward by forward, and the same state (what makes seeded runs repeat)."""
    a, b = DraftController(8), DraftController(8)
    run(a, MEMORY_BOUND, 0.5, CALIBRATION)
    b.load_state_dict(a.state_dict())  # the same calibration (a resumed run, or one that fit alike)
    for accept in (0.5, 0.05, 0.8):
        assert run(a, MEMORY_BOUND, accept, 300, noise=0.0) == run(b, MEMORY_BOUND, accept, 300, noise=0.9, seed=1)
    assert a.state_dict() == b.state_dict()


def test_two_calibrations_on_noisy_clocks_choose_alike():
    a, b = DraftController(8), DraftController(8)
    assert run(a, LOOKUP_BOUND, 0.3, 600, seed=1) == run(b, LOOKUP_BOUND, 0.3, 600, seed=2)
    assert a.model != b.model  # fitted on their own clocks


def test_follows_a_workload_that_changes():
    """Drafting does not pay at first (no history yet), then it does: the controller finds out
    on a recheck and moves."""
    c = DraftController(8)
    run(c, MEMORY_BOUND, 0.02, 200)
    later = run(c, MEMORY_BOUND, 0.8, 400)  # a recheck within 256 forwards
    assert later[-50:].count(8) >= 45


def test_state_round_trip():
    for forwards in (10, 50):  # calibrating, and calibrated
        a = DraftController(8)
        run(a, MEMORY_BOUND, 0.5, forwards)
        b = DraftController(8)
        b.load_state_dict(a.state_dict())
        assert b.state_dict() == a.state_dict()
        assert run(a, MEMORY_BOUND, 0.5, 60, seed=3) == run(b, MEMORY_BOUND, 0.5, 60, seed=3)
    old = a.state_dict()
    del old["cost_model"], old["calibration"]  # a checkpoint from before the cost model: calibrate afresh
    c = DraftController(8)
    c.load_state_dict(old)
    assert c.model is None and c.forwards == 0


def calibrated(rows: int) -> DraftController:
    c = DraftController(8)
    for _ in range(CALIBRATION):
        k = c.choose().k
        work = (rows, rows * (1 + k), rows * (k > 0))
        c.observe(MEMORY_BOUND.seconds(*work), rows, [rows] * k, 0, *work[1:])
    return c


def test_a_tried_arm_runs_until_it_has_seen_16_rows():
    """A batch of 4 rows: one forward says little (4 rows that all rejected is no rarity), so a
    rechecked arm keeps going for 4 forwards before it is judged."""
    c = calibrated(4)
    chosen = []
    for _ in range(60):
        k = c.choose().k
        chosen.append(k)
        work = (4, 4 * (1 + k), 4 if k else 0)
        c.observe(MEMORY_BOUND.seconds(*work), 4, [round(4 * 0.8 ** (p + 1)) for p in range(k)], 0, *work[1:])
    best = c.arms[c.best].k
    probes = "".join("b" if k == best else "p" for k in chosen).split("b")
    assert any(probes) and all(len(p) % 4 == 0 for p in probes)


def test_state_round_trip_in_the_middle_of_a_check():
    a = calibrated(4)
    while a._probing is None:  # up to the first recheck, then two of its four forwards
        k = a.choose().k
        a.observe(MEMORY_BOUND.seconds(4, 4 * (1 + k), 4 * (k > 0)), 4, [4] * k, 0, 4 * (1 + k), 4 * (k > 0))
    probe = a.arms[a._probing].k
    for _ in range(2):  # the recheck's second and third forwards
        k = a.choose().k
        a.observe(MEMORY_BOUND.seconds(4, 4 * (1 + k), 4 * (k > 0)), 4, [4] * k, 0, 4 * (1 + k), 4 * (k > 0))
    b = DraftController(8)
    b.load_state_dict(a.state_dict())
    assert b.choose().k == a.choose().k == probe and b.state_dict() == a.state_dict()


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


def test_a_row_drafts_from_every_token_it_has_after_plain_forwards(peaky_model, monkeypatch):
    """Plain forwards (k = 0) do not index their tokens into the rows' drafter states; when a row
    drafts again, its state holds the prompt and every token committed so far (caught up), with
    the controller changing the draft length every forward, k = 0 included."""
    prompts = [Prompt(f"p{i}", [8 + i, 9, 12 + 2 * i, 15, 20 + i], []) for i in range(4)]
    params = SamplingParams(n=6, temperature=1.0, max_new_tokens=12)
    eng = controlled_engine(peaky_model, prompts, params)
    propose_all = TorchRolloutEngine._propose_all
    checked = []

    def checking(self, d, prompts, params, arm, ready, stats):
        out = propose_all(self, d, prompts, params, arm, ready, stats)
        for i in out:
            assert d.states[i].tokens == prompts[d.rows[i][0]].ids + d.tokens[i], f"row {i}: stale drafter state"
            checked.append(len(d.tokens[i]))
        return out

    monkeypatch.setattr(TorchRolloutEngine, "_propose_all", checking)
    eng.generate(prompts, params, torch.Generator().manual_seed(5))
    eng.shutdown()
    assert Choice(0) in eng.control.used and max(checked) > 2  # rows drafted after plain forwards


def test_the_first_fit_of_a_workload_is_adopted_by_later_runs(tmp_path, monkeypatch):
    """The machine's cache keeps the first fit per workload; a second controller of that workload,
    calibrated on another clock, adopts it at the end of the same schedule; another workload fits
    its own; a damaged cache is moved aside and started again, an entry that is not a cost model
    (negative, not finite, booleans) is fitted again, and a cache that cannot be written or locked
    leaves the run its own fit."""
    path = tmp_path / "draft_cost.json"
    a = DraftController(8, cache=CostCache("w1", path))
    b = DraftController(8, cache=CostCache("w1", path))
    other = DraftController(8, cache=CostCache("w2", path))
    run(a, LOOKUP_BOUND, 0.3, CALIBRATION, seed=1)
    run(b, LOOKUP_BOUND, 0.3, CALIBRATION, seed=2)
    run(other, LOOKUP_BOUND, 0.3, CALIBRATION, seed=2)
    assert a.model == b.model != other.model
    assert set(json.loads(path.read_text())) == {"w1", "w2"}
    path.write_text("{not json")
    c = DraftController(8, cache=CostCache("w1", path))
    run(c, LOOKUP_BOUND, 0.3, CALIBRATION, seed=3)
    assert c.model != a.model and list(json.loads(path.read_text())) == ["w1"]
    assert path.with_suffix(".damaged").read_text() == "{not json"  # kept for a look, not lost
    for bad in ([1.0, -1.0, 0.0, 0.0], [1.0, float("nan"), 0.0, 0.0], [True, 0.0, 0.0, 0.0], [1.0, 0.0]):
        path.write_text(json.dumps({"w1": bad}))
        e = DraftController(8, cache=CostCache("w1", path))
        run(e, LOOKUP_BOUND, 0.3, CALIBRATION, seed=3)
        assert e.model == c.model and json.loads(path.read_text())["w1"] == list(c.model), bad
    monkeypatch.setattr(draft_control, "LOCK_WAIT_S", 0.2)
    with open(path.with_suffix(".lock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process holds the lock and never lets go
        f = DraftController(8, cache=CostCache("w2", path))
        run(f, LOOKUP_BOUND, 0.3, CALIBRATION, seed=5)
    assert f.model is not None and f.model != other.model and "w2" not in json.loads(path.read_text())
    blocked = tmp_path / "file"
    blocked.write_text("")
    d = DraftController(8, cache=CostCache("w1", blocked / "draft_cost.json"))  # its folder is a file
    run(d, LOOKUP_BOUND, 0.3, CALIBRATION, seed=4)
    assert d.model is not None and d.model != a.model


def test_a_fit_on_forwards_of_one_row_count_is_not_split_by_float_order():
    """Every calibration forward with the same rows: the constant and rows columns are collinear, so
    any split of the per-forward cost between them fits. The fit takes the constant alone (the
    subset tried first), whatever the last bits of the timings, and costs those forwards right."""
    from loomrl.platform.rollout.draft_control import Work, fit_cost

    def fit(eps):
        work = [
            Work(0, i, 64, 64 + 64 * (i % 2), 64 * (i % 2), 64, 0.010 + 0.002 * (i % 2) + eps * (i % 3))
            for i in range(32)
        ]
        return fit_cost(work)

    a, b = fit(0.0), fit(1e-15)
    assert a.row_s == b.row_s == 0.0 and a.forward_s > 0
    assert abs(a.seconds(64, 64, 0) - 0.010) < 1e-9 and abs(a.forward_s - b.forward_s) < 1e-12


def test_the_runs_first_forward_does_not_enter_the_fit():
    """The run's first forward also pays one-time costs (allocations, kernel choices): 50x slower
    here, and the fit is the same as without it."""
    fits = []
    for first in (1.0, 50.0):
        c = DraftController(8)
        for f in range(CALIBRATION):
            k = c.choose().k
            positions, lookups = ROWS * (1 + k), ROWS if k else 0
            seconds = LOOKUP_BOUND.seconds(ROWS - f, positions, lookups) * (first if f == 0 else 1.0)
            c.observe(seconds, ROWS - f, [0] * k, 0, positions, lookups)
        fits.append(c.model)
    assert fits[0] == pytest.approx(fits[1], rel=1e-9)


def test_vllm_proposer_counts_each_plain_step_as_a_python_loop_would():
    """The vLLM proposer's plain steps count their rows and tokens with C-level passes
    (`_account_plain`, `_rows`); the controller must see what a plain loop over the rows counts:
    rows of loomrl's batch that decoded at the last step (a prompt chunk, with no sampled token,
    is not one; another batch's or a foreign request is not one), and their sampled tokens now.
    Stretches where rows only leave and all decode take the proposer's shortcut (every row counts)."""
    from loomrl.platform.rollout.vllm_proposer import NgramRLProposer, request_id

    class Recorder:
        def __init__(self):
            self.seen = []

        def choose(self):
            return Choice(0)

        def observe(self, seconds, rows, accepted, tokens, positions, lookups):
            self.seen.append((rows, tokens, positions, lookups))

    p = NgramRLProposer.__new__(NgramRLProposer)  # (__init__ wants vLLM's config)
    p.k, p.drafter, p.control, p.batch, p.prompts, p.states, p.caps, p._step = 4, None, Recorder(), 3, [], {}, {}, None
    p._zeros, p._empty = [0] * 4, []
    rng = random.Random(0)
    pool = [request_id(3, i // 4, i % 4) for i in range(40)] + [request_id(2, 0, 0), "foreign-7"]
    running: list[str] = []
    before: dict[str, int] = {}
    want = []
    usual = 0  # steps where rows only left and every row decoded (the proposer's shortcut)
    for step in range(120):
        if step % 12 < 6:  # rows join (some of them ones that left before), prompt chunks, foreign rows
            running = [r for r in running if rng.random() > 0.1] + rng.sample([r for r in pool if r not in running], 3)
            rng.shuffle(running)
            sampled = [[] if rng.random() < 0.15 else [rng.randrange(50)] for _ in running]
        else:  # the usual stretch: loomrl's rows decode, some finish, the rest move into their places
            running = [r for r in running if r in before and rng.random() > 0.2]
            running = running[::-1] if step % 2 else running
            sampled = [[] if rng.random() < 0.01 else [rng.randrange(50)] for _ in running]  # (rarely, none)
            usual += step % 12 > 6 and [] not in sampled
        p.runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=running))
        if step:  # the last step's rows, counted now (plain Python)
            counted = [len(s) for r, s in zip(running, sampled) if r in before]
            if counted:
                want.append((len(counted), sum(counted), len(counted), 0))
        before = {r: 0 for r, s in zip(running, sampled) if s and (r in before or r.startswith("lrl:3:"))}
        assert p.propose(sampled, None, None) == [[] for _ in running]
    assert p.control.seen == want and len(want) > 100 and usual > 40


def test_vllm_runs_of_one_model_share_a_cost_model_whatever_its_folder():
    """loomrl serves each run's policy to vLLM from a new temporary folder: the cost cache's key must
    not contain it (two runs of one seed adopt one fit, so they choose the same draft lengths), and
    must still tell models of another shape apart."""
    from transformers import Qwen2Config

    from loomrl.platform.rollout.vllm_proposer import workload

    def config(folder: str, hidden: int = 64):
        hf = Qwen2Config(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        hf._name_or_path = folder
        model = SimpleNamespace(
            model=folder, hf_config=hf, hf_text_config=hf, dtype=torch.float32, get_hidden_size=lambda: hidden
        )
        return SimpleNamespace(
            model_config=model,
            device_config=SimpleNamespace(device_type="cpu"),
            speculative_config=SimpleNamespace(num_speculative_tokens=8),
        )

    a, b = workload(config("/tmp/loomrl-vllm-a1b2")), workload(config("/tmp/loomrl-vllm-c3d4"))
    assert a == b and "loomrl-vllm" not in a
    assert workload(config("/tmp/loomrl-vllm-a1b2", hidden=128)) != a
