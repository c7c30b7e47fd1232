"""DPO (`algorithm.name: dpo`, algorithms/dpo.py): the losses and their gradients against values
computed by hand (sigmoid, conservative label smoothing, IPO; equal log-probs; saturated margins),
the micro-batch loss the engines run, pairs in micro-batches, preference pairs in manifests and
shards (`bad-pair` rejected and counted, never an exception), and the recipe's refusals. The runs
(learning on held-out pairs, exact resume, export, engines) are in tests/test_dpo_run.py."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from loomrl.cli import main
from loomrl.config import RecipeError
from loomrl.datasets.manifest import Entry, Rejection, parse_line
from loomrl.datasets.preference import pair_census, pair_problem
from loomrl.datasets.shards import read_shards, write_shards
from loomrl.datasets.source import PromptSource
from loomrl.datasets.stream import ShardStream
from loomrl.platform import recipe as R
from loomrl.platform.algorithms import ALGORITHMS
from loomrl.platform.algorithms.config import DPOConfig
from loomrl.platform.algorithms.dpo import dpo_loss, dpo_loss_fn
from loomrl.platform.dpo_steps import PreferenceSteps
from loomrl.platform.parts import check_pairs

DEMO = "recipes/demo.yaml"
DPO = ["algorithm.name=dpo", "training.warmup.steps=0", "goal=null"]


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def run_loss(pi_c, pi_r, ref_c, ref_r, beta, **kw):
    """dpo_loss on one pair; (loss, d loss / d pi_chosen, d loss / d pi_rejected, rewards)."""
    pc = torch.tensor([pi_c], dtype=torch.float64, requires_grad=True)
    pr = torch.tensor([pi_r], dtype=torch.float64, requires_grad=True)
    losses, chosen, rejected = dpo_loss(
        pc, pr, torch.tensor([ref_c], dtype=torch.float64), torch.tensor([ref_r], dtype=torch.float64), beta, **kw
    )
    losses.sum().backward()
    return float(losses.detach()), float(pc.grad), float(pr.grad), (float(chosen), float(rejected))


# ----------------------------------------------------------------------------- the losses by hand


def test_sigmoid_loss_and_gradient_by_hand():
    # pi: log pi(y_c) = -1, log pi(y_r) = -2; ref: -1.5 both; beta 0.5
    # h = (-1 - -2) - (-1.5 - -1.5) = 1, beta h = 0.5
    # L = -log sigmoid(0.5) = log(1 + e^-0.5) = 0.4740769841801067
    # dL/dpi_c = -beta (1 - sigmoid(0.5)) = -0.5 x 0.3775406687981454 = -0.1887703343990727; dL/dpi_r = +that
    # rewards: 0.5 (-1 + 1.5) = 0.25 and 0.5 (-2 + 1.5) = -0.25
    loss, gc, gr, rewards = run_loss(-1.0, -2.0, -1.5, -1.5, 0.5)
    assert loss == pytest.approx(0.4740769841801067, abs=1e-12)
    assert gc == pytest.approx(-0.1887703343990727, abs=1e-12) and gr == pytest.approx(0.1887703343990727, abs=1e-12)
    assert rewards == pytest.approx((0.25, -0.25), abs=1e-12)
    assert loss == pytest.approx(-math.log(sigmoid(0.5)), abs=1e-12)


def test_the_reference_enters_with_its_sign():
    # same policy, the reference now prefers the chosen answer by 2: h = 1 - 2 = -1, beta h = -0.5
    # L = log(1 + e^0.5) = 0.9740769841801067; dL/dpi_c = -0.5 (1 - sigmoid(-0.5)) = -0.3112296656009273
    loss, gc, gr, rewards = run_loss(-1.0, -2.0, -1.0, -3.0, 0.5)
    assert loss == pytest.approx(0.9740769841801067, abs=1e-12)
    assert gc == pytest.approx(-0.3112296656009273, abs=1e-12) and gr == pytest.approx(-gc, abs=1e-15)
    assert rewards == pytest.approx((0.0, 0.5), abs=1e-12)  # 0.5 (-1 + 1), 0.5 (-2 + 3): the margin is -0.5


def test_label_smoothing_by_hand():
    # h = 1, beta 0.5, eps 0.2: L = -0.8 log sigmoid(0.5) - 0.2 log sigmoid(-0.5)
    #   = 0.8 x 0.4740769841801067 + 0.2 x 0.9740769841801067 = 0.5740769841801067
    # dL/dh = beta (sigmoid(beta h) - (1 - eps)) = 0.5 (0.6224593312018546 - 0.8) = -0.0887703343990727
    loss, gc, gr, _ = run_loss(-1.0, -2.0, -1.5, -1.5, 0.5, label_smoothing=0.2)
    assert loss == pytest.approx(0.5740769841801067, abs=1e-12)
    assert gc == pytest.approx(-0.0887703343990727, abs=1e-12) and gr == pytest.approx(0.0887703343990727, abs=1e-12)


def test_ipo_by_hand():
    # h = (0 - -3) - (0 - 0) = 3, beta 0.5: target 1 / (2 beta) = 1, L = (3 - 1)^2 = 4, dL/dh = 2 (3 - 1) = 4
    loss, gc, gr, _ = run_loss(0.0, -3.0, 0.0, 0.0, 0.5, loss="ipo")
    assert (loss, gc, gr) == pytest.approx((4.0, 4.0, -4.0), abs=1e-12)
    # at its target margin (h = 1) IPO's loss and gradient are 0: it does not push the margin further
    loss, gc, gr, _ = run_loss(0.0, -1.0, 0.0, 0.0, 0.5, loss="ipo")
    assert (loss, gc, gr) == pytest.approx((0.0, 0.0, 0.0), abs=1e-12)


def test_equal_log_probs_give_log_2_and_half_the_slope():
    # chosen and rejected equally likely under both: h = 0, L = -log sigmoid(0) = log 2,
    # dL/dpi_c = -beta (1 - 1/2) = -beta / 2 (beta 0.1: -0.05), dL/dpi_r = +0.05; rewards 0
    loss, gc, gr, rewards = run_loss(-4.0, -4.0, -3.0, -3.0, 0.1)
    assert loss == pytest.approx(math.log(2), abs=1e-12)
    assert (gc, gr) == pytest.approx((-0.05, 0.05), abs=1e-12)
    assert rewards == pytest.approx((-0.1, -0.1), abs=1e-12)  # 0.1 (-4 + 3) each: equal, margin 0
    # smoothing keeps log 2 (both terms are log 2) and scales the slope: beta (1/2 - (1 - eps)) = 0.1 x -0.3
    loss, gc, _, _ = run_loss(-4.0, -4.0, -3.0, -3.0, 0.1, label_smoothing=0.2)
    assert loss == pytest.approx(math.log(2), abs=1e-12) and gc == pytest.approx(-0.03, abs=1e-12)
    # IPO at h = 0: (0 - 5)^2 = 25, dL/dpi_c = 2 (0 - 5) = -10
    loss, gc, gr, _ = run_loss(-4.0, -4.0, -3.0, -3.0, 0.1, loss="ipo")
    assert (loss, gc, gr) == pytest.approx((25.0, -10.0, 10.0), abs=1e-12)


def test_saturated_margins_stay_finite():
    # beta h = +-500: the loss is ~0 (gradient ~0) or ~500 (gradient -beta on pi_c), never inf or nan
    loss, gc, _, _ = run_loss(0.0, -1000.0, 0.0, 0.0, 0.5)
    assert loss == pytest.approx(0.0, abs=1e-12) and gc == pytest.approx(0.0, abs=1e-12)
    loss, gc, gr, _ = run_loss(-1000.0, 0.0, 0.0, 0.0, 0.5)
    assert loss == pytest.approx(500.0, rel=1e-12) and (gc, gr) == pytest.approx((-0.5, 0.5), abs=1e-12)
    with pytest.raises(ValueError, match="algorithm.dpo.loss"):
        run_loss(0.0, 0.0, 0.0, 0.0, 0.5, loss="hinge")


# ----------------------------------------------------------------------------- the micro-batch loss


class FixedLogprobs(torch.nn.Module):
    """A 'policy' whose per-token log-probs are a parameter (so the gradient is readable)."""

    def __init__(self, logp: torch.Tensor):
        super().__init__()
        self.logp = torch.nn.Parameter(logp.clone())

    def sequence_logprobs(self, input_ids, attention_mask, media):
        return self.logp, torch.zeros_like(self.logp)


def micro_batch(rows: slice, logp_ref: torch.Tensor, mask: torch.Tensor, pairs: int):
    return SimpleNamespace(
        input_ids=None, attention_mask=None, media=None, loss_mask=mask[rows], ref_logp=logp_ref[rows], sequences=pairs
    )


def test_the_engines_loss_is_the_mean_over_the_mini_batchs_pairs():
    """Two pairs in two micro-batches (rows: chosen then rejected): each micro-batch's loss is its
    pair's over the mini-batch's 2 pairs, so they add up to the mean; only answer tokens count."""
    # per-token log-probs [rows, positions]; mask: the answer positions (padding and prompt are 0)
    logp = torch.tensor([[-9.0, -0.5, -0.5], [-9.0, -1.0, -2.0], [-9.0, -1.0, 0.0], [-9.0, -1.0, -1.0]])
    mask = torch.tensor([[0.0, 1, 1], [0, 1, 1], [0, 1, 0], [0, 1, 1]])
    ref = torch.tensor([[5.0, -1.0, -1.0], [5.0, -1.0, -1.0], [5.0, -0.5, 7.0], [5.0, -0.5, -0.5]])
    # micro-batch 1 = pair 1: chosen row 0 (pi -1, ref -2), rejected row 1 (pi -3, ref -2): h = 2 - 0 = 2
    # micro-batch 2 = pair 2: chosen row 2 (pi -1, ref -0.5), rejected row 3 (pi -2, ref -1): h = 1 - 0.5 = 0.5
    fn = dpo_loss_fn(DPOConfig(beta=1.0))
    totals, grads = 0.0, []
    for rows in (slice(0, 2), slice(2, 4)):
        model = FixedLogprobs(logp[rows])
        loss, stats = fn(model, micro_batch(rows, ref, mask, pairs=2))
        loss.backward()
        totals += float(loss.detach())
        grads.append(model.logp.grad)
        assert stats["pairs"] == 1 and stats["tokens"] == float(mask[rows].sum())
    want = (math.log1p(math.exp(-2.0)) + math.log1p(math.exp(-0.5))) / 2
    assert totals == pytest.approx(want, abs=1e-6)
    # the gradient reaches every answer token of the chosen row with -(1 - sigmoid(h)) / 2 and no other position
    g1 = -(1 - sigmoid(2.0)) / 2
    assert torch.allclose(grads[0], torch.tensor([[0.0, g1, g1], [0.0, -g1, -g1]]), atol=1e-7, rtol=0)
    g2 = -(1 - sigmoid(0.5)) / 2
    assert torch.allclose(grads[1], torch.tensor([[0.0, g2, 0.0], [0.0, -g2, -g2]]), atol=1e-7, rtol=0)


def test_the_loss_needs_the_reference():
    mb = SimpleNamespace(input_ids=None, attention_mask=None, media=None, loss_mask=torch.ones(2, 2), ref_logp=None)
    with pytest.raises(ValueError, match="reference's log-probs"):
        dpo_loss_fn(DPOConfig())(FixedLogprobs(torch.zeros(2, 2)), mb)


def test_registered_as_a_preference_algorithm():
    entry = ALGORITHMS.get("dpo")
    assert entry.obj is dpo_loss_fn
    assert entry.trait("supervised") and entry.trait("preference") and entry.trait("advantages") is None


# ----------------------------------------------------------------------------- pairs in micro-batches


def test_pair_batches_put_whole_pairs_chosen_first(model, tokenizer, samples):
    pairs = [
        SimpleNamespace(id=s.id, ids=s.ids, media=s.media, record={"chosen": f"a {c} shape", "rejected": "blue"})
        for s, c in zip(samples[:5], ["red", "green", "red", "blue", "green"])
    ]
    steps = PreferenceSteps()
    steps.model, steps.tokenizer = model, tokenizer
    steps.recipe = SimpleNamespace(training=SimpleNamespace(micro_batch_size=2))
    mbs = steps.pair_batches(pairs)
    assert [len(mb.trajectories) for mb in mbs] == [4, 4, 2]  # 2 + 2 + 1 pairs
    for mb, chunk in zip(mbs, [pairs[0:2], pairs[2:4], pairs[4:5]]):
        k = len(chunk)
        assert [t.prompt_id for t in mb.trajectories] == [s.id for s in chunk] * 2
        for i, (t, s) in enumerate(zip(mb.trajectories, chunk + chunk)):
            side = "chosen" if i < k else "rejected"
            assert t.prompt_ids == s.ids
            assert t.completion_ids[:-1] == tokenizer(s.record[side], add_special_tokens=False)["input_ids"]
        assert all(t.completion_ids[-1] == model.eos_token_id for t in mb.trajectories)  # ended by the stop token
        assert mb.sequences == 5  # the loss divides by the step's pairs
        assert mb.loss_mask.sum() == sum(len(t.completion_ids) for t in mb.trajectories)


# ----------------------------------------------------------------------------- pairs in the data


def test_pair_problems():
    assert pair_problem("a cat", "a dog") is None
    assert "no 'rejected'" in pair_problem("a cat", None)
    assert "no 'chosen'" in pair_problem(None, "a dog")
    assert "'chosen' is empty" in pair_problem("  ", "a dog")
    assert "'rejected' must be a string, got int" in pair_problem("a cat", 3)
    assert "the same answer" in pair_problem("a cat", " a cat ")


@pytest.mark.parametrize(
    "line, why",
    [
        ({"prompt": "q", "chosen": "a"}, "no 'rejected'"),
        ({"prompt": "q", "rejected": "b"}, "no 'chosen'"),
        ({"prompt": "q", "chosen": "", "rejected": "b"}, "'chosen' is empty"),
        ({"prompt": "q", "chosen": "a", "rejected": "a"}, "the same answer"),
        ({"prompt": "q", "chosen": ["a"], "rejected": "b"}, "must be a string"),
    ],
)
def test_a_bad_pair_is_a_rejection(line, why, tmp_path):
    got = parse_line(json.dumps({"id": "x", **line}).encode(), "m.jsonl:1", str(tmp_path))
    assert isinstance(got, Rejection) and got.code == "bad-pair" and why in got.reason and got.id == "x"


def test_a_good_pair_and_a_plain_line(tmp_path):
    got = parse_line(b'{"id": "x", "prompt": "q", "chosen": "a", "rejected": "b", "extra": 1}', "m:1", str(tmp_path))
    assert isinstance(got, Entry) and got.pair == ("a", "b") and got.meta == {"extra": 1}  # not in meta
    plain = parse_line(b'{"id": "y", "prompt": "q", "answer": "a"}', "m:2", str(tmp_path))
    assert isinstance(plain, Entry) and plain.pair is None


def test_shards_make_counts_bad_pairs_and_stores_the_good_ones(tmp_path, capsys):
    lines = [
        {"id": "good", "prompt": "what is it ?", "chosen": "a cat", "rejected": "a dog"},
        {"id": "half", "prompt": "what is it ?", "chosen": "a cat"},
        {"id": "same", "prompt": "what is it ?", "chosen": "a cat", "rejected": "a cat"},
        {"id": "plain", "prompt": "what is it ?", "answer": "a cat"},
    ]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    code = main(["shards", "make", str(tmp_path / "pairs.jsonl"), "--out", str(tmp_path / "s" / "p-%06d.tar")])
    assert code == 0  # bad lines are rejections, not a failure
    said = capsys.readouterr()
    assert "rejected 2: 2 bad-pair" in said.out + said.err
    rejected = [json.loads(x) for x in (tmp_path / "s" / "p-rejected.jsonl").read_text().splitlines()]
    assert sorted((r["id"], r["code"]) for r in rejected) == [("half", "bad-pair"), ("same", "bad-pair")]
    files = sorted(str(p) for p in (tmp_path / "s").glob("*.tar"))
    got = {s["id"]: s for s in read_shards(files)}
    assert (got["good"]["chosen"], got["good"]["rejected"]) == ("a cat", "a dog")
    assert "chosen" not in got["plain"] and "chosen" not in got["good"]["meta"]
    census = pair_census(files)
    assert (census.samples, census.pairs) == (2, 1) and "plain" in census.first_bad


def _shards(tmp_path, samples: list[dict]) -> list[str]:
    return write_shards([{"meta": {}, **s} for s in samples], str(tmp_path / "d-%06d.tar"), maxcount=10)


def test_a_run_skips_and_counts_samples_without_a_pair(tmp_path, model, tokenizer, loomrl_log):
    files = _shards(
        tmp_path,
        [
            {"id": "p1", "prompt": "describe the picture .", "chosen": "a", "rejected": "b"},
            {"id": "no-pair", "prompt": "describe the sound .", "answer": "a"},
            {"id": "p2", "prompt": "describe the sound .", "chosen": "c", "rejected": "d", "answer": "c d"},
            {"id": "bad", "prompt": "describe the sound .", "chosen": "c", "rejected": 7},  # hand-made: checked again
        ],
    )
    source = PromptSource(ShardStream(files, shuffle_buffer=0, epochs=1), model, tokenizer, R.ModelConfig())
    source.require_pair = True
    got = source.take(10)
    assert [s.id for s in got] == ["p1", "p2"]
    assert got[0].record["answer"] == "a" and got[1].record["answer"] == "c d"  # rewards read the chosen answer
    assert (got[0].record["chosen"], got[0].record["rejected"]) == ("a", "b")
    assert [why.split(":")[0] for _, why in source.skipped] == ["bad-pair", "bad-pair"]
    assert source.state()["skipped"] == 2
    assert "bad-pair: no 'chosen' answer" in loomrl_log.text and "bad-pair: field 'rejected'" in loomrl_log.text


# ----------------------------------------------------------------------------- the recipe


def test_recipe_keys_and_their_refusals():
    r = R.load_recipe(DEMO, DPO, files=False)
    assert (r.algorithm.dpo.beta, r.algorithm.dpo.label_smoothing, r.algorithm.dpo.loss) == (0.1, 0.0, "sigmoid")
    for override, match in [
        ("algorithm.dpo.beta=0", r"algorithm.dpo.beta: .*> 0"),
        ("algorithm.dpo.label_smoothing=0.5", r"algorithm.dpo.label_smoothing: must be in \[0, 0.5\)"),
        ("algorithm.dpo.loss=hinge", r"algorithm.dpo.loss: 'hinge' is not allowed"),
        ("algorithm.kl_coef=0.1", r"algorithm.kl_coef: the KL penalty is an RL term"),
        ("pipeline.mode=disaggregated", r"pipeline.mode: algorithm.name=dpo has no rollouts"),
    ]:
        with pytest.raises(RecipeError, match=match):
            R.load_recipe(DEMO, [*DPO, override], files=False)
    with pytest.raises(RecipeError, match=r"algorithm.dpo.label_smoothing: 0.1 smooths the sigmoid loss"):
        R.load_recipe(DEMO, [*DPO, "algorithm.dpo.loss=ipo", "algorithm.dpo.label_smoothing=0.1"], files=False)
    with pytest.raises(RecipeError, match=r"training.warmup.steps: algorithm.name=dpo"):
        R.load_recipe(DEMO, ["algorithm.name=dpo"], files=False)  # the demo's warm-up


def test_dry_run_refuses_shards_without_pairs(tmp_path, demo_shards, capsys):
    d, files = demo_shards
    recipe = R.load_recipe(DEMO, [*DPO, f"data.shards={d}/*.tar"])
    with pytest.raises(RecipeError, match=r"data.shards: none of the 24 samples of 3 shard\(s\) .* holds a preference"):
        check_pairs(recipe)
    code = main(["run", DEMO, *DPO, f"data.shards={d}/*.tar", "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and "data.shards: none of the 24 samples" in err and "'chosen' and 'rejected'" in err
    assert "Traceback" not in err
    # pairs in some samples: a note that the others will be skipped; validation.shards is checked the same way
    pairs = _shards(tmp_path, [{"id": "p", "prompt": "q", "chosen": "a", "rejected": "b"}, {"id": "n", "prompt": "q"}])
    recipe = R.load_recipe(DEMO, [*DPO, f"data.shards={tmp_path}/d-*.tar"])
    assert check_pairs(recipe) == [
        f"data.shards: 1 of 2 samples hold no preference pair and will be skipped (bad-pair; first: {pairs[0]}:n: "
        "no 'chosen' answer (a preference pair needs both 'chosen' and 'rejected'))"
    ]
    recipe = R.load_recipe(DEMO, [*DPO, f"data.shards={tmp_path}/d-*.tar", f"validation.shards={d}/*.tar"])
    with pytest.raises(RecipeError, match=r"validation.shards: none of the 24 samples"):
        check_pairs(recipe)
    assert check_pairs(R.load_recipe(DEMO, [f"data.shards={d}/*.tar"])) == []  # GRPO reads no pairs
