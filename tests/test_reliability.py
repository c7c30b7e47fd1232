"""Issue 17, items 9, 11 and 15, and the recipe half of its fuzz test: numeric recipe fields
have ranges checked at load; a corrupt checkpoint, metrics file or run folder is a clear
message naming the file (exit 2), never a traceback; resume picks only `step-NNNNNN`
checkpoints, survives a metrics line cut by a kill and refuses a state it cannot trust."""

import dataclasses
import hashlib
import json
import logging
import os
import random
import shlex
import shutil
import time
import typing
from pathlib import Path

import pytest
import torch

from loomrl.cli import main
from loomrl.platform import recipe as R
from loomrl.platform.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from loomrl.platform.metrics import read_metrics
from loomrl.platform.recipe import RecipeError, load_recipe

ROOT = Path(__file__).resolve().parent.parent
DEMO = str(ROOT / "recipes" / "demo.yaml")


@pytest.fixture(autouse=True)
def no_stale_log_streams():
    """`loomrl.cli.main` sets up the `loomrl` logger once, on the streams of its first call (an
    earlier test's capture, closed since): set those aside, so a log call here cannot print a
    logging error. Tests read the log with the `loomrl_log` fixture."""
    logger = logging.getLogger("loomrl")
    stale = [h for h in logger.handlers if type(h) is logging.StreamHandler]
    for h in stale:
        logger.removeHandler(h)
    yield
    for h in stale:
        logger.addHandler(h)


# --------------------------------------------------------------------------- item 9: ranges


@pytest.mark.parametrize(
    "override, needle",
    [
        ("training.lr=.nan", "training.lr: must be a finite number > 0, got nan"),
        ("training.lr=-1", "training.lr: must be > 0, got -1.0"),
        ("training.lr=.inf", "training.lr: must be a finite number > 0, got inf"),
        ("training.lr=" + "9" * 400, "training.lr: must be a finite number > 0, got 999"),
        ("rollout.temperature=.nan", "rollout.temperature: must be a finite number > 0, got nan"),
        ("rollout.top_p=.nan", "rollout.top_p: must be a finite number in (0, 1], got nan"),
        ("model.vision.patch_size=0", "model.vision.patch_size: must be >= 1, got 0"),
        ("checkpoint.every=-1", "checkpoint.every: must be >= 0, got -1"),
        ("data.shuffle_buffer=-5", "data.shuffle_buffer: must be >= 0, got -5"),
        ("training.warmup.lr=-.inf", "training.warmup.lr: must be a finite number > 0, got -inf"),
        ("goal.min_final=.nan", "goal.min_final: must be a finite number, got nan"),
        ("algorithm.rewards=[{fn: slot_match, weight: .inf}]", "algorithm.rewards[0].weight: must be a finite number"),
        ("training.seed=-1", "training.seed: must be in [0, 2147483647], got -1"),
        ("training.steps=" + "9" * 30, "training.steps: must be >= 0 and below 2**63, got 999"),
        ("training.deepspeed.zero_stage=4", "training.deepspeed.zero_stage: must be in [0, 3], got 4"),
        ("algorithm.ppo.gamma=1.5", "algorithm.ppo.gamma: must be in [0, 1], got 1.5"),
        ("pipeline.max_staleness=-2", "pipeline.max_staleness: must be >= -1, got -2"),
    ],
)
def test_numeric_values_outside_their_range_are_refused_at_load(override, needle, capsys):
    with pytest.raises(RecipeError) as e:
        load_recipe(DEMO, [override], files=False)
    assert needle in str(e.value) and len(str(e.value)) < 300
    assert main(["run", DEMO, "--dry-run", override]) == 2  # --dry-run refuses it too
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize(
    "override, needle",
    [
        ("model.vision.embed_dim=24", "model.vision.num_heads"),  # head size 6: the 2-D rotary needs a multiple of 4
        ("model.audio.d_model=63", "model.audio.num_heads"),
        ("model.hidden_size=18", "model.num_heads"),  # head size 9 (2 heads): RoPE needs an even one
        ("model.audio.clip_seconds=0.01", "model.audio.clip_seconds"),  # no audio token at all
        ("model.vision.min_pixels=10000", "model.vision.min_pixels"),  # above max_pixels
        ("data.shards='x-{a'", "data.shards"),  # unbalanced braces: a traceback at the first read
        ("data.shards='x-{0..999999999}.tar'", "data.shards"),  # a billion patterns to glob
        ("algorithm.reward='..:x'", "algorithm.reward"),  # TypeError from importlib
        ("algorithm.reward=':x'", "algorithm.reward"),  # ValueError from importlib
        ("training.steps=" + "9" * 5000, "training.steps"),  # int() refuses > 4300 digits
    ],
)
def test_values_that_passed_load_and_failed_later_are_refused(override, needle):
    t0 = time.perf_counter()
    with pytest.raises(RecipeError) as e:
        load_recipe(DEMO, [override], files=False)
    assert str(e.value).startswith(needle) or f"override {needle}" in str(e.value), str(e.value)
    assert time.perf_counter() - t0 < 5


def _numeric_fields(cls=R.Recipe, prefix=""):
    """(key path, field, type) of every int/float field, through nested sections."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        inner = [a for a in args if dataclasses.is_dataclass(a)]
        if inner:
            yield from _numeric_fields(inner[0], f"{prefix}{f.name}{'[0]' if typing.get_origin(tp) is list else ''}.")
        elif args[0] in (int, float):
            yield f"{prefix}{f.name}", f, args[0]


def _override(key: str, value: str) -> str:
    if key.startswith("algorithm.rewards[0]."):  # a field of a list item: give a whole valid item
        return f"algorithm.rewards=[{{fn: slot_match, {key.rsplit('.', 1)[1]}: {value}}}]"
    return f"{key}={value}"


def test_every_numeric_field_has_a_range_its_default_is_in_and_outside_is_refused():
    fields = list(_numeric_fields())
    assert len(fields) > 60
    for key, f, tp in fields:
        rng = f.metadata.get("range")
        assert isinstance(rng, R.Range), f"{key}: no range declared (use recipe.ranged)"
        listed = f.default is dataclasses.MISSING  # a list of numbers (model.vision.image_mean): each item
        defaults = f.default_factory() if listed else [f.default]
        assert all(d is None or rng.contains(d) for d in defaults), f"{key}: default {defaults} outside {rng}"
        outside = [".nan", ".inf", "-.inf"] if tp is float else ["1.5", str(2**63)]
        if rng.low is not None:
            outside.append(repr(rng.low - 1) if tp is int or not rng.low_open else repr(rng.low))
        if rng.high is not None:
            outside.append(repr(rng.high + 1) if tp is int or not rng.high_open else repr(rng.high))
        for value in outside:
            with pytest.raises(RecipeError) as e:
                load_recipe(DEMO, [_override(key, f"[0.5, {value}, 0.5]" if listed else value)], files=False)
            assert str(e.value).startswith(key + ("[1]:" if listed else ":")), (key, value, str(e.value))


def test_recipe_reference_shows_the_ranges(capsys):
    docs = {key: tp for key, tp, _, _ in R.field_docs()}
    assert docs["training.lr"] == "float > 0"
    assert docs["rollout.top_p"] == "float in (0, 1]"
    assert docs["model.vision.patch_size"] == "int >= 1"
    assert docs["algorithm.ppo.critic_lr"] == "float > 0 or null"
    assert docs["goal.min_final"] == "float"  # any finite number
    assert main(["recipe"]) == 0
    assert "| `checkpoint.every` | int >= 0 | `0` |" in capsys.readouterr().out


# --------------------------------------------------------------------------- recipe fuzz


TYPES = {key: tp for key, tp, *_ in R.field_docs()}
KEYS = list(TYPES)
INTS = [
    "0",
    "1",
    "2",
    "3",
    "4",
    "8",
    "-1",
    "-2",
    "64",
    "1000",
    "65536",
    str(2**31),
    str(2**63),
    "9" * 25,
    "-" + "9" * 25,
    "9" * 5000,
    "0x" + "f" * 5000,
    "0o777",
    "1_000",
]
NUMBERS = INTS + [".nan", "-.nan", ".inf", "-.inf", "-0.0", "0.5", "1.5", "3.5", "1.0e-300", "1.0e308", "1.0e999"]
LITERALS = [
    "null",
    "~",
    "true",
    "false",
    "''",
    "'nan'",
    "[]",
    "{}",
    "[1, 2]",
    "{a: 1}",
    "[[[[[1]]]]]",
    "{fn: slot_match, weight: .nan}",
    "[{fn: slot_match, weight: .inf}]",
    "[{model: Zq, fn: Zq}]",
    "2001-01-01",
    "2001-02-31",
    "!!binary aGVsbG8=",
    "!!python/object/apply:os.system [echo pwned]",
    "*undefined",
    "&a [*a]",
    "'{0..99999999999}'",
    "'{a'",
    "'x-{0..3}.tar'",
    "'..:Zq'",
    "':Zq'",
    "'Zq:Zq'",
    "torch",
    "vllm",
    "grpo",
    "ppo",
    "disaggregated",
    "deepspeed",
    "megatron",
    "{steps: .nan}",
    "[" + ", ".join(["1"] * 200) + "]",
    '"\\u2603"',
    "'a: b'",
    "{? [1]: 2}",
    "[1, {b: [2, .inf]}]",
    "'" + "x" * 5000 + "'",
    "'" + "{" * 2000 + "}" * 2000 + "'",
]


def random_value(rng: random.Random, key: str) -> str:
    """Half the time a value of the field's own type (numbers at and past their edges), else any."""
    tp = TYPES.get(key, "")
    if rng.random() < 0.5:
        if tp.startswith("int"):
            return rng.choice(INTS)
        if tp.startswith("float"):
            return rng.choice(NUMBERS)
        if "|" in tp:
            return rng.choice([x.strip() for x in tp.split("|")] + ["Zq"])
        if tp.startswith("bool"):
            return rng.choice(["true", "false"])
    roll = rng.random()
    if roll < 0.4:
        return rng.choice(NUMBERS)
    if roll < 0.75:
        return rng.choice(LITERALS)
    if roll < 0.85:  # nested garbage
        return "{" + ", ".join(f"Zq{i}: [{rng.choice(NUMBERS)}, {rng.choice(LITERALS)}]" for i in range(3)) + "}"
    alphabet = "Zq09 ._-/{}[]:,*&!%@#|>'\"\\\u00e9\u2603"
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12)))


def random_override(rng: random.Random) -> str:
    key = rng.choice(KEYS)
    roll = rng.random()
    if roll < 0.1:
        key = key.rsplit(".", 1)[0]  # a whole section
    elif roll < 0.15:
        key += ".Zq"  # below a value
    elif roll < 0.2:
        key = rng.choice(["", ".", "..", "Zq", "training..lr", " training.lr", "training.lr "])
    return f"{key}={random_value(rng, key)}"


def _error_names_a_key(message: str, overrides: list[str]) -> bool:
    """The message starts with a key path of the recipe (list indices dropped), of an override, or
    (an unknown key) one below them."""
    import re

    head = message.split(":", 1)[0].removeprefix("override ").strip()
    head = re.sub(r"\[\d+\]", "", head)
    known = set(KEYS) | {o.split("=", 1)[0].strip() for o in overrides}
    known |= {k.rsplit(".", i)[0] for k in list(known) for i in range(1, k.count(".") + 1)}
    unknown = "unknown key" in message and any(head.startswith(k + ".") for k in known)  # inside a mapping value
    return head in known or unknown or message.startswith("override ")


def test_fuzz_recipe_overrides_only_clean_refusals(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a dry run writes nothing; nothing may appear in the repo either
    rng = random.Random(17)
    t0 = time.perf_counter()
    loaded = refused = 0
    for i in range(600):
        overrides = [random_override(rng) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
        if rng.random() < 0.2:  # also plausible values, to get past the first refusal
            overrides.append(
                rng.choice(
                    [
                        "rollout.n=4",
                        "training.prompts_per_step=4",
                        "rollout.engine=vllm",
                        "algorithm.name=ppo",
                        "data.demo=null",
                        "goal=null",
                    ]
                )
            )
        try:
            load_recipe(DEMO, overrides, files=False)
            loaded += 1
        except RecipeError as e:
            refused += 1
            assert _error_names_a_key(str(e), overrides), (overrides, str(e))
            assert len(str(e)) < 1000, (overrides, str(e)[:300])
        if i % 4 == 0:
            code = main(["run", DEMO, "--dry-run", *overrides])
            err = capsys.readouterr().err
            assert code in (0, 2), (overrides, code, err[-500:])
            if code == 2:
                assert err.startswith(f"error: recipe {DEMO}: ")
                assert _error_names_a_key(err.removeprefix(f"error: recipe {DEMO}: "), overrides), (overrides, err)
    assert loaded > 50 and refused > 300, (loaded, refused)
    assert time.perf_counter() - t0 < 30
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- item 11: checkpoints


def _rewrite_manifest(ckpt: Path) -> None:
    """What someone 'repairing' a checkpoint does: the manifest vouches for the files as they are."""
    files = sorted(p.name for p in ckpt.iterdir() if p.name != "manifest.json")
    (ckpt / "manifest.json").write_text(
        json.dumps({n: hashlib.sha256((ckpt / n).read_bytes()).hexdigest() for n in files})
    )


@pytest.fixture()
def ckpt(tmp_path, model):
    from loomrl.platform.engines.torch_engine import TorchTrainEngine
    from loomrl.platform.recipe import TrainingConfig

    engine = TorchTrainEngine(model, TrainingConfig())
    state = {"step": 2, "version": 2, "data": {}, "trajectories": {}, "recipe": {}}
    return save_checkpoint(tmp_path / "checkpoints", 2, model, {"engine": engine.state_dict()}, state, keep_last=2)


def test_truncated_weights_with_a_rewritten_manifest_are_a_message(ckpt, model):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    _rewrite_manifest(ckpt)
    with pytest.raises(ValueError, match=r"model\.safetensors: .*(truncated|not a readable)"):
        load_checkpoint(ckpt, model)


def test_a_pickled_optimizer_file_is_refused_without_unpickling(ckpt, model):
    torch.save({"engine": {"cwd": os.getcwd}}, ckpt / "optimizer.pt")  # a pickled function reference
    _rewrite_manifest(ckpt)
    with pytest.raises(ValueError) as e:
        load_checkpoint(ckpt, model)
    assert "optimizer.pt" in str(e.value) and "weights_only" not in str(e.value)


@pytest.mark.parametrize(
    "manifest, needle",
    [
        ('["model.safetensors", "optimizer.pt", "state.json"]', "manifest.json: not a JSON object"),
        ("{not json", "manifest.json: not valid JSON"),
        ('{"model.safetensors": 1, "optimizer.pt": "x", "state.json": "y"}', "manifest.json: not a JSON object"),
        (
            '{"up/x": "0", "model.safetensors": "x", "optimizer.pt": "x", "state.json": "y"}',
            "'up/x' is not a file name",
        ),
        (  # the sharded engine state's folder holds files, not paths out of it
            '{"engine/../../x": "0", "model.safetensors": "x", "optimizer.pt": "x", "state.json": "y"}',
            "'engine/../../x' is not a file name",
        ),
        ('{"engine/..": "0", "model.safetensors": "x", "optimizer.pt": "x", "state.json": "y"}', "'engine/..' is not"),
        ('{"engine/a/b": "0", "model.safetensors": "x", "optimizer.pt": "x", "state.json": "y"}', "'engine/a/b'"),
    ],
)
def test_a_malformed_manifest_is_a_message(ckpt, model, manifest, needle):
    (ckpt / "manifest.json").write_text(manifest)
    with pytest.raises(ValueError, match="") as e:
        load_checkpoint(ckpt, model)
    assert needle in str(e.value) and str(ckpt) in str(e.value)


@pytest.mark.parametrize(
    "state, needle",
    [
        ([1, 2], "state.json: not a JSON object"),
        ("{", "state.json: not valid JSON"),
        ({"step": -5}, "state.json: 'step' must be an integer >= 0, got -5"),
        ({"step": 1, "warmup_step": "3"}, "state.json: 'warmup_step' must be an integer >= 0, got '3'"),
    ],
)
def test_state_json_that_is_not_an_object_is_a_message(ckpt, model, state, needle):
    (ckpt / "state.json").write_text(state if isinstance(state, str) else json.dumps(state))
    _rewrite_manifest(ckpt)
    with pytest.raises(ValueError, match="") as e:
        load_checkpoint(ckpt, model)
    assert needle in str(e.value)


GOOD_STATE = {
    "step": 4,
    "version": 4,
    "data": {},
    "recipe": {},
    "trajectories": {"generated": 0, "trained": 0, "dropped": 0, "dropped_by_reason": {}},
}
GOOD_ENGINE = {"engine": {}, "torch_rng": torch.get_rng_state(), "source": {}}


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"step": -5}, "state.json: 'step' must be an integer >= 0, got -5"),
        ({"step": "4"}, "state.json: 'step' must be an integer >= 0, got '4'"),
        ({"step": 4.0}, "state.json: 'step' must be an integer >= 0, got 4.0"),
        ({"step": True}, "state.json: 'step' must be an integer >= 0, got True"),
        ({"version": -1}, "state.json: 'version' must be an integer >= 0"),
        ({"data": None}, "state.json: 'data' must be a JSON object"),
        ({"trajectories": []}, "state.json: 'trajectories' must be a JSON object"),
        ({"trajectories": {"generated": 1}}, "state.json: 'trajectories' has no 'trained'"),
        ({"trajectories": dict(GOOD_STATE["trajectories"], dropped=-1)}, "state.json: 'dropped' must be an integer"),
    ],
)
def test_run_state_with_bad_values_is_refused(tmp_path, change, needle):
    from loomrl.platform.checkpoint import check_run_state

    with pytest.raises(ValueError, match="") as e:
        check_run_state(dict(GOOD_STATE, **change), GOOD_ENGINE, tmp_path)
    assert needle in str(e.value)


@pytest.mark.parametrize("key", ["step", "version", "data", "trajectories", "recipe"])
def test_run_state_with_a_missing_key_is_refused(tmp_path, key):
    from loomrl.platform.checkpoint import check_run_state

    state = {k: v for k, v in GOOD_STATE.items() if k != key}
    with pytest.raises(ValueError, match=f"state.json: no '{key}'"):
        check_run_state(state, GOOD_ENGINE, tmp_path)
    engine = {k: v for k, v in GOOD_ENGINE.items() if k != "source"}
    with pytest.raises(ValueError, match="optimizer.pt: no 'source'"):
        check_run_state(GOOD_STATE, engine, tmp_path)
    check_run_state(GOOD_STATE, GOOD_ENGINE, tmp_path)


def test_doctor_on_a_corrupt_checkpoint_exits_2_naming_the_file(tmp_path, tokenizer, capsys):
    from loomrl.platform.backbone.vlm import build_policy

    recipe = load_recipe(DEMO, files=False)
    policy = build_policy(recipe.model, tokenizer, 0)
    ckpt = save_checkpoint(tmp_path, 1, policy, {"engine": {}}, {"step": 1}, keep_last=2)
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[:-1000])
    _rewrite_manifest(ckpt)
    assert main(["doctor", DEMO, "--checkpoint", str(ckpt)]) == 2
    assert f"{ckpt}/model.safetensors" in capsys.readouterr().err
    (ckpt / "manifest.json").write_text("[]")
    assert main(["doctor", DEMO, "--checkpoint", str(ckpt)]) == 2
    assert f"{ckpt}/manifest.json" in capsys.readouterr().err


def test_a_run_folder_that_cannot_be_created_is_a_message(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("x")
    out = tmp_path / "a-file" / "run"  # a parent that is a file: no folder can be made there
    assert main(["run", DEMO, "--out", str(out), "training.steps=1"]) == 2
    assert f"error: cannot use {out} as the run folder" in capsys.readouterr().err
    if os.geteuid() != 0:  # root writes into read-only folders
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            assert main(["run", DEMO, "--out", str(ro / "run"), "training.steps=1"]) == 2
            assert f"error: cannot use {ro / 'run'} as the run folder" in capsys.readouterr().err
        finally:
            ro.chmod(0o700)


# --------------------------------------------------------------------------- item 11: report


@pytest.mark.parametrize(
    "rows, needle",
    [
        (["[1, 2]"], "metrics.jsonl:1: not a JSON object"),
        (['{"step": 0, "loss": 1}', '"text"'], "metrics.jsonl:2: not a JSON object"),
        (['{"reward_mean": 0.5}'], "metrics.jsonl:1: no integer 'step'"),
        (['{"step": "zero"}'], "metrics.jsonl:1: no integer 'step'"),
    ],
)
def test_report_on_rows_that_are_not_step_objects_exits_2(tmp_path, capsys, rows, needle):
    (tmp_path / "metrics.jsonl").write_text("".join(r + "\n" for r in rows))
    assert main(["report", str(tmp_path)]) == 2
    assert needle in capsys.readouterr().err


def test_report_plots_what_it_can_of_odd_values(tmp_path, capsys):
    rows = [
        {"step": 0, "reward_mean": "high", "loss": None, "tokens_per_s": 10**400},
        {"step": 1, "reward_mean": 0.5, "loss": float("nan"), "tokens_per_s": True},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "report.png").is_file()


def test_report_overlays_runs_with_a_panel_per_compared_metric(tmp_path):
    """Two runs overlaid: a line per run in every `COMPARE` panel, mismatch and KL on a symlog axis
    (their values reach exactly 0 and negative k3 estimates), a run without a metric leaves a gap."""
    from PIL import Image

    from loomrl.commands import report

    for name, scale in (("native", 1e-4), ("vllm", 0.0)):
        rows = [
            {"step": i, "reward_mean": 0.3, "entropy": 0.1, "logp_mismatch": scale, "rollout_kl": -1e-12,
             "is_ratio_max": 1.0, **({"is_outside_frac": 0.0} if name == "native" else {})}
            for i in range(30)
        ]  # fmt: skip
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = [tmp_path / "native", tmp_path / "vllm"]
    out = tmp_path / "cmp.png"
    assert main(["report", *map(str, runs), "--out", str(out)]) == 0
    with Image.open(out) as im:
        assert im.size[0] > im.size[1]
    fig = report.comparison_figure(runs)
    panels = {ax.get_title(): ax for ax in fig.axes}
    assert len(panels) == len(report.COMPARE)
    for key, title in report.COMPARE:
        ax = panels[title]
        want = 1 if key == "is_outside_frac" else 2
        assert len(ax.lines) == want, (key, len(ax.lines))
        assert ax.get_yscale() == ("symlog" if key in report.SYMLOG else "linear"), key


# --------------------------------------------------------------------------- item 15


def test_only_step_folders_are_checkpoints(tmp_path, model):
    root = tmp_path / "checkpoints"
    for name in ("step-000004", "step-000006.bak", "step-7", "step-00000x"):
        (root / name).mkdir(parents=True)
    assert latest_checkpoint(root) == root / "step-000004"
    save_checkpoint(root, 5, model, {"engine": {}}, {"step": 5}, keep_last=1)  # pruning keeps the user's folders
    assert sorted(p.name for p in root.iterdir()) == ["step-000005", "step-000006.bak", "step-00000x", "step-7"]


def test_a_partial_last_metrics_line_is_dropped_with_a_warning(tmp_path, loomrl_log):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "lo')  # killed while writing row 2
    with loomrl_log.at_level(logging.WARNING, logger="loomrl"):
        assert read_metrics(path) == [{"step": 0}, {"step": 1}]
    assert "metrics.jsonl:3: an incomplete last line" in loomrl_log.text
    path.write_text('{"step": 0}\n{"step": 1, "lo\n{"step": 2}\n')  # but not in the middle
    with pytest.raises(ValueError, match="metrics.jsonl:2: not a JSON line"):
        read_metrics(path)


def test_resume_command_is_shell_quoted(tmp_path, capsys, monkeypatch):
    from loomrl.platform import trainer

    def interrupted(self):
        raise trainer.Interrupted(3, self.out / "checkpoints" / "step-000003")

    monkeypatch.setattr(trainer.Trainer, "run", interrupted)
    out = tmp_path / "my run's folder"
    overrides = [
        "algorithm.reward=rewards_for_tests:distinct_words",
        "data.shards=data/demo/demo-*.tar",
        "training.lr=0.0005",
    ]
    assert main(["run", DEMO, *overrides, "--out", str(out)]) == 130
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("resume with: ")][0]
    assert shlex.split(line.removeprefix("resume with: ")) == [
        "loomrl",
        "run",
        DEMO,
        *overrides,
        "--out",
        str(out),
        "--resume",
    ]


# a short real run, then resumes from a checkpoint of it in new folders


def run_args(shards: Path, out: Path, *extra: str) -> list[str]:
    return [
        "run",
        DEMO,
        "--out",
        str(out),
        f"data.shards={shards}/*.tar",
        "data.demo=null",
        "training.steps=4",
        "training.warmup.steps=0",
        "training.mini_batches=1",
        "training.prompts_per_step=2",
        "rollout.n=2",
        "rollout.max_new_tokens=4",
        "training.threads=1",
        "checkpoint.every=2",
        "checkpoint.keep_last=10",
        "logging.tensorboard=false",
        "goal=null",
        "logging.progress=false",
        *extra,
    ]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    from loomrl.datasets.demo import write_demo_shards

    tmp = tmp_path_factory.mktemp("reliability")
    write_demo_shards(str(tmp / "shards"), samples=12, samples_per_shard=12, seed=3)
    assert main(run_args(tmp / "shards", tmp / "run", "--max-steps", "2")) == 0
    return tmp


def test_resume_skips_a_stray_bak_and_survives_a_cut_metrics_line(short_run, capsys, tmp_path, loomrl_log):
    run = tmp_path / "run"
    shutil.copytree(short_run / "run", run)
    shutil.copytree(run / "checkpoints" / "step-000002", run / "checkpoints" / "step-000006.bak")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "reward_me')  # the run was killed while writing this row
    assert main(run_args(short_run / "shards", run, "--resume")) == 0, capsys.readouterr().err[-2000:]
    assert f"resumed from {run}/checkpoints/step-000002 at RL step 2" in loomrl_log.text
    assert "metrics.jsonl:3: an incomplete last line" in loomrl_log.text
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda s: s.update(step=-5), "state.json: 'step' must be an integer >= 0, got -5"),
        (lambda s: s.pop("data"), "state.json: no 'data'"),
        (lambda s: s["data"].pop("epoch"), "state.json: does not fit this run: KeyError: 'epoch'"),
    ],
)
def test_resume_from_a_tampered_state_is_refused(short_run, capsys, tmp_path, edit, needle):
    ckpt = tmp_path / "step-000002"
    shutil.copytree(short_run / "run" / "checkpoints" / "step-000002", ckpt)
    state = json.loads((ckpt / "state.json").read_text())
    edit(state)
    (ckpt / "state.json").write_text(json.dumps(state))
    _rewrite_manifest(ckpt)
    capsys.readouterr()
    assert main(run_args(short_run / "shards", tmp_path / "new", "--resume-from", str(ckpt), "--max-steps", "3")) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err[-2000:]


def test_a_run_name_cannot_leave_the_runs_folder_and_max_steps_is_not_negative(tmp_path):
    from loomrl.cli import main
    from loomrl.platform import recipe as R

    for name in (os.path.join("..", "..", "x"), "a/b", ".hidden", ""):
        with pytest.raises(R.RecipeError, match="name:"):
            R.load_recipe(ROOT / "recipes" / "demo.yaml", [f"name={name!r}"], files=False)
    with pytest.raises(SystemExit) as e:
        main(["run", str(ROOT / "recipes" / "demo.yaml"), "--dry-run", "--max-steps", "-1"])
    assert e.value.code == 2
