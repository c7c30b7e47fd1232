"""Native multimodal serving in vLLM, used by the tests as a reference: a HF Qwen2-VL / Qwen2.5-VL /
Qwen2-Audio folder served as it is, media in vLLM's multimodal input format, processed by the
model's own processor (`vllm_shims` lets Qwen2-VL's work without torchvision). Not wired to the
trainer (rollouts use the trainer's towers, `platform/rollout/vllm_engine.py`)."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Optional

import torch

from loomrl.platform.rollout import vllm_shims
from loomrl.platform.rollout.base import Rollout, RolloutResult, SamplingParams
from loomrl.platform.rollout.config import VLLMConfig
from loomrl.platform.rollout.vllm_engine import _set_vllm_env

# ---------------------------------------------------------------------- native multimodal serving
# A HF Qwen2-VL / Qwen2.5-VL / Qwen2-Audio folder served as it is: vLLM runs the model's own
# towers and its own processor + tokenizer (from the folder), prompts go in vLLM's multimodal
# format. This is the path for checkpoints trained elsewhere, and what a GPU job serves.

NATIVE_MODALITY = {"qwen2_vl": "image", "qwen2_5_vl": "image", "qwen2_audio": "audio"}


def start_native(folder: str, cfg: Optional[VLLMConfig] = None, seed: int = 0, media_per_prompt: int = 1):
    """Start vLLM on a HF folder (config.json, safetensors in the hub key layout, tokenizer and
    processor configs). Returns the `vllm.LLM`; stop it with `shutdown_native`. Video is off
    (limit 0): without torchvision it could not be processed (see `vllm_shims`)."""

    cfg = cfg or VLLMConfig()
    model_type = json.loads(Path(folder, "config.json").read_text()).get("model_type")
    if model_type not in NATIVE_MODALITY:
        raise ValueError(
            f"{folder}/config.json: model_type {model_type!r} is not served natively "
            f"(expected one of {sorted(NATIVE_MODALITY)})"
        )
    limits = {NATIVE_MODALITY[model_type]: media_per_prompt}
    if NATIVE_MODALITY[model_type] == "image":
        limits["video"] = 0
    _set_vllm_env(cfg)

    vllm_shims.apply()
    from vllm import LLM

    set_threads = torch.set_num_threads  # vLLM's CPU worker replaces it process-wide
    try:
        return LLM(
            model=folder,
            dtype=cfg.dtype,
            enforce_eager=cfg.enforce_eager,
            seed=seed,
            enable_prefix_caching=False,
            max_model_len=cfg.max_model_len,
            max_num_batched_tokens=max(8192, 64 * cfg.max_model_len),
            max_num_seqs=1024,
            limit_mm_per_prompt=limits,
            logprobs_mode="processed_logprobs",
        )
    finally:
        torch.set_num_threads = set_threads


def media_token_ids(hf_config) -> list[int]:
    """The media placeholder ids of a Qwen2-VL / Qwen2.5-VL / Qwen2-Audio config. A sampled
    placeholder would break the next forward (placeholders must match media features), so
    `generate_native` never samples them."""
    names = ("image_token_id", "video_token_id", "audio_token_index", "audio_token_id")
    return sorted({int(getattr(hf_config, n)) for n in names if getattr(hf_config, n, None) is not None})


def shutdown_native(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def generate_native(
    llm, prompts: list[dict], params: SamplingParams, generator: Optional[torch.Generator] = None
) -> tuple[RolloutResult, list[list[int]]]:
    """n samples per prompt from a `start_native` engine. prompts: vLLM's own format,
    `{"prompt": text with the model's media placeholder, "multi_modal_data": {"image": PIL image}}`
    or `{"audio": (float array, sample_rate)}`. Returns the grouped rollouts and each prompt's
    token ids as the model's processor expanded them (what the trainer's forward needs to score
    the completions). Log-probs are after temperature, of the distribution without the media
    placeholders (`media_token_ids`; the trainer masks them the same way). `forwards` is not
    counted here (0): `LLM.generate` runs the scheduler steps itself."""
    from vllm import SamplingParams as VSP

    start = time.perf_counter()
    model_config = llm.llm_engine.model_config
    banned = set(media_token_ids(model_config.hf_config))
    allowed = [i for i in range(model_config.get_vocab_size()) if i not in banned]
    seeds = torch.randint(
        0,
        2**31 - 1,
        (len(prompts) * params.n,),
        generator=generator,
        device=generator.device if generator is not None else None,
    ).tolist()
    # one request per sample, each with its own seed (as in VLLMRolloutEngine.generate)
    sps = [
        VSP(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_new_tokens,
            logprobs=0,
            seed=seed,
            detokenize=False,
            allowed_token_ids=allowed,
        )
        for seed in seeds
    ]
    outs = llm.generate([p for p in prompts for _ in range(params.n)], sps, use_tqdm=False)
    rollouts, prompt_ids = [], []
    for i, out in enumerate(outs):
        pi, j = divmod(i, params.n)
        if j == 0:
            prompt_ids.append(list(out.prompt_token_ids))
        c = out.outputs[0]
        ids = list(c.token_ids)
        rollouts.append(
            Rollout(
                pi,
                j,
                ids,
                [float(lp[t].logprob) for t, lp in zip(ids, c.logprobs)],
                "stop" if c.finish_reason == "stop" else "length",
            )
        )
    tokens = sum(len(r.completion_ids) for r in rollouts)
    return RolloutResult(rollouts, 0, time.perf_counter() - start, tokens), prompt_ids
