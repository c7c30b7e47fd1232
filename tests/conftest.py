import os
import tempfile
from pathlib import Path

import pytest
import torch

from loomrl.datasets.demo import write_demo_shards
from loomrl.platform.backbone.tokenizer import load_tokenizer
from loomrl.platform.backbone.vlm import build_policy
from loomrl.platform.recipe import ModelConfig

# `make test` runs the suite on two pytest-xdist workers (one core each), then the `two_cores` tests alone.
# Each worker has a temporary folder of its own (its runs, vLLM's rendezvous files), so tests that
# check what a run left in the temporary folder see their own worker's only.
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
torch.set_num_threads(1 if WORKER else 2)
if WORKER:
    os.environ["TMPDIR"] = os.path.join(tempfile.gettempdir(), f"loomrl-tests-{WORKER}")
    os.makedirs(os.environ["TMPDIR"], exist_ok=True)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
# The draft cost models a run adopts (draft_control.CostCache) live in this session's own cache,
# not the user's: the suite's runs of one workload share their first fit, as a machine's runs do.
os.environ["LOOMRL_CACHE_DIR"] = tempfile.mkdtemp(prefix="loomrl-cache-")
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


# Test tiers. `make test-fast` leaves out the files below: their tests start real runs (the CLI,
# torchrun ranks, vLLM engines, multi-step training) and take most of the suite's time; what is
# left (unit tests of every part) runs in under 3 minutes on 2 cores. `make test` (CI) runs all.
SLOW_FILES = {
    "test_bench_demo.py",
    "test_bench_rollout.py",
    "test_compose.py",
    "test_data_parallel.py",
    "test_deepspeed_engine.py",
    "test_demo_learns.py",
    "test_disaggregated.py",
    "test_doctor_trace.py",
    "test_end_to_end.py",
    "test_export.py",
    "test_gpu_check.py",
    "test_init_from.py",
    "test_megatron_engine.py",
    "test_memory_tools.py",
    "test_docs_run.py",
    "test_dpo_run.py",
    "test_own_data.py",
    "test_own_task.py",
    "test_own_task_errors.py",
    "test_placement.py",
    "test_ppo.py",
    "test_reliability.py",
    "test_resume.py",
    "test_run_folder.py",
    "test_sft_validation.py",
    "test_vllm_engine.py",
    "test_vllm_multimodal.py",
    "test_vllm_qwen_vl.py",
    "test_rounding_vllm.py",
}
# Learning tests timed with both cores of a 2-core machine (training.threads=2): run nothing beside them.
TWO_CORE_FILES = {"test_demo_learns.py"}
# Under xdist (`make test`: `-n 2 --dist loadgroup`) a file's tests stay on one worker (its module
# fixtures run once), except these, whose slow cases are independent runs: they are spread over the workers.
SPREAD_FILES = {"test_compose.py", "test_multi_node.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
        if item.path.name in TWO_CORE_FILES:
            item.add_marker(pytest.mark.two_cores)


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`, by file: each file is one work unit for one worker, except SPREAD_FILES,
    whose tests go one by one. (xdist 3.8's own loadgroup appends the group to `item._nodeid`, which
    pytest 9 no longer reads: the groups were silently ignored, and the suite's durations showed each
    engine file's module fixture, a 20-40 s torchrun, made on both workers.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if Path(path).name in SPREAD_FILES else path

    return ByFile(config, log)
