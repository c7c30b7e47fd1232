"""Seeded fuzz of checkpoint folders (`model.init_from`): mutations of a tiny Qwen2-VL folder
(config.json values and types: huge, negative, zero, wrong type, missing; the safetensors header's
length, bytes and offsets; truncated files) go through what a run does with a folder: the
recipe-time reading of config.json (`checkpoint_settings`), the whole check before building
(`hf_weights.check_checkpoint`) and, when both accept it, the policy itself built and loaded.
Each must end in a clean refusal (a ValueError naming the folder's file) or a policy; any other
exception is a failure. The cases run in one child process under RLIMIT_AS (3 GB) with an alarm
per case (a hang fails it), so a mutation that allocates or waits cannot take the machine."""

import json
import os
import random
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from qwen_checkpoints import _qwen2_vl

from loomrl.platform.backbone.hf_config import checkpoint_settings
from loomrl.platform.backbone.hf_weights import check_checkpoint
from loomrl.platform.backbone.tokenizer import load_tokenizer
from loomrl.platform.backbone.vlm import build_policy
from loomrl.platform.recipe import RecipeError, load_recipe

SEED = 20261202
CASES = 100
MEMORY = 3 << 30
TESTS = Path(__file__).resolve().parent

TEXT_KEYS = [
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
]
VISION_KEYS = ["depth", "embed_dim", "hidden_size", "num_heads", "patch_size", "mlp_ratio", "spatial_merge_size"]
VALUES = [0, -1, 1, 3, 2**31, 10**9, 10**12, 10**30, 1.5, "64", None, True, [], {}, float("nan"), "missing"]


def mutate_config(cfg: dict, rng: random.Random) -> str:
    section, keys = rng.choice([("text_config", TEXT_KEYS), ("vision_config", VISION_KEYS)])
    key, value = rng.choice(keys), rng.choice(VALUES)
    if value == "missing":
        cfg[section].pop(key, None)
    else:
        cfg[section][key] = value
    if key == "num_hidden_layers":
        cfg[section].pop("layer_types", None)
    return f"{section}.{key}={value!r}"


def mutate_weights(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    kind = rng.choice(["length", "bytes", "offsets", "truncate", "dtype", "shape", "metadata"])
    if kind == "metadata":  # harmless: the folder still builds
        header["__metadata__"] = {"format": "pt", "note": "x" * rng.randrange(100)}
        text = json.dumps(header).encode()
        return struct.pack("<Q", len(text)) + text + raw[8 + n :], "metadata"
    if kind == "length":
        value = rng.choice([0, 1, n - 1, n + 1, len(raw), 2**60, 2**64 - 1])
        return struct.pack("<Q", value) + raw[8:], f"header length {value}"
    if kind == "bytes":
        at = rng.randrange(8, 8 + n)
        return raw[:at] + bytes([rng.randrange(256)]) + raw[at + 1 :], f"header byte {at}"
    if kind == "truncate":
        at = rng.randrange(0, len(raw))
        return raw[:at], f"truncated at {at}"
    name = rng.choice([k for k in header if k != "__metadata__"])
    entry = header[name]
    if kind == "offsets":
        entry["data_offsets"] = rng.choice([[0, 10**12], [5, 3], [-1, 4], ["0", 4], [0], None])
    elif kind == "dtype":
        entry["dtype"] = rng.choice(["F64", "I8", "BOOL", "X9", None])
    else:
        entry["shape"] = rng.choice([[], [10**9, 10**9], [-1], ["2"], [1] * 40])
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + raw[8 + n :], f"{kind} of {name}: {entry}"


def run_case(folder: Path) -> str:
    """'ok' (accepted and built), or 'refused: ...'; any other exception propagates."""
    try:
        checkpoint_settings(str(folder))
        check_checkpoint(folder)
        recipe = load_recipe("recipes/demo.yaml", [f"model.init_from={folder}"], files=False)
    except (RecipeError, ValueError) as e:
        if str(folder) not in str(e):
            raise AssertionError(f"a refusal that names no file: {e}") from None
        return f"refused: {str(e)[:200]}"
    build_policy(recipe.model, load_tokenizer(recipe.model.tokenizer), seed=0)  # must not fail now
    return "ok"


def child(seed: int, cases: int) -> None:
    """Make the tiny folder, run the cases; one JSON line per case on stdout."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        _qwen2_vl(str(base), "qwen2_vl")
        cfg, raw = json.loads((base / "config.json").read_text()), (base / "model.safetensors").read_bytes()

        def hung(*_):
            raise TimeoutError("hung")

        signal.signal(signal.SIGALRM, hung)
        for i in range(cases):
            folder = Path(tmp) / f"case-{i}"
            shutil.copytree(base, folder)
            mutated, weights = json.loads(json.dumps(cfg)), raw
            what = [mutate_config(mutated, rng) for _ in range(rng.choice([0, 1, 1, 2]))]
            if i == 0:  # the folder as it is
                what = ["nothing"]
            elif not what or rng.random() < 0.4:
                weights, said = mutate_weights(raw, rng)
                what.append(said)
            (folder / "config.json").write_text(json.dumps(mutated))
            (folder / "model.safetensors").write_bytes(weights)
            signal.alarm(10)
            try:
                outcome = run_case(folder)
            except BaseException as e:  # noqa: BLE001 - what the test reports as a failure
                outcome = f"FAILED {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
            signal.alarm(0)
            print(json.dumps({"case": i, "what": what, "outcome": outcome}), flush=True)
            shutil.rmtree(folder)


def test_mutated_checkpoint_folders_are_refused_cleanly_or_built():
    start = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    proc = subprocess.run(
        [sys.executable, __file__, str(SEED), str(CASES)],
        cwd=TESTS.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(rows) == CASES, proc.stderr[-3000:]
    failed = [r for r in rows if r["outcome"].startswith("FAILED")]
    assert not failed, "\n".join(f"{r['what']}: {r['outcome']}" for r in failed[:3])
    refused = sum(r["outcome"].startswith("refused") for r in rows)
    assert refused >= CASES // 2 and refused < CASES  # the mutations bite, and some folders still build
    print(f"{CASES} cases ({refused} refused, {CASES - refused} built) in {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
    child(int(sys.argv[1]), int(sys.argv[2]))
