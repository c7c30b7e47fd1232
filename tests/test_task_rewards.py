"""Task rewards (loomrl/platform/rewards/tasks.py) against hand-computed cases: each reads the
final answer as documented, returns a float in [0, 1], never raises on a completion (garbage,
huge numbers, unbalanced braces, 1 MB of text), and raises ValueError naming the sample when
the sample lacks its answer. Then the recipe side: parametrised rewards, bad patterns and
URLs refused naming the key, and `module:function` found beside the recipe file."""

import re
import time

import pytest

from loomrl.platform.recipe import AlgorithmConfig, RecipeError, RewardSourceConfig, load_recipe
from loomrl.platform.rewards import REWARDS, build_reward
from loomrl.platform.rewards.sources import build_sources
from loomrl.platform.rewards.tasks import choice, exact, iou, math, numeric, regex


def S(answer, sid="s1"):
    return {"id": sid, "prompt": "q", "answer": answer, "meta": {}}


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("The Eiffel Tower!", "eiffel tower", 1.0),  # case, punctuation, article
        ("  an   apple. ", "Apple", 1.0),
        ("apples", "apple", 0.0),
        ("I think <answer>Paris</answer> is right", "paris", 1.0),
        ("so \\boxed{\\text{Paris}}", "Paris", 1.0),
        ("<answer>Lyon</answer> or Paris", "Paris", 0.0),  # the marked answer, not the whole text
        ("<answer>\\boxed{Rome}</answer>", "rome", 1.0),
        ("", "paris", 0.0),
    ],
)
def test_exact(completion, answer, expected):
    assert exact(completion, S(answer)) == expected


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("so there are 1,234 apples", "1234", 1.0),
        ("\\boxed{-3.5} (check: 7)", "-3.5", 1.0),  # boxed wins over the last number
        ("It is 3/4.", "0.75", 1.0),
        ("\\frac{3}{4}", "0.75", 1.0),
        ("12%", "0.12", 1.0),  # a percentage: 12 or 0.12
        ("12%", "12", 1.0),
        ("0.1201", "0.12", 0.0),  # relative error 8e-4 > 1e-4
        ("100.005", "100", 1.0),  # 5e-5 <= 1e-4
        ("5-3 leaves 2", "2", 1.0),
        ("x = -7", "-7", 1.0),
        ("The answer is #### 72", "Natalia sold 48/2 = 24 clips in May. #### 72", 1.0),  # GSM8K-style answer
        ("no number here", "4", 0.0),
        ("1e999999", "1", 0.0),  # infinite: no number
        ("9" * 100000, "1", 0.0),  # a 100000-digit integer: no number
        ("1/0", "1", 0.0),
    ],
)
def test_numeric(completion, answer, expected):
    assert numeric(completion, S(answer)) == expected


def test_numeric_tolerance_is_a_parameter():
    loose = build_reward("numeric", RewardSourceConfig(fn="numeric", tolerance=0.01))
    assert loose("0.1201", S("0.12")) == 1.0 and numeric("0.1201", S("0.12")) == 0.0
    strict = build_reward("numeric", RewardSourceConfig(fn="numeric", tolerance=0.0))
    assert strict("100.005", S("100")) == 0.0 and strict("100", S("100.0")) == 1.0


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("B", "B", 1.0),
        ("(b)", "(B) Paris", 1.0),
        ("The answer is C.", "C", 1.0),
        ("Answer: D) blue", "(D) blue", 1.0),
        ("B) is wrong. The answer is (a).", "A", 1.0),  # the stated answer, not the leading letter
        ("(B) Paris", "B", 1.0),
        ("<answer>E</answer>", "E", 1.0),
        ("\\boxed{J}", "J", 1.0),
        ("the answer is a dog", "A", 0.0),  # a lower-case article is no choice
        ("I think so", "B", 0.0),  # a capital I is no choice
        ("K", "B", 0.0),  # letters A-J only
        ("C", "B", 0.0),
        ("", "B", 0.0),
    ],
)
def test_choice(completion, answer, expected):
    assert choice(completion, S(answer)) == expected


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac12}", "1/2", 1.0),
        ("\\boxed{2x+x}", "3x", 1.0),
        ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
        ("\\boxed{(x+1)^2}", "x^2+1", 0.0),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
        ("\\boxed{\\sqrt{x^2}}", "x", 0.0),  # not equal for negative x
        ("\\boxed{x^{1/2}}", "\\sqrt{x}", 1.0),
        ("\\boxed{2\\pi r}", "2 r \\pi", 1.0),
        ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),
        ("so x = 4", "4", 1.0),  # no box: the last number
        ("\\boxed{x=4}", "4", 1.0),
        ("\\boxed{\\text{(1, 2)}}", "(1,2)", 1.0),  # string equality after normalisation
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}", 1.0),
        ("\\boxed{\\sin x}", "\\cos x", 0.0),  # unread commands: strings differ
        ("\\boxed{abc}", "cab", 0.0),  # a word, not a product of variables
        ("\\boxed{\\frac{1}{2}", "0.5", 1.0),  # unclosed box: the last number, 1/2
        ("\\boxed{3+\\frac{1}{2}", "3.5", 0.0),
        ("\\boxed{1/0}", "1", 0.0),
        ("\\boxed{0^{-1}}", "0^{-1}", 1.0),  # unreadable, yet the same string
        ("\\boxed{((((2x)^{64})^{64})^{64})^{64}}", "1", 0.0),  # too large to convert: no hang
    ],
)
def test_math(completion, answer, expected):
    assert math(completion, S(answer)) == expected


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("[0, 0, 10, 10]", "[0, 0, 10, 5]", 0.5),  # 50 / 100
        ("<|box_start|>(0,0),(10,10)<|box_end|>", "[5, 5, 15, 15]", 25 / 175),
        ('[{"bbox_2d": [0, 0, 4, 4], "label": "cat"}]', "(2,0),(6,4)", 8 / 24),
        ("first [0,0,2,2] then [0,0,4,4]", "[0,0,2,2]", 1.0),  # the first box
        ("[0,0,2,2]", [0, 0, 2, 2], 1.0),  # the answer as a list
        ("[20,20,30,30]", "[0,0,10,10]", 0.0),  # disjoint
        ("[5,5,1,1]", "[0,0,10,10]", 0.0),  # x2 < x1: degenerate
        ("[0,0,0,10]", "[0,0,10,10]", 0.0),  # zero width
        ("[-5,0,5,10]", "[0,0,10,10]", 0.0),  # a negative coordinate
        ("no box", "[0,0,10,10]", 0.0),
        ("[1e999, 0, 1, 1]", "[0,0,10,10]", 0.0),
    ],
)
def test_iou(completion, answer, expected):
    assert iou(completion, S(answer)) == pytest.approx(expected, abs=1e-12)


def test_regex_format_reward():
    fmt = build_reward("regex", RewardSourceConfig(fn="regex", pattern=r"<think>.*</think>\s*<answer>.*</answer>"))
    assert fmt("  <think>a\nb</think>\n<answer>4</answer>\n", {"id": 1}) == 1.0  # DOTALL, stripped, no answer needed
    assert fmt("<think>a</think> 4", {"id": 1}) == 0.0
    assert fmt("<think>a</think><answer>4</answer> trailing", {"id": 1}) == 0.0  # a full match
    assert regex("x" * 10, {}, pattern="x+") == 1.0
    assert regex("x" * 2_000_000, {}, pattern="x+") == 0.0  # over the cap: not checked
    with pytest.raises(ValueError, match="needs `pattern`"):
        build_reward("regex")
    with pytest.raises(ValueError, match="does not compile"):
        build_reward("regex", RewardSourceConfig(fn="regex", pattern="(unclosed"))


GARBAGE = [
    "",
    " ",
    "\x00\ud800\uffff",
    "}{" * 50,
    "\\boxed{" * 1000,
    "\\boxed{{{{",
    "<answer>" * 1000,
    "</answer><answer>",
    "1e999999",
    "-1e999999 % / 0",
    "9" * 100_000,
    "1," * 50_000,
    "[1,2,3," * 1000,
    "(((((((((",
    "^^^^^{}",
    "\\frac{\\frac{\\frac{",
    "Answer: " * 1000,
    "\\sqrt[99999]{2}",
    "\\boxed{" + "(" * 100 + "x" + ")" * 100 + "}",
    "x" * 1_000_000,
    "a\n" * 500_000,
]


def test_no_completion_raises_and_every_reward_stays_in_range():
    samples = {"exact": S("paris"), "numeric": S("3"), "choice": S("B"), "math": S("x^2+1"), "iou": S("[0,0,10,10]")}
    t0 = time.perf_counter()
    for name, sample in samples.items():
        fn = REWARDS.get(name).obj
        for c in GARBAGE:
            v = fn(c, sample)
            assert isinstance(v, float) and 0.0 <= v <= 1.0, (name, c[:30])
    assert time.perf_counter() - t0 < 10  # bounded work on ~20 MB of garbage


def test_a_1mb_completion_is_capped_yet_its_final_answer_is_read():
    tail = " ... so the answer is \\boxed{42}"
    big = "blah " * 200_000 + tail
    assert len(big) > 1_000_000
    t0 = time.perf_counter()
    assert math(big, S("42")) == 1.0 and numeric(big, S("42")) == 1.0
    assert exact(big, S("42")) == 1.0
    assert exact("word " * 200_000, S("word " * 200_000)) == 0.0  # no final answer, over the cap
    assert time.perf_counter() - t0 < 2


@pytest.mark.parametrize("name", ["exact", "numeric", "choice", "math", "iou"])
def test_a_sample_without_an_answer_is_an_error_naming_it(name):
    fn = REWARDS.get(name).obj
    for sample in ({"id": "img-0042", "prompt": "q", "meta": {}}, S(None, "img-0042"), S("  ", "img-0042")):
        with pytest.raises(ValueError, match=f"reward '{name}': sample 'img-0042' has no answer"):
            fn("anything", sample)


@pytest.mark.parametrize(
    "name, answer, needle",
    [
        ("numeric", "many", "has no (finite) number"),
        ("choice", "Paris", "names no letter A-J"),
        ("iou", "[10, 10, 0, 0]", "is no valid box"),
        ("iou", "somewhere", "is no valid box"),
    ],
)
def test_an_unusable_answer_is_an_error_naming_the_sample(name, answer, needle):
    with pytest.raises(ValueError, match=f"sample 'q7'.*{re.escape(needle)}"):
        REWARDS.get(name).obj("B [0,0,1,1] 3", S(answer, "q7"))


# --------------------------------------------------------------------------- recipe


def _recipe(folder, text):
    p = folder / "r.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    "rewards, needle",
    [
        (
            "[{fn: regex, pattern: '(unclosed'}]",
            "algorithm.rewards[0].pattern: '(unclosed' is not a valid regular expression",
        ),
        ("[{fn: exact}, {fn: regex}]", "algorithm.rewards[1].pattern: fn: regex needs a pattern"),
        ("[{fn: exact, pattern: 'x'}]", "algorithm.rewards[0].pattern: only the regex reward takes a pattern"),
        ("[{url: 'ftp://host/score'}]", "algorithm.rewards[0].url: 'ftp://host/score': only http:// and https://"),
        ("[{url: 'http://'}]", "algorithm.rewards[0].url: 'http://' has no host"),
        ("[{url: 'http://h:99999/'}]", "algorithm.rewards[0].url: 'http://h:99999/' is not a valid URL"),
        ("[{url: 'http://h/', fn: exact}]", "algorithm.rewards[0]: set exactly one of fn"),
        ("[{url: 'http://h/', timeout_s: 0}]", "algorithm.rewards[0].timeout_s: must be > 0"),
        ("[{url: 'http://h/', retries: -1}]", "algorithm.rewards[0].retries: must be >= 0"),
        ("[{fn: numeric, tolerance: -0.1}]", "algorithm.rewards[0].tolerance: must be >= 0"),
    ],
)
def test_bad_reward_sources_name_the_key(tmp_path, rewards, needle):
    with pytest.raises(RecipeError) as e:
        load_recipe(_recipe(tmp_path, f"algorithm: {{rewards: {rewards}}}"), files=False)
    assert needle in str(e.value)


def test_regex_as_the_single_reward_needs_a_pattern(tmp_path):
    with pytest.raises(RecipeError, match=r"algorithm.reward: the 'regex' reward needs `pattern`"):
        load_recipe(_recipe(tmp_path, "algorithm: {reward: regex}"), files=False)


def test_every_unparametrised_name_works_as_the_single_reward(tmp_path):
    for name in ("exact", "numeric", "choice", "math", "iou", "exact_match", "slot_match"):
        r = load_recipe(_recipe(tmp_path, f"algorithm: {{reward: {name}}}"), files=False)
        (source,) = build_sources(r.algorithm)
        assert source.name == name and source.weight == 1.0
    (source,) = build_sources(AlgorithmConfig(reward="numeric"))
    assert source.score(["1,000", "999"], [S("1000"), S("1000")]) == [1.0, 0.0]


def test_parametrised_sources_are_built_with_their_parameters(tmp_path):
    r = load_recipe(
        _recipe(
            tmp_path,
            """
algorithm:
  rewards:
    - {fn: numeric, tolerance: 0.01, weight: 2.0}
    - {fn: regex, name: format, pattern: '\\d+', weight: 0.5}
    - {url: 'https://rewards.example.org:8443/score', timeout_s: 2.5, retries: 0}
""",
        ),
        files=False,
    )
    a, b, c = build_sources(r.algorithm)
    assert (a.name, b.name, c.name) == ("numeric", "format", "rewards.example.org")
    assert a.score(["0.1201", "0.2"], [S("0.12"), S("0.12")]) == [1.0, 0.0]
    assert b.score(["123", "12a"], [{}, {}]) == [1.0, 0.0]
    assert (c.model.url, c.model.timeout_s, c.model.retries) == ("https://rewards.example.org:8443/score", 2.5, 0)


def test_module_function_beside_the_recipe_from_any_folder(tmp_path, monkeypatch):
    import sys

    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "loomrl_test_beside_mod.py").write_text(
        "def shout(completion, sample):\n    return float(completion.isupper())\n"
    )
    recipe = _recipe(folder, "algorithm: {rewards: [{fn: 'loomrl_test_beside_mod:shout', weight: 1.0}]}")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the folder appended is undone after the test
    r = load_recipe(recipe, files=False)
    (source,) = build_sources(r.algorithm)  # later, as the trainer does: the module is importable now
    assert source.name == "shout" and source.score(["YES", "no"], [{}, {}]) == [1.0, 0.0]
    # the single `reward` spelling too, with a relative recipe path
    monkeypatch.chdir(tmp_path)
    r = load_recipe(
        _recipe(folder, "algorithm: {reward: 'loomrl_test_beside_mod:shout'}").relative_to(tmp_path), files=False
    )
    assert build_sources(r.algorithm)[0].score(["OK"], [{}]) == [1.0]


def test_a_missing_module_gives_the_hint(tmp_path, monkeypatch):
    import sys

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(RecipeError) as e:
        load_recipe(_recipe(tmp_path, "algorithm: {rewards: [{fn: 'loomrl_test_no_such_mod:fn'}]}"), files=False)
    msg = str(e.value)
    assert msg.startswith("algorithm.rewards[0].fn: cannot load 'loomrl_test_no_such_mod:fn'")
    assert "no module named 'loomrl_test_no_such_mod'" in msg
    assert "put loomrl_test_no_such_mod.py beside the recipe" in msg and "or on PYTHONPATH" in msg
    # a module beside the recipe that imports something missing: that error, not the hint
    (tmp_path / "loomrl_test_broken_mod.py").write_text("import loomrl_test_absent_dep\n")
    with pytest.raises(RecipeError, match="No module named 'loomrl_test_absent_dep'"):
        load_recipe(_recipe(tmp_path, "algorithm: {reward: 'loomrl_test_broken_mod:fn'}"), files=False)
