import pytest
import yaml

from loomrl.cli import main
from loomrl.platform.recipe import Recipe, RecipeError, field_docs, load_recipe

DEMO = "recipes/demo.yaml"


def write(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


def test_demo_recipe_loads_with_overrides():
    r = load_recipe(DEMO, ["training.steps=3", "rollout.temperature=0.7", "training.warmup.target=answer"])
    assert isinstance(r, Recipe)
    assert r.training.steps == 3 and r.rollout.temperature == 0.7
    assert r.training.warmup.target == "answer"
    assert r.data.demo is not None and r.data.demo.samples == 768


@pytest.mark.parametrize(
    "text, expected",
    [
        ("training: {stepz: 3}", "training.stepz: unknown key; allowed keys here: engine, steps"),
        ("rollout: {n: eight}", "rollout.n: expected an integer, got 'eight'"),
        ("rollout: {temperature: true}", "rollout.temperature: expected a number"),
        ("rollout: {engine: magic}", "rollout.engine: 'magic' is not allowed; allowed values: 'torch'"),
        (
            "training: {warmup: {target: both}}",
            "training.warmup.target: 'both' is not allowed; allowed values: 'answer', 'format'",
        ),
        ("model: 3", "model: expected a mapping"),
        ("algorithm: {reward: no_such_reward}", "algorithm.reward: 'no_such_reward' is neither a registered reward"),
        ("algorithm: {reward: 'os.path:nope'}", "algorithm.reward: cannot load 'os.path:nope'"),
        ("data: {shards: /nonexistent/x-*.tar, demo: null}", "data.shards: no files match '/nonexistent/x-*.tar'"),
        ("rollout: {n: 1}", "rollout.n: GRPO needs at least 2"),
        ("rollout: {drafter: {k: 0}}", "rollout.drafter.k: must be >= 1, got 0"),
        ("rollout: {drafter: {prefetch_budget: -1}}", "rollout.drafter.prefetch_budget: must be >= 0"),
        ("- a\n- b", "the top level must be a mapping"),
    ],
)
def test_bad_recipes_name_the_key(tmp_path, text, expected):
    with pytest.raises(RecipeError) as e:
        load_recipe(write(tmp_path, text))
    assert expected in str(e.value)


def test_override_errors():
    with pytest.raises(RecipeError, match="expected key.path=value"):
        load_recipe(DEMO, ["training.steps"])
    with pytest.raises(RecipeError, match="training.steps: expected an integer, got 'x'"):
        load_recipe(DEMO, ["training.steps=x"])
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe("no/such.yaml")


@pytest.mark.parametrize(
    "override, needle",
    [
        ("training.bogus=1", "training.bogus"),
        ("training.lr=fast", "training.lr"),
        ("data.demo=null", "data.shards"),
    ],
)
def test_cli_broken_recipe_exits_nonzero_and_writes_nothing(tmp_path, capsys, monkeypatch, override, needle):
    monkeypatch.chdir(tmp_path)  # nothing may appear here, demo shards included
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "demo.yaml").write_text(open(f"{__file__.rsplit('/tests/', 1)[0]}/{DEMO}").read())
    out = tmp_path / "out"
    assert main(["run", "recipes/demo.yaml", override, "--out", str(out)]) == 2
    assert needle in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipes"]


def test_dry_run_prints_resolved_recipe(capsys):
    assert main(["run", DEMO, "--dry-run", "training.steps=7"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["training"]["steps"] == 7
    assert resolved["rollout"]["n"] == 8


def test_every_field_is_documented():
    rows = field_docs()
    undocumented = [key for key, _, _, doc in rows if not doc]
    assert len(rows) > 40 and undocumented == []


def test_lr_warmup_ramps_linearly_then_holds():
    from loomrl.platform.recipe import TrainingConfig
    from loomrl.platform.trainer import rl_lr

    cfg = TrainingConfig(lr=1e-3, lr_warmup_steps=4)
    assert [rl_lr(cfg, s) for s in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert rl_lr(TrainingConfig(lr=1e-3), 0) == 1e-3
    with pytest.raises(RecipeError, match="training.lr_warmup_steps"):
        load_recipe(DEMO, ["training.lr_warmup_steps=-1"])


def test_cosine_schedule_decays_after_the_warm_up_to_the_floor_at_the_last_step():
    from loomrl.platform.recipe import TrainingConfig
    from loomrl.platform.trainer import rl_lr, scheduled

    cfg = TrainingConfig(lr=1e-3, steps=12, lr_warmup_steps=2, lr_schedule="cosine", lr_min_ratio=0.1)
    lrs = [rl_lr(cfg, s) for s in range(12)]
    assert lrs[:3] == pytest.approx([5e-4, 1e-3, 1e-3])  # warm-up, then the cosine starts at lr
    assert lrs[-1] == pytest.approx(1e-4) and rl_lr(cfg, 50) == pytest.approx(1e-4)  # the floor
    assert lrs[2 + 9 // 2] < 1e-3 and all(a > b for a, b in zip(lrs[2:], lrs[3:]))  # strictly decreasing
    # halfway through the decay the cosine is at the midpoint of lr and the floor
    assert rl_lr(TrainingConfig(lr=1.0, steps=11, lr_schedule="cosine", lr_min_ratio=0.0), 5) == pytest.approx(0.5)
    assert scheduled(cfg) and not scheduled(TrainingConfig())
    with pytest.raises(RecipeError, match="training.lr_min_ratio"):
        load_recipe(DEMO, ["training.lr_min_ratio=1.5"])


def alias_bomb(levels: int, width: int = 9) -> str:
    """A YAML 'billion laughs': each level is a list of `width` aliases of the one below."""
    rows = ["  - &l0 [" + ", ".join(["lol"] * width) + "]"]
    rows += [f"  - &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "data:\n shards:\n" + "\n".join(" " + r for r in rows) + "\n"


@pytest.mark.parametrize("levels", [6, 9])
def test_yaml_alias_bombs_are_refused_quickly(tmp_path, levels):
    import time

    t0 = time.perf_counter()
    with pytest.raises(RecipeError, match="alias") as e:
        load_recipe(write(tmp_path, alias_bomb(levels)), files=False)
    assert time.perf_counter() - t0 < 2 and len(str(e.value)) < 300
    with pytest.raises(RecipeError, match="alias"):  # and in an override
        load_recipe(
            DEMO,
            [
                "rollout.n=[&a [1, 1, 1, 1, 1, 1, 1, 1], &b [*a, *a, *a, *a, *a, *a, *a, *a], "
                "&c [*b, *b, *b, *b, *b, *b, *b, *b], &d [*c, *c, *c, *c, *c, *c, *c, *c], "
                "&e [*d, *d, *d, *d, *d, *d, *d, *d], [*e, *e, *e, *e, *e, *e, *e, *e]]"
            ],
            files=False,
        )
    with pytest.raises(RecipeError, match="refers to itself"):
        load_recipe(write(tmp_path, "algorithm: {rewards: &a [*a]}"), files=False)
    r = load_recipe(write(tmp_path, "training: {steps: &s 4}\nrollout: {n: *s}\n"), files=False)  # plain aliases
    assert r.training.steps == r.rollout.n == 4


def test_values_quoted_in_messages_are_capped(tmp_path):
    with pytest.raises(RecipeError) as e:
        load_recipe(write(tmp_path, "rollout: {n: '" + "x" * 100_000 + "'}"), files=False)
    assert str(e.value).startswith("rollout.n: expected an integer, got 'xxx") and len(str(e.value)) < 300
    with pytest.raises(RecipeError) as e:
        load_recipe(DEMO, ["training.steps=[" + ", ".join(["123456789"] * 1000) + "]"], files=False)
    assert str(e.value).startswith("training.steps: expected an integer, got [123456789") and len(str(e.value)) < 300


def test_numbers_in_exponent_form_without_a_dot_are_numbers():
    """YAML 1.1 reads `5e-4` as a string; a float key takes it as the number it is."""
    r = load_recipe(DEMO, ["training.lr=5e-4", "training.weight_decay=1E-2"])
    assert r.training.lr == 5e-4 and r.training.weight_decay == 0.01
    with pytest.raises(RecipeError, match="training.lr: expected a number, got 'fast'"):
        load_recipe(DEMO, ["training.lr=fast"])
    with pytest.raises(RecipeError, match="training.steps: expected an integer"):
        load_recipe(DEMO, ["training.steps=1e3"])  # an integer key still wants an integer
