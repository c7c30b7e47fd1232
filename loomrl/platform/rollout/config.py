"""Settings of the rollout engines (`rollout`): sampling, the NgramRL drafter, vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from loomrl.config.schema import choice, ranged
from loomrl.platform.rollout.base import ROLLOUT_ENGINES


@dataclass
class DrafterConfig:
    """NgramRL: speculative decoding with a per-prompt history drafter."""

    enabled: bool = True
    """Draft tokens from earlier completions of the same prompt; the target verifies
    them exactly: the committed tokens are distributed as without drafting (the built-in
    engine: the same tokens for the same seed). With `adaptive` (the default) the built-in
    engine drafts only where it measurably makes the rollout faster, so it is on by default
    (`loomrl bench rollout`: 1.02x on the demo, where drafts are rarely accepted; on a
    Qwen2-0.5B-sized model forced to real rollouts 1.62x at T = 0.6, and 1.05x at T = 1.0, where
    drafting does not pay and it stays plain)."""
    k: int = ranged(8, ge=1)
    """Most tokens drafted per target forward."""
    adaptive: bool = True
    """Built-in engine: choose each forward's draft length (0, 1, 2, 4, ..., k) by the rate it
    gives, tokens committed per second with lookups and verification counted, so drafting does not
    run where it makes the rollout slower (rollout/draft_control.py), and cap each row's draft at
    twice what its last one got committed. The seconds come from a cost model of counted work
    (rows, positions scored, lookups) fitted once per run on a fixed schedule of forwards and kept
    in checkpoints, so seeded runs and resumes choose the same lengths; the choice, the model and
    the rates are logged (`draft_k_mean`, `draft_k_best`, `draft_cost_*_s`,
    `draft_k<k>_row_tokens_per_s`). In vLLM the same controller runs inside loomrl's proposer and
    chooses each scheduler step's draft length (k is vLLM's `num_speculative_tokens`, the longest
    draft). false: always draft up to k."""
    cost_cache: bool = True
    """With `adaptive`: adopt the cost model that the first run of this workload (engine, device,
    kernels, threads, model, k) fitted on this machine, kept in `$LOOMRL_CACHE_DIR/draft_cost.json`
    (by default `~/.cache/loomrl/`), and keep this run's fit there if it is the first, so two runs
    of one seed choose the same draft lengths. false: every run uses its own fit (a resume still
    restores it from the checkpoint)."""
    tree_nodes: int = ranged(0, ge=0)
    """Built-in engine: draft trees of up to this many tokens (k deep), several candidate
    continuations verified in one forward (0 = single drafts only). Trees commit more tokens per
    forward (`loomrl bench drafter`: 16 tokens, 1.30x / 1.34x SuffixDecoding on traces A / C)
    but score tree_nodes + 1 positions per row, which pays where extra positions are nearly free
    (a memory-bound accelerator) and did not measurably pay on a 2-core CPU, hence off by
    default. With `adaptive` a tree is one more choice beside the single drafts, taken where it
    measurably pays; without, every forward drafts a tree."""
    max_history: int = ranged(16, ge=1)
    """Finished completions kept per prompt (oldest evicted first)."""
    max_history_tokens: int = ranged(8192, ge=1)
    """Token cap of one prompt's history."""
    max_prompts: int = ranged(4096, ge=1)
    """Prompts whose histories are kept (least recently used evicted)."""
    global_history: int = ranged(256, ge=0)
    """Recent completions of any prompt kept as a weaker, cross-prompt draft source
    (0 = per-prompt histories only)."""
    prefetch_budget: int = ranged(0, ge=0)
    """Candidate (accepted length, bonus token) outcomes the prefetcher prepares per
    sequence while the target verifies (0 = no prefetch, plain lookups). Off by default: with
    16 the peer-sized job above ran 4.4x slower than TRL (a Python thread hand-off per token)."""
    compare_every: int = ranged(0, ge=0)
    """Every N RL steps also generate the same batch without drafting (same weights,
    timing only, discarded) and log the speed-up measured side by side (0 = never)."""


@dataclass
class VLLMConfig:
    """The vLLM rollout engine (`rollout.engine: vllm`)."""

    kv_cache_gib: int = ranged(1, ge=1)
    """KV-cache size in whole GiB on CPU (VLLM_CPU_KVCACHE_SPACE, unless the environment sets it)."""
    enforce_eager: bool = True
    """Run eagerly (no graph capture/compilation): starts in seconds."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and activations dtype inside vLLM (float32 matches the trainer to ~1e-6)."""
    multiprocessing: bool = False
    """Run vLLM's engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING); off
    runs it in this process, so nothing can be orphaned."""
    max_model_len: int = ranged(512, ge=1)
    """Longest prompt + completion vLLM accepts."""
    health_every: int = ranged(0, ge=0)
    """Every N RL steps, after the weight sync, sample two of that step's prompts again with
    vLLM and compare its log-probs with the trainer's forward under the new weights; log the
    mean |difference| (`vllm_sync_logp_diff`; 0 = never)."""


@dataclass
class RolloutConfig:
    """How rollouts are generated."""

    engine: str = choice(ROLLOUT_ENGINES, "torch")
    """Rollout engine. `torch`: the built-in KV-cached engine (colocated with
    the trainer, shares its weights). `vllm`: vLLM serves the language model
    (media encoded by the trainer's towers, passed as prompt embeddings); weights
    are synced in place after every optimizer step."""
    n: int = ranged(8, ge=1)
    """Samples per prompt (the GRPO group size)."""
    temperature: float = ranged(1.0, gt=0)
    """Sampling temperature; log-probs are reported for logits / temperature."""
    top_p: float = ranged(1.0, gt=0, le=1)
    """Nucleus sampling mass (1.0 = off). Below 1, both rollout engines report each token's log-prob
    under the renormalised nucleus it was drawn from (vLLM's processed log-probs); the importance
    ratio compares the trainer's full-distribution log-prob with it (the off-policy correction that
    truncation asks for), while `logp_mismatch`, `loomrl doctor` and the vLLM health check
    renormalise the trainer's log-prob over its own nucleus, so they measure arithmetic only."""
    max_new_tokens: int = ranged(20, ge=1)
    """Completion length cap."""
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    """NgramRL speculative decoding."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """Settings of the vLLM engine (used when `engine` is `vllm`)."""
