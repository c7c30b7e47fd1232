"""`loomrl doctor --engine vllm --trace`: the region-by-region trace. Without vLLM: the recorder
finds a difference in the region where two trainer settings differ and nowhere before it. With
vLLM (installed in CI): the `vllm` setting equals vLLM's own outputs region by region."""

import json
from pathlib import Path

import pytest
import torch

from loomrl.cli import main
from loomrl.commands import doctor
from loomrl.commands.doctor_trace import REGIONS, Recorder, compare, first_divergence, trace_table
from loomrl.platform.backbone.rounding import Regions

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


def _vllm_rotary_rounds_to_nearest() -> bool:
    """Whether the `_C` build vLLM loads here rounds FP32 -> BF16 to nearest: on x86 only the
    AVX512-BF16 build does; `_C_AVX512` / `_C_AVX2` truncate (tests/test_rounding_vllm.py)."""
    import platform

    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
    return not x86 or (torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported())


def check_vllm_first_divergence(first, amx_bf16: bool, rotary_rounds_to_nearest: bool) -> None:
    """What the `vllm` setting's first divergence from vLLM may be on this CPU. With the AMX kernel:
    none. Otherwise vLLM runs its `vec` attention kernel (FP32 probabilities), which the profile does
    not reproduce, so the first difference must enter at an attention region: every region before
    it (each norm, projection and RoPE of that layer and of every layer before, the embedding) is
    bit for bit, and a difference first seen at a norm, after the last layer or in the logits is a
    failure. Without AVX512-BF16 vLLM loads another `_C` build, whose kernels the profile does not
    reproduce: its rotary op truncates (layer 0's RoPE is where it parts) or, where its rotary agrees,
    its SiLU-and-mul or attention kernel differs first (an AVX-512 CPU without BF16, 2026-12-07: layer
    1's swiglu, 2e-6); never a norm, a projection, the logits, nor a RoPE after layer 0's agreed."""
    if amx_bf16:
        assert first is None, first
    elif rotary_rounds_to_nearest:
        assert first is None or (first["layer"] >= 0 and first["region"] == "attention"), first
    else:
        assert first is not None, "no difference from a _C build whose kernels the profile does not reproduce"
        where = (first["layer"], first["region"])
        assert where == (0, "rope") or (first["layer"] >= 0 and first["region"] in ("swiglu", "attention")), first


@pytest.fixture()
def trained_norms(monkeypatch):
    """The doctor's policy with the norm weights of a trained one (1 + 0.1 N(0, 1), fixed seed)
    instead of a fresh policy's ones: with every weight 1 the rounding of RMSNorm's `* weight`
    cannot show (vllm's and aligned's norms agree bit for bit there)."""
    from loomrl.platform import parts

    build = parts.build_policy_parts

    def build_trained(recipe, seed=None):
        tokenizer, chat, model = build(recipe, seed)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.language_model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        return tokenizer, chat, model

    monkeypatch.setattr(doctor, "build_policy_parts", build_trained)  # what `loomrl doctor` calls


def test_trace_vllm_profile_equals_vllm_region_by_region(capsys, demo_shards, trained_norms):
    """The demo policy, its norm weights trained (`trained_norms`), through vLLM and the trainer: the
    `vllm` setting equals vLLM in every region where this CPU runs the kernels it reproduces, and
    elsewhere up to the first attention (`check_vllm_first_divergence`)."""
    d, _ = demo_shards
    rc = main(
        [
            "doctor",
            str(ROOT / "recipes" / "demo.yaml"),
            f"data.shards={d}/*.tar",
            "rollout.max_new_tokens=8",
            "--prompts",
            "2",
            "--engine",
            "vllm",
            "--trace",
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    trace = json.loads(out.strip().splitlines()[-1])["trace"]
    assert "first divergence, vllm:" in out
    rows = trace["settings"]["vllm"]["regions"]
    layers = 2  # recipes/demo.yaml
    assert len(rows) == 1 + 9 * layers + 3
    firsts = {name: s["first"] and (s["first"]["layer"], s["first"]["region"]) for name, s in trace["settings"].items()}
    # native (transformers' rounding) parts from vLLM at the first RoPE: vLLM's rotary op rounds once
    assert firsts["native"] == (0, "rope")
    # aligned parts at layer 0's input norm: vLLM rounds the normalised value before `* weight`, which
    # shows only with trained norm weights (all 1 in a fresh policy: aligned would hold until the RoPE)
    assert firsts["aligned"] == (0, "input_norm")
    check_vllm_first_divergence(trace["settings"]["vllm"]["first"], _vllm_amx_bf16(), _vllm_rotary_rounds_to_nearest())


def test_trace_fallback_lets_a_difference_enter_only_at_attention():
    """The check above on CPUs without vLLM's AMX kernel (vLLM's `vec` kernel, or its truncating RoPE
    build), which this host may not be: the first difference may be an attention region, never a norm,
    a projection, the final norm or the logits, of any layer."""
    for layer, region in [(0, "attention"), (1, "attention")]:
        check_vllm_first_divergence({"layer": layer, "region": region}, False, True)
    check_vllm_first_divergence(None, False, True)
    for layer, region in [(0, "rope"), (1, "swiglu"), (0, "attention")]:
        check_vllm_first_divergence({"layer": layer, "region": region}, False, False)
    for layer, region, rounds_to_nearest in [
        (0, "rope", True),
        (0, "post_norm", True),
        (0, "mlp", True),
        (1, "input_norm", True),
        (-1, "final_norm", True),
        (-1, "logits", True),
        (1, "rope", False),
        (0, "post_norm", False),
        (1, "mlp", False),
        (-1, "logits", False),
    ]:
        with pytest.raises(AssertionError):
            check_vllm_first_divergence({"layer": layer, "region": region}, False, rounds_to_nearest)
    with pytest.raises(AssertionError):
        check_vllm_first_divergence({"layer": 0, "region": "attention"}, True, True)
    with pytest.raises(AssertionError):
        check_vllm_first_divergence(None, False, False)
