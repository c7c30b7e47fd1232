"""`loomrl doctor --engine vllm --trace`: where the trainer's forward and vLLM's part ways.

The doctor's table says *how far* the trainer's log-probs are from vLLM's; the trace says
*where* the difference enters. One sequence (the longest completion vLLM sampled, with its
prompt) goes through vLLM's model runner once, as a prefill (with `prompt_logprobs`, so vLLM
computes the logits of every position), and through the trainer's BF16 copy once per
rounding setting. Forward hooks on both models record each region's output, layer by layer:

    embedding     the input of layer 0 (token embeddings, the media encodings spliced in)
    input_norm    input_layernorm's output (from layer 1 on, with the residual add fused in)
    qkv           the q, k and v projections, concatenated as vLLM's fused `qkv_proj`
    rope          q and k after the rotary embedding
    attention     softmax(q k^T / sqrt(d)) v, heads concatenated
    o_proj        the attention block's output
    residual      the residual stream after the attention block (post_attention_layernorm's add)
    post_norm     post_attention_layernorm's output
    swiglu        silu(gate) * up, the input of down_proj
    mlp           down_proj's output
    final_norm    model.norm's output
    logits        the LM head's output, positions 0 .. T-2
    log_softmax   the log-prob of each next token: an FP32 log-softmax of each side's logits
                  (temperature 1, the trainer's banned tokens removed), as vLLM's sampler computes it

Both models name these modules alike (the built-in decoder mirrors vLLM's Qwen2: `rotary_emb`
and `attn` are parameter-free modules there for this reason). Per region the trace reports the
fraction of elements that differ and the largest |difference|; the first region that differs is
where the divergence enters, and everything after it inherits some of it. The trace runs vLLM's
prefill kernels; the rollout's own log-probs come from its decode steps (one query at a time),
which `tests/test_rounding_vllm.py` compares kernel by kernel.

vLLM must run in this process (`rollout.vllm.multiprocessing: false`, the default), where its
model is an object the hooks can reach.
"""

from __future__ import annotations

import os
import re
from typing import Optional

import torch
import torch.nn.functional as F

from loomrl.platform.backbone.rounding import SETTINGS
from loomrl.platform.mismatch import low_precision_copy, policy_encodings, trajectories
from loomrl.platform.rollout.base import Prompt, Rollout
from loomrl.platform.rollout.config import VLLMConfig
from loomrl.platform.rollout.vllm_engine import VLLMRolloutEngine
from loomrl.platform.trajectory.batch import micro_batches

REGIONS = (
    "embedding",
    "input_norm",
    "qkv",
    "rope",
    "attention",
    "o_proj",
    "residual",
    "post_norm",
    "swiglu",
    "mlp",
    "final_norm",
    "logits",
    "log_softmax",
)
TRACED_SETTINGS = ("native", "aligned", "vllm")

# module name (relative to a `layers.N.` prefix, or the whole name's end) -> (region, how to read it)
_LAYER_HOOKS = {
    "input_layernorm": ("input_norm", "out0"),
    "self_attn.rotary_emb": ("rope", "out_cat"),
    "self_attn.attn": ("attention", "out"),
    "self_attn.o_proj": ("o_proj", "out0"),
    "post_attention_layernorm": ("post_norm", "out0+residual"),
    "mlp.down_proj": ("mlp", "out0+swiglu"),
    # the trainer's unfused projections and vLLM's fused one
    "self_attn.qkv_proj": ("qkv", "out0"),
    "self_attn.q_proj": ("q", "out0"),
    "self_attn.k_proj": ("k", "out0"),
    "self_attn.v_proj": ("v", "out0"),
}


def _rows(x: torch.Tensor, tokens: int) -> torch.Tensor:
    """A region's output as [tokens, features] in FP32: vLLM's are [T, ...] already (one
    request); the trainer's are [1, T, F] or, inside attention, [1, heads, T, head_dim]."""
    x = x.detach()
    if x.dim() == 4:  # [B, H, T, D] -> [T, H*D]
        x = x[0].transpose(0, 1).reshape(x.shape[2], -1)
    elif x.dim() == 3 and x.shape[0] == 1:
        x = x[0]
    return x.reshape(x.shape[0], -1)[:tokens].float()


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


class Recorder:
    """Forward hooks on a Qwen2-shaped model that record each region's output (`REGIONS`) per
    layer, for the first forward over exactly `tokens` positions; logits from every call."""

    def __init__(self, model: torch.nn.Module, tokens: int):
        self.tokens = tokens
        self.layer = -1  # the layer running now: vLLM shares one rotary_emb module among all layers
        self.seen: dict[tuple[int, str], torch.Tensor] = {}
        self.logits: list[torch.Tensor] = []
        self.handles = []
        for name, module in model.named_modules():  # a shared module comes once, under its first name
            m = re.search(r"(?:^|\.)layers\.(\d+)(?:\.(.+))?$", name)
            if m and m.group(2) is None:
                self.handles.append(module.register_forward_pre_hook(self._enter(int(m.group(1))), with_kwargs=True))
            elif m and m.group(2) in _LAYER_HOOKS:
                self._hook(module, *_LAYER_HOOKS[m.group(2)])
            elif name.endswith("model.norm"):
                self._hook(module, "final_norm", "out0", final=True)
            elif name.endswith("logits_processor") or name.endswith("lm_head"):
                self.handles.append(
                    module.register_forward_hook(
                        lambda mod, args, out: self.logits.append(
                            _first(out).detach().reshape(-1, _first(out).shape[-1])
                        )
                    )
                )

    def _put(self, layer: int, region: str, x: torch.Tensor) -> None:
        if (layer, region) not in self.seen and x.numel() and _rows(x, self.tokens).shape[0] == self.tokens:
            self.seen[(layer, region)] = _rows(x, self.tokens)

    def _enter(self, layer: int):
        def before(module, args, kwargs):
            self.layer = layer
            if layer == 0:  # its input is the embedding
                # vLLM calls layer(positions, hidden_states, residual); the trainer layer(x, residual, ...)
                x = (
                    args[1]
                    if args and args[0].dtype in (torch.int32, torch.int64)
                    else (args[0] if args else kwargs["hidden_states"])
                )
                self._put(0, "embedding", x)

        return before

    def _hook(self, module, region: str, how: str, final: bool = False) -> None:
        def after(mod, args, out):
            layer = -1 if final else self.layer
            if how == "out_cat":
                q, k = out
                self._put(layer, region, torch.cat([_rows(q, self.tokens), _rows(k, self.tokens)], -1))
                return
            self._put(layer, region, _first(out))
            if how == "out0+residual":
                self._put(layer, "residual", out[1])
            if how == "out0+swiglu":
                self._put(layer, "swiglu", args[0])

        self.handles.append(module.register_forward_hook(after))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def regions(self, next_ids: torch.Tensor, banned: torch.Tensor) -> dict[tuple[int, str], torch.Tensor]:
        """Every recorded region, the unfused q/k/v joined as qkv, plus logits and log_softmax at
        positions 0 .. T-2 (`next_ids`: the token each of them predicts)."""
        out = dict(self.seen)
        for layer in sorted({lay for lay, r in out if r == "q"}):
            out[(layer, "qkv")] = torch.cat([out.pop((layer, part)) for part in "qkv"], -1)
        n = self.tokens - 1
        # vLLM computes logits once for the sampled position and once for the prompt log-probs
        # (positions 0 .. T-2); the trainer once for all T
        logits = next((x for x in self.logits if x.shape[0] in (n, self.tokens)), None)
        if logits is not None:
            logits = logits[:n].float()
            out[(-1, "logits")] = logits
            logp = F.log_softmax(logits.index_fill(-1, banned.to(logits.device), float("-inf")), -1)
            targets = next_ids[:n].to(logp.device)
            keep = ~torch.isin(targets, banned.to(logp.device))  # a media placeholder next: -inf on both sides
            out[(-1, "log_softmax")] = logp.gather(-1, targets[:, None])[keep]
        return out


def _order(key: tuple[int, str]) -> tuple:
    layer, region = key
    return (layer if layer >= 0 else 1 << 30, REGIONS.index(region))


def compare(ref: dict, got: dict) -> list[dict]:
    """Per region both sides recorded, in forward order: the fraction of elements that differ,
    their largest and mean |difference|."""
    rows = []
    for key in sorted(set(ref) & set(got), key=_order):
        a, b = ref[key], got[key]
        if a.shape != b.shape:
            raise ValueError(
                f"trace: layer {key[0]} {key[1]}: vLLM's output is {list(a.shape)}, the trainer's {list(b.shape)}"
            )
        d = (a - b).abs()
        rows.append(
            {
                "layer": key[0],
                "region": key[1],
                "differ": float((d > 0).float().mean()),
                "max_abs": float(d.max()),
                "mean_abs": float(d.mean()),
            }
        )
    return rows


def first_divergence(rows: list[dict]) -> Optional[dict]:
    return next((r for r in rows if r["differ"] > 0), None)


@torch.no_grad()
def trace_vllm(
    model, prompts: list[Prompt], rollouts: list[Rollout], settings: tuple[str, ...] = TRACED_SETTINGS
) -> dict:
    """Trace the longest rollout (prompt + completion) through vLLM's prefill and the trainer's
    BF16 copy under each of `settings`; see the module docstring."""

    if not rollouts:
        raise ValueError("trace: no rollouts to trace")
    pick = max(rollouts, key=lambda r: len(r.completion_ids))
    prompt = prompts[pick.prompt_index]
    seq = Prompt(prompt.id, list(prompt.ids) + list(pick.completion_ids), prompt.media)
    tokens = len(seq.ids)
    next_ids = torch.tensor(seq.ids[1:])
    banned = model.banned_token_ids

    engine = VLLMRolloutEngine(model, VLLMConfig(dtype="bfloat16"), max_model_len=max(512, tokens + 8))
    try:
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            raise ValueError(
                "--trace needs vLLM in this process: unset VLLM_ENABLE_V1_MULTIPROCESSING "
                "(rollout.vllm.multiprocessing: false)"
            )
        served = engine.llm.collective_rpc(lambda worker: worker.get_model())[0]
        rec = Recorder(served, tokens)
        try:
            _prefill(engine, seq)
        finally:
            rec.remove()
        ref = rec.regions(next_ids, banned)
    finally:
        engine.shutdown()
    if not ref:
        raise RuntimeError("trace: vLLM's forward recorded nothing (its model did not run the sequence in one pass)")

    trajs = trajectories([seq], [Rollout(0, 0, [], [], "length")])
    encodings = policy_encodings(model, trajs)
    out = {"prompt_tokens": len(prompt.ids), "completion_tokens": len(pick.completion_ids), "settings": {}}
    for name in settings:
        copy = low_precision_copy(model, SETTINGS[name])
        rec = Recorder(copy.language_model, tokens)
        try:
            for mb in micro_batches(trajs, copy.pad_token_id, 1, device=copy.device):
                copy.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.media, 1.0, encodings)
        finally:
            rec.remove()
        rows = compare(ref, rec.regions(next_ids, banned))
        out["settings"][name] = {"first": first_divergence(rows), "regions": rows}
    return out


def _prefill(engine, seq: Prompt) -> None:
    """One vLLM request over the whole sequence: a single prefill forward, logits for every position."""
    from vllm import SamplingParams as VSP
    from vllm.sampling_params import RequestOutputKind

    llm = engine.llm.llm_engine
    sp = VSP(n=1, temperature=1.0, max_tokens=1, prompt_logprobs=0, seed=0, output_kind=RequestOutputKind.FINAL_ONLY)
    llm.add_request("loomrl-trace", engine._prompt_inputs([seq])[0], sp)
    while llm.has_unfinished_requests():
        llm.step()


def trace_table(trace: dict) -> str:
    names = list(trace["settings"])
    lines = [
        f"trace: one sequence ({trace['prompt_tokens']} prompt + {trace['completion_tokens']} completion "
        "tokens), vLLM's prefill vs the trainer's BF16 forward; per region: elements that differ / max abs "
        "difference",
        "",
        "| layer | region | " + " | ".join(names) + " |",
        "| --- | --- | " + " | ".join("---" for _ in names) + " |",
    ]
    by_key = {name: {(r["layer"], r["region"]): r for r in s["regions"]} for name, s in trace["settings"].items()}
    for key in by_key[names[0]]:
        cells = []
        for name in names:
            r = by_key[name].get(key)
            cells.append("-" if r is None else "0" if r["differ"] == 0 else f"{r['differ']:.2%} / {r['max_abs']:.1e}")
        layer = "" if key[0] < 0 else str(key[0])
        lines.append(f"| {layer} | {key[1]} | " + " | ".join(cells) + " |")
    lines.append("")
    for name, s in trace["settings"].items():
        f = s["first"]
        lines.append(
            f"first divergence, {name}: "
            + (
                "none (bit for bit)"
                if f is None
                else f"{'' if f['layer'] < 0 else 'layer %d ' % f['layer']}{f['region']} "
                f"({f['differ']:.2%} of elements, max {f['max_abs']:.1e})"
            )
        )
    return "\n".join(lines)
