import os

import pytest
import torch

from loomrl.datasets.demo import write_demo_shards
from loomrl.platform.backbone.tokenizer import load_tokenizer
from loomrl.platform.backbone.vlm import build_policy
from loomrl.platform.recipe import ModelConfig

torch.set_num_threads(2)
# A sample that fails with an exception no decoder raises on bad data (IndexError, AttributeError...)
# is a bug, not a bad sample: in the tests it raises instead of being skipped (encoders/media.py).
os.environ["LOOMRL_STRICT_DATA_ERRORS"] = "1"


@pytest.fixture(scope="session")
def demo_shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    files = write_demo_shards(str(d), samples=24, samples_per_shard=10, seed=7)
    return d, files


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer("demo")


@pytest.fixture()
def model(tokenizer):
    return build_policy(ModelConfig(), tokenizer, seed=0)


@pytest.fixture()
def samples(demo_shards, model, tokenizer):
    from loomrl.datasets.source import PromptSource
    from loomrl.datasets.stream import ShardStream

    _, files = demo_shards
    # shard order (no shuffle): image, audio, both, image, ...
    return PromptSource(ShardStream(files, shuffle_buffer=0), model, tokenizer, ModelConfig()).next(24)


@pytest.fixture()
def loomrl_log(caplog):
    """caplog for the `loomrl` logger, which stops propagating once a CLI has set up logging."""
    import logging

    logger = logging.getLogger("loomrl")
    propagate, level = logger.propagate, logger.level
    logger.addHandler(caplog.handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.propagate, logger.level = propagate, level
