"""What the built-in rollout engine holds on a trainer rank, for `loomrl plan`: its registered
`sequence_length` and `memory` traits (loomrl/platform/memory.py says what the traits are).

The engine samples from the trainer's own policy (no weights of its own), so it adds its KV cache
for one step's share of rollouts: 2 (keys, values) x layers x kv heads x head_dim x tokens x rows x
4 bytes (float32). It is bounded by no length of its own: a sequence is taken to be
`PROMPT_ALLOWANCE` prompt tokens + `rollout.max_new_tokens`. Kept beside torch_engine.py, which
registers them, so the engine's module stays within the size of a module.
"""

from __future__ import annotations

from loomrl.platform.memory import MemoryTerm, ModelSizes

PROMPT_ALLOWANCE = 512  # prompt tokens assumed without vLLM's max_model_len


def sequence_length(rollout) -> tuple[int, str]:
    """(tokens per sampled sequence, where that figure comes from): the prompt allowance + the completion cap."""
    return (
        PROMPT_ALLOWANCE + rollout.max_new_tokens,
        f"{PROMPT_ALLOWANCE} prompt tokens + rollout.max_new_tokens; --seq-len to set it",
    )


def rollout_memory(sizes: ModelSizes, rollout, *, seq_len: int, rollouts: int) -> MemoryTerm:
    """The KV cache of `rollouts` rows of `seq_len` tokens (one step's share of a rank), in float32."""
    head_dim = sizes.head_dim or sizes.hidden_size // sizes.num_heads
    return MemoryTerm(
        2 * sizes.num_layers * sizes.num_kv_heads * head_dim * seq_len * rollouts * 4,
        f"built-in engine KV cache: 2 x {sizes.num_layers} layers x {sizes.num_kv_heads} kv heads x "
        f"{head_dim} x {seq_len} tokens x {rollouts} rows x 4 B (weights: the policy's)",
    )
