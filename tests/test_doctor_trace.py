"""`loomrl doctor --engine vllm --trace`: the region-by-region trace. Without vLLM: the recorder
finds a difference in the region where two trainer settings differ and nowhere before it. With
vLLM (installed in CI): the `vllm` setting equals vLLM's own outputs region by region."""
import json
from pathlib import Path

import pytest
import torch

from loomrl.cli import main
from loomrl.platform import doctor
from loomrl.platform.backbone.rounding import Regions
from loomrl.platform.doctor_trace import REGIONS, Recorder, compare, first_divergence, trace_table

ROOT = Path(__file__).resolve().parents[1]


def _record(model, samples, regions: Regions):
    copy = doctor.low_precision_copy(model, regions)
    ids = torch.tensor([samples[0].ids])
    rec = Recorder(copy.language_model, ids.shape[1])
    try:
        with torch.no_grad():
            copy.sequence_logprobs(ids, torch.ones_like(ids), [samples[0].media], 1.0)
    finally:
        rec.remove()
    return rec.regions(ids[0, 1:], copy.banned_token_ids)


@pytest.mark.parametrize("region,first", [("rope", "rope"), ("swiglu", "swiglu"), ("attention", "attention")])
def test_recorder_finds_where_two_settings_part(model, samples, region, first):
    native = Regions("native", "native", "native", "native")
    ref = _record(model, samples, native)
    same = compare(ref, _record(model, samples, native))
    # every region of every layer, in forward order, and none differs between identical settings
    assert [(r["layer"], r["region"]) for r in same][:10] == [(0, name) for name in REGIONS[:10]]
    assert len(same) == 1 + 9 * model.language_model.cfg.num_layers + 3 and first_divergence(same) is None
    other = Regions(**{**vars(native), region: "aligned"})
    rows = compare(ref, _record(model, samples, other))
    f = first_divergence(rows)
    assert (f["layer"], f["region"]) == (0, first) and f["max_abs"] > 0
    assert rows[-1]["region"] == "log_softmax" and rows[-1]["differ"] > 0  # it reaches the log-probs
    text = trace_table({"prompt_tokens": 1, "completion_tokens": 2, "settings": {"x": {"first": f, "regions": rows}}})
    assert f"first divergence, x: layer 0 {first}" in text


def test_trace_needs_the_vllm_engine(capsys):
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--engine", "torch", "--trace"])
    assert e.value.code == 2 and "--engine vllm" in capsys.readouterr().err


def _vllm_amx_bf16() -> bool:
    """Whether vLLM-CPU runs here the kernels the `vllm` profile reproduces bit for bit: the AMX
    attention kernel and the round-to-nearest `_C` build (tests/test_rounding_vllm.py)."""
    return torch.cpu._is_amx_tile_supported() and torch.cpu._is_avx512_bf16_supported()


def test_trace_vllm_profile_equals_vllm_region_by_region(capsys, demo_shards):
    d, _ = demo_shards
    rc = main(["doctor", str(ROOT / "recipes" / "demo.yaml"), f"data.shards={d}/*.tar", "rollout.max_new_tokens=8",
               "--prompts", "2", "--engine", "vllm", "--trace", "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    trace = json.loads(out.strip().splitlines()[-1])["trace"]
    assert "first divergence, vllm:" in out
    rows = trace["settings"]["vllm"]["regions"]
    layers = 2  # recipes/demo.yaml
    assert len(rows) == 1 + 9 * layers + 3
    native = trace["settings"]["native"]["first"]
    # native (transformers' rounding) parts from vLLM at the first RoPE: vLLM's rotary op rounds once
    assert native is not None and (native["layer"], native["region"]) == (0, "rope")
    if _vllm_amx_bf16():
        assert trace["settings"]["vllm"]["first"] is None, trace["settings"]["vllm"]["first"]
    else:  # vLLM's `vec` attention kernel here: the profile holds up to attention
        first = trace["settings"]["vllm"]["first"]
        assert first is None or REGIONS.index(first["region"]) >= REGIONS.index("attention") or first["layer"] != 0
