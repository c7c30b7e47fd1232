"""The `vllm` rounding regions against the vLLM kernels a CPU class runs, for tests/test_rounding_vllm.py.

Imported, it checks against whatever vLLM loads on this host. Run as a script,
`python tests/vllm_region_check.py avx512|avx2`, it first makes torch report a CPU of that class
(no AMX; no AVX512-BF16; for avx2 no AVX-512 either), so that vLLM's own selection
(`CpuPlatform.import_kernels`, `_get_attn_isa`) loads the `_C_AVX512` / `_C_AVX2` build and picks
its `vec` attention kernel, and this host (which has all the instructions) runs those kernels: the
arithmetic of a CPU without AMX, on real vLLM code. It prints one JSON line of counts.
"""

from __future__ import annotations

import json
import sys

import torch

BF16 = torch.bfloat16


def padded_case(heads=4, kv_heads=2, head_dim=32, t=150, seed=0):
    """A batch as the trainer lays it out: row 0 full, row 1 left-padded (a short prompt), row 2
    right-padded (a short completion); 150 tokens cross vLLM's 128-key block. Returns q, k, v
    (heads repeated, BF16) and the decoder's mask (causal over real keys, a padded row sees itself)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(3, heads, t, head_dim, generator=g) * 2).to(BF16)
    k, v = (
        (torch.randn(3, kv_heads, t, head_dim, generator=g) * s).to(BF16).repeat_interleave(heads // kv_heads, 1)
        for s in (2, 1)
    )
    real = torch.ones(3, t, dtype=torch.bool)
    real[1, :7] = False
    real[2, -10:] = False
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & real[:, None, None, :]
    mask = mask | torch.eye(t, dtype=torch.bool)[None, None]
    return q, k, v, mask, real


def kernel_rows(q, k, v, real, isa, decode=False):
    """vLLM's kernel on each sequence's real tokens alone (one request each); [N, H, D] in the order
    of `real.nonzero()`. decode: each token as its own one-query request over the keys up to it (a
    decode step), instead of one prefill request per sequence."""
    b = q.shape[0]
    qs, ks, vs = [], [], []
    for i in range(b):
        idx = real[i].nonzero().squeeze(-1)
        query, key, value = (x[i][:, idx].transpose(0, 1).contiguous() for x in (q, k, v))
        spans = [(j, j + 1) for j in range(len(idx))] if decode else [(0, len(idx))]
        for lo, hi in spans:
            qs.append(query[lo:hi])
            ks.append(key[:hi])
            vs.append(value[:hi])
    return torch.cat(kernel_requests(qs, ks, vs, isa))


def kernel_requests(qs, ks, vs, isa, block_size=128):
    """Run `cpu_attention_with_kv_cache` through vLLM's own Python wrappers as its CPU_ATTN backend
    does (causal, no window, KV split off), in one call: request i has keys/values ks[i]/vs[i]
    [L, kv_heads, D] in a paged BF16 cache and queries qs[i] [T, heads, D] at its last T positions.
    Returns the outputs per request."""
    from vllm import _custom_ops as ops

    heads, kv_heads, head_dim = qs[0].shape[1], ks[0].shape[1], qs[0].shape[2]
    lens = [k.shape[0] for k in ks]
    blocks = [-(-n // block_size) for n in lens]
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    start = 0
    for i, nb in enumerate(blocks):
        table[i, :nb] = torch.arange(start, start + nb, dtype=torch.int32)
        start += nb
    cache = torch.zeros(start, kv_heads, 2 * block_size, head_dim, dtype=BF16)
    key_cache, value_cache = cache.chunk(2, dim=2)
    slots = torch.cat(
        [
            table[i, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size
            for i, n in enumerate(lens)
        ]
    )
    ops.cpu_attn_reshape_and_cache(torch.cat(ks), torch.cat(vs), key_cache, value_cache, slots, isa)
    starts = torch.tensor([0] + [q.shape[0] for q in qs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(lens), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, seq_lens=seq_lens,
        dtype=BF16, query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
    )  # fmt: skip
    query = torch.cat(qs)
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query, key_cache, value_cache, out, starts, seq_lens, head_dim**-0.5, True, None, -1, table, 0.0, meta, None
    )
    return out.split([q.shape[0] for q in qs])


def attention_counts() -> dict:
    """The `vllm` attention region against vLLM's kernel for this CPU class, on `padded_case`."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from loomrl.platform.backbone import rounding as R
    from loomrl.platform.backbone import vllm_kernels

    q, k, v, mask, real = padded_case()
    real[:, -1] = True  # a last padded position sees what a real one there would: it counts as real
    trainer_isa = vllm_kernels.attention_isa(q.shape[-1])  # first: it readies AMX tiles, as vLLM's worker does
    isa = _get_attn_isa(BF16, 128, q.shape[-1])
    want = kernel_rows(q, k, v, real, isa)
    decoded = kernel_rows(q, k, v, real, isa, decode=True)

    def rows(x):
        return x.transpose(1, 2)[real]

    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    leaves = [[x.clone().requires_grad_() for x in (q, k, v)] for _ in range(2)]
    got = R.attention(*leaves[0], mask, "vllm")
    (got.float() * weight).sum().backward()
    emulated = R.vllm_attention(*leaves[1], mask)
    (emulated.float() * weight).sum().backward()
    return {
        "isa": isa,
        "trainer_isa": trainer_isa,
        "rows_found": bool(torch.equal(vllm_kernels.causal_rows(mask), real)),
        "elements": want.numel(),
        "decode_off": int((decoded != want).sum()),  # prefill rows == the same rows decoded one by one
        "region_off": int((rows(got) != want).sum()),
        "emulation_off": int((rows(emulated) != want).sum()),
        "padded_rows_zero": not bool(got.transpose(1, 2)[~real].any()),
        "grad_is_emulation_grad": all(torch.equal(a.grad, b.grad) for a, b in zip(*leaves)),
    }


def rope_counts() -> dict:
    """The `vllm` RoPE region against `torch.ops._C.rotary_embedding` of the build loaded here."""
    from loomrl.platform.backbone import rounding as R
    from loomrl.platform.backbone import vllm_kernels
    from loomrl.platform.backbone.decoder import rope_cos_sin

    nearest = vllm_kernels.rounds_to_nearest()  # loads vLLM's kernel library, as vLLM does
    t, heads, d, theta = 64, 4, 64, 1_000_000.0
    g = torch.Generator().manual_seed(5)
    positions = torch.randint(0, 4096, (t,), generator=g)
    x = (torch.randn(t, heads * d, generator=g) * 3).to(BF16)
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))  # RotaryEmbedding._compute_cos_sin_cache
    freqs = torch.einsum("i,j->ij", torch.arange(4096, dtype=torch.float), inv)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(BF16)
    want, other = x.clone(), x.clone()
    torch.ops._C.rotary_embedding(positions, want, other, d, cache, True)  # in place, neox style
    cos, sin = rope_cos_sin(positions[None], d, theta)
    got = R.apply_rope(x.view(t, heads, d).transpose(0, 1)[None], cos[:, None], sin[:, None], "vllm")
    got = got[0].transpose(0, 1).reshape(t, heads * d)
    return {"nearest": nearest, "rope_elements": want.numel(), "rope_off": int((got != want).sum())}


def pretend(cpu_class: str) -> None:
    """Make torch (and so vLLM's selection) see a CPU of this class: `avx512bf16` (AVX512-BF16, no
    AMX: vLLM loads `_C` and runs its `vec` attention), `avx512` (`_C_AVX512`), `avx2` (`_C_AVX2`)."""
    torch.cpu._is_amx_tile_supported = lambda: False
    if cpu_class in ("avx512", "avx2"):
        torch.cpu._is_avx512_bf16_supported = lambda: False
    if cpu_class == "avx2":
        torch.cpu._is_avx512_supported = lambda: False


def loaded_builds() -> list[str]:
    """vLLM's kernel libraries mapped into this process."""
    with open("/proc/self/maps") as f:
        return sorted({line.rsplit("/", 1)[-1].strip() for line in f if "/vllm/_C" in line})


if __name__ == "__main__":
    pretend(sys.argv[1])
    counts = {**rope_counts(), **attention_counts()}
    print(json.dumps({**counts, "builds": loaded_builds()}))
