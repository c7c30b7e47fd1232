"""Validation during a run, a part of the Trainer (trainer.py): the held-out split
(`validation.shards`, checked against the rewards before any training) and its completions by the
current policy, scored by the run's rewards (`val_*` metrics); a DPO run's split is held-out pairs, and
adds their margin (`PreferenceSteps.pair_figures`). Mixed into `Trainer`."""

from __future__ import annotations

import logging
import math
import time

import torch

from loomrl.platform import recipe as R
from loomrl.platform.parts import prompt_source, to_prompts
from loomrl.platform.rewards import RewardError
from loomrl.platform.rewards.sources import score
from loomrl.platform.rollout.base import SamplingParams
from loomrl.platform.rollout.torch_engine import TorchRolloutEngine

log = logging.getLogger("loomrl")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate that at least one of k samples is correct, from n samples of which c
    are (Chen et al. 2021): 1 - C(n - c, k) / C(n, k)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at(owners: list[int], rewards: list[float], k: int, threshold: float) -> dict[str, float]:
    """`val_pass@1` and `val_pass@k` over the prompts: owners[i] is the prompt of completion i."""
    correct: dict[int, list[bool]] = {}
    for owner, reward in zip(owners, rewards):
        correct.setdefault(owner, []).append(reward >= threshold)
    counts = [(len(xs), sum(xs)) for xs in correct.values()]
    return {
        "val_pass@1": sum(pass_at_k(n, c, 1) for n, c in counts) / len(counts),
        f"val_pass@{k}": sum(pass_at_k(n, c, k) for n, c in counts) / len(counts),
    }


class Validation:
    """The Trainer's validation (see the module docstring)."""

    def validation_split(self) -> list:
        """The held-out prompts (validation.shards): the first validation.samples usable ones, in
        shard order, the same at every validation."""

        r = self.recipe
        if r.validation.shards is None:
            return []
        files = R.expand_pattern(r.validation.shards, "validation.shards")
        if not files:
            raise R.RecipeError(f"validation.shards: no files match {r.validation.shards!r}")
        source = prompt_source(r, files, self.model, self.tokenizer, self.chat, one_pass=True)
        source.require_pair = self.preference  # DPO: held-out pairs
        samples = source.take(r.validation.samples)
        if not samples:
            raise R.RecipeError(
                f"validation.shards: no usable sample in {len(files)} shard(s) "
                f"({len(source.skipped)} skipped, see the warnings above)"
            )
        if len(samples) < r.validation.samples:
            log.warning(
                "[run] validation.samples: %d asked for, the split has %d usable", r.validation.samples, len(samples)
            )

        records = [s.record for s in samples]
        for source in self.reward_fn:  # what each reward reads (the answer) is there, before any training
            if source.fn is not None:
                try:
                    source.score([""] * len(records), records)
                except RewardError as e:
                    raise R.RecipeError(f"validation.shards: {e}") from None
        return samples

    def validate(self, step: int) -> dict:
        """Completions of the held-out prompts by the current policy (the built-in engine on the
        trainer's weights, greedy unless validation.temperature > 0), scored by the run's rewards.
        Rank 0 alone runs it (other ranks go on to the next step's collectives)."""

        v, ro = self.recipe.validation, self.recipe.rollout
        t0 = time.perf_counter()
        engine = TorchRolloutEngine(self.model, None)
        params = SamplingParams(
            n=v.samples_per_prompt,
            temperature=v.temperature,
            top_p=ro.top_p if v.temperature > 0 else 1.0,
            max_new_tokens=v.max_new_tokens or ro.max_new_tokens,
        )
        # the same draws at every validation
        generator = torch.Generator(self.model.device).manual_seed(self.recipe.training.seed + 7919)
        texts, lengths, stops, owners = [], [], 0, []
        for i in range(0, len(self.val_samples), v.batch_size):
            chunk = self.val_samples[i : i + v.batch_size]
            result = engine.generate(to_prompts(chunk), params, generator)
            for rollout in result.rollouts:
                texts.append(self.tokenizer.decode(rollout.completion_ids, skip_special_tokens=True))
                lengths.append(len(rollout.completion_ids))
                stops += rollout.finish_reason == "stop"
                owners.append(i + rollout.prompt_index)
        totals, by_source = score(self.reward_fn, texts, [self.val_samples[j].record for j in owners])
        n = len(texts)
        out = {"val_reward_mean": sum(totals) / n, "val_response_len": sum(lengths) / n, "val_stop_rate": stops / n}
        if len(by_source) > 1:
            out.update({f"val_reward_{name}_mean": sum(xs) / n for name, xs in by_source.items()})
        if v.samples_per_prompt > 1:
            out.update(pass_at(owners, totals, v.samples_per_prompt, v.pass_threshold))
        if self.preference:  # DPO: the held-out pairs' margin under the policy and the reference
            out.update(self.pair_figures())
        out["val_s"] = time.perf_counter() - t0
        self.validations.append({"step": step, **out})
        log.info(
            "[val] step %d: reward %.3f on %d held-out prompts, %.1f tokens/response (%.1fs)",
            step,
            out["val_reward_mean"],
            len(self.val_samples),
            out["val_response_len"],
            out["val_s"],
        )
        if self.preference:
            log.info(
                "[val] step %d: held-out pairs: DPO margin %+.4f, accuracy %.3f, logp gap %+.3f",
                step,
                out["val_dpo_margin"],
                out["val_dpo_accuracy"],
                out["val_logp_gap"],
            )
        return out
