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


@pytest.mark.parametrize("text, expected", [
    ("training: {stepz: 3}", "training.stepz: unknown key; allowed keys here: engine, steps"),
    ("rollout: {n: eight}", "rollout.n: expected an integer, got 'eight'"),
    ("rollout: {temperature: true}", "rollout.temperature: expected a number"),
    ("rollout: {engine: magic}", "rollout.engine: 'magic' is not allowed; allowed values: 'torch'"),
    ("training: {warmup: {target: both}}", "training.warmup.target: 'both' is not allowed; allowed values: 'answer', 'format'"),
    ("model: 3", "model: expected a mapping"),
    ("algorithm: {reward: no_such_reward}", "algorithm.reward: 'no_such_reward' is neither a registered reward"),
    ("algorithm: {reward: 'os.path:nope'}", "algorithm.reward: cannot load 'os.path:nope'"),
    ("data: {shards: /nonexistent/x-*.tar, demo: null}", "data.shards: no files match '/nonexistent/x-*.tar'"),
    ("rollout: {n: 1}", "rollout.n: GRPO needs at least 2"),
    ("rollout: {drafter: {k: 0}}", "rollout.drafter.k: must be >= 1, got 0"),
    ("rollout: {drafter: {prefetch_budget: -1}}", "rollout.drafter.prefetch_budget: must be >= 0"),
    ("- a\n- b", "the top level must be a mapping"),
])
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


@pytest.mark.parametrize("override, needle", [
    ("training.bogus=1", "training.bogus"),
    ("training.lr=fast", "training.lr"),
    ("data.demo=null", "data.shards"),
])
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
