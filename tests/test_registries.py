"""Registries instead of name chains: a part is found by the name a recipe gives it, its traits
decide what the recipe may combine it with, and a new part is one file and one registration.
RLOO is the worked example (docs/extending.md), checked by hand; a rollout engine, a reward and a
modality are each registered in a test."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from loomrl.config import RecipeError
from loomrl.encoders.base import MODALITIES, Modality, load_medium
from loomrl.encoders.base import register as register_modality
from loomrl.encoders.media import Medium, content_hash
from loomrl.platform import recipe as R
from loomrl.platform.algorithms import ALGORITHMS
from loomrl.platform.algorithms.advantages import assign_advantages
from loomrl.platform.algorithms.rloo import rloo_advantages
from loomrl.platform.backbone.config import ModelConfig
from loomrl.platform.backbone.tokenizer import load_tokenizer
from loomrl.platform.backbone.vlm import VLM
from loomrl.platform.engines import TRAINING_ENGINES
from loomrl.platform.rewards import REWARDS, build_reward
from loomrl.platform.rewards.sources import build_sources
from loomrl.platform.rollout import ROLLOUT_ENGINES, build_rollout_engine

DEMO = "recipes/demo.yaml"


def test_rloo_baseline_is_the_mean_of_the_other_samples():
    # group 1: rewards 1, 0, 0, 1 -> each baseline is the mean of the other three:
    #   1 - (0 + 0 + 1) / 3 = 2/3;  0 - (1 + 0 + 1) / 3 = -2/3
    # group 2: all 0.5 -> 0 everywhere (no signal, and no division by a zero spread)
    # group 3: 3, 1, 2, 6 -> 3 - 9/3 = 0, 1 - 11/3 = -8/3, 2 - 10/3 = -4/3, 6 - 2 = 4
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 3.0, 1.0, 2.0, 6.0])
    want = [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0, 0.0, 0.0, 0.0, -8 / 3, -4 / 3, 4.0]
    assert rloo_advantages(rewards, 4).tolist() == pytest.approx(want)
    with pytest.raises(ValueError, match="groups of 4"):
        rloo_advantages(torch.zeros(6), 4)


def test_the_trainer_takes_the_registered_estimator_by_name():
    """assign_advantages with algorithm.name rloo sets RLOO's advantages; grpo's differ (std-scaled)."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])

    def run(name: str) -> list[float]:
        trajs = [SimpleNamespace(advantage=None) for _ in range(4)]
        mb = SimpleNamespace(trajectories=trajs, loss_mask=torch.ones(4, 3), ref_logp=None)
        algorithm = R.AlgorithmConfig(name=name)
        assign_advantages(algorithm, 4, rewards, trajs, [mb])
        assert mb.advantages.tolist() == pytest.approx([t.advantage for t in trajs])
        return [t.advantage for t in trajs]

    assert run("rloo") == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # GRPO: (r - 0.5) / (unbiased std sqrt(1/3) + 1e-6) = +-0.866025
    assert run("grpo") == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], rel=1e-5)


def test_recipes_name_what_is_registered():
    assert {"torch", "deepspeed", "megatron"} <= set(TRAINING_ENGINES.names())
    assert {"torch", "vllm"} <= set(ROLLOUT_ENGINES.names())
    assert {"grpo", "ppo", "sft", "rloo", "dpo"} <= set(ALGORITHMS.names())
    with pytest.raises(
        RecipeError,
        match=r"algorithm.name: 'gpt' is not allowed; allowed values: 'dpo', 'grpo', 'gspo', 'ppo', "
        r"'reinforce\+\+', 'reinforce\+\+-baseline', 'rloo', 'sft'",
    ):
        R.load_recipe(DEMO, ["algorithm.name=gpt"])
    with pytest.raises(RecipeError, match="rollout.engine: unknown rollout engine 'gpt'; registered: torch, vllm"):
        ROLLOUT_ENGINES.get("gpt")
    # traits decide the combinations: RLOO needs groups, PPO a value model, the torch engine one process
    with pytest.raises(RecipeError, match="rollout.n: RLOO needs at least 2 samples per prompt"):
        R.load_recipe(DEMO, ["algorithm.name=rloo", "rollout.n=1"])
    with pytest.raises(RecipeError, match="algorithm.name: ppo trains a value model"):
        R.load_recipe(DEMO, ["algorithm.name=ppo", "training.engine=megatron", "training.nproc=2"])
    assert R.load_recipe(DEMO, ["rollout.engine=vllm"]).model.rounding.attention == "vllm"  # its registered rounding


@pytest.fixture()
def echo_engine():
    """A rollout engine added by one registration (what docs/extending.md shows), removed after."""

    @ROLLOUT_ENGINES.register("echo", rounding="native")
    class Echo:
        @classmethod
        def from_recipe(cls, recipe, model):
            engine = cls()
            engine.model, engine.n = model, recipe.rollout.n
            return engine

    yield Echo
    ROLLOUT_ENGINES._entries.pop("echo")


def test_a_new_rollout_engine_is_one_registration(echo_engine):
    recipe = R.load_recipe(DEMO, ["rollout.engine=echo", "rollout.n=3"])
    assert recipe.model.rounding.rope == "native"  # `auto` took its trait
    engine = build_rollout_engine(recipe, model="the policy")
    assert isinstance(engine, echo_engine) and (engine.model, engine.n) == ("the policy", 3)
    assert "'echo'" in [row for row in R.field_docs() if row[0] == "rollout.engine"][0][1]  # listed by `loomrl recipe`


@pytest.fixture()
def short_answer():
    """A reward added by one registration (what docs/extending.md shows), removed after."""

    @REWARDS.register("test_short_answer", params=("tolerance",))
    def short_answer(completion: str, sample: dict, tolerance: float = 1e-4) -> float:
        return 1.0 if len(completion) <= tolerance else 0.0

    yield short_answer
    REWARDS._entries.pop("test_short_answer")


def test_a_new_reward_is_one_registration(short_answer, tmp_path):
    recipe = R.load_recipe(DEMO, ["algorithm.reward=test_short_answer"])  # validated: resolve_callable found it
    (source,) = build_sources(recipe.algorithm)
    assert source.name == "test_short_answer"
    assert source.score(["", "abc"], [{"id": "a"}, {"id": "b"}]) == [1.0, 0.0]  # tolerance 1e-4 by default
    # its `params` trait: a reward source's tolerance reaches it, through the recipe and build_reward
    path = tmp_path / "r.yaml"
    path.write_text("algorithm: {rewards: [{fn: test_short_answer, tolerance: 3}]}")
    (source,) = build_sources(R.load_recipe(path, files=False).algorithm)
    assert source.score(["abc", "abcd"], [{"id": "a"}, {"id": "b"}]) == [1.0, 0.0]
    fn = build_reward("test_short_answer", R.RewardSourceConfig(fn="test_short_answer", tolerance=3))
    assert [fn(c, {"id": "a"}) for c in ("abc", "abcd")] == [1.0, 0.0]
    path.write_text("algorithm: {rewards: [{fn: test_short_answer, pattern: x}]}")
    with pytest.raises(RecipeError, match=r"algorithm.rewards\[0\].pattern: only the regex reward takes a pattern"):
        R.load_recipe(path, files=False)
    # an unknown name lists the registered ones, the new one included
    with pytest.raises(
        RecipeError,
        match=r"algorithm.reward: 'no_such_reward' is neither a registered reward \(choice, exact, exact_match, "
        r"iou, math, numeric, regex, slot_match, test_short_answer\) nor module:function",
    ):
        R.load_recipe(DEMO, ["algorithm.reward=no_such_reward"])
    with pytest.raises(
        RecipeError, match=r"algorithm.reward: unknown reward 'no_such_reward'; registered: .*test_short"
    ):
        build_reward("no_such_reward")


@pytest.fixture()
def scalar_modality():
    """A medium added by one registration: four float32 numbers, one token, a linear tower."""

    class ScalarTower(torch.nn.Linear):
        config = SimpleNamespace(to_dict=lambda: {"kind": "scalar"})
        gradient_checkpointing = False

    @register_modality("scalar")
    class Scalars(Modality):
        order, marker, manifest_keys, file_prefix = 9, "<scalar>", ("scalars",), "sca"
        noun, tower_name, tower_attrs, checkpoint_types = "scalar", "scalar", ("scalar_tower",), ()

        @classmethod
        def load(cls, data, cfg):
            features = torch.from_numpy(np.frombuffer(data, dtype=np.float32).copy())
            if features.shape != (4,):
                raise ValueError(f"a scalar medium is 4 float32 numbers, got {len(data)} bytes")
            return Medium("scalar", content_hash(data), features[None], None, "")

        @classmethod
        def num_tokens(cls, medium, cfg):
            return 1

        @classmethod
        def build_demo(cls, model, cfg):
            model.scalar_tower = ScalarTower(4, cfg.hidden_size)

        @classmethod
        def parameter_parts(cls, model):
            return {"scalar": list(model.scalar_tower.parameters())}

        @classmethod
        def batch(cls, media):
            return (torch.cat([m.features for m in media]),)

        @classmethod
        def encode(cls, tower, inputs, media, cfg):
            return list(tower(inputs[0])[:, None])

    yield Scalars
    MODALITIES._entries.pop("scalar")


def test_a_new_modality_is_one_registration(scalar_modality):
    cfg = ModelConfig()
    tokenizer = load_tokenizer("demo")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>", "<audio>", "<scalar>"]})
    torch.manual_seed(0)
    model = VLM(cfg, tokenizer)
    assert isinstance(model.scalar_tower, torch.nn.Linear) and model.visual is not None  # beside the demo's towers
    medium = load_medium("scalar", np.float32([1, 2, 3, 4]).tobytes(), cfg)
    ids = model.prompt_ids(tokenizer, "<scalar> describe the sound .", [medium])
    placeholder = model.media_tokens_of["scalar"].placeholder
    assert ids.count(placeholder) == 1 and placeholder in model.banned_token_ids.tolist()
    input_ids = torch.tensor([ids])
    logp, _ = model.sequence_logprobs(input_ids, torch.ones_like(input_ids), [[medium]])
    logp.sum().backward()  # the medium's encoding was spliced in: its tower gets a gradient
    assert model.scalar_tower.weight.grad is not None and model.scalar_tower.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="unknown medium kind 'pointcloud'; kinds: audio, image, scalar, video"):
        load_medium("pointcloud", b"", cfg)
