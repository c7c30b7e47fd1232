"""Learned reward models: a transformers sequence-classification model from a local
folder (nothing is downloaded; weights only from safetensors), scored in batches on
the trainer's device. The reward is the logit `label` of the model's head."""

from __future__ import annotations

from pathlib import Path

import torch


class RewardModel:
    """score(completions, samples) -> one float per completion.

    with_prompt: score the pair (sample["prompt"], completion), as a cross-encoder reward
    model reads it; otherwise the completion alone."""

    def __init__(
        self,
        path: str | Path,
        device: torch.device | str = "cpu",
        batch_size: int = 32,
        max_length: int = 512,
        label: int = 0,
        with_prompt: bool = True,
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"reward model {path}: no config.json (a local transformers folder is needed)")
        self.path = path
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = (
            AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True, use_safetensors=True)
            .to(device)
            .eval()
            .requires_grad_(False)
        )
        if self.tokenizer.pad_token_id is None:
            if self.tokenizer.eos_token_id is None:
                raise ValueError(f"reward model {path}: its tokenizer has neither a pad nor an eos token")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:  # decoder classifiers read the last non-pad token
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        if not 0 <= label < self.model.config.num_labels:
            raise ValueError(
                f"reward model {path}: label {label} but the head has {self.model.config.num_labels} output(s)"
            )
        self.device = torch.device(device)
        self.batch_size, self.max_length, self.label, self.with_prompt = batch_size, max_length, label, with_prompt

    def encode(self, completions: list[str], samples: list[dict]) -> dict:
        """The tokenizer's batch for these completions (padded, truncated, on the device)."""
        texts = ([s["prompt"] for s in samples], completions) if self.with_prompt else (completions,)
        enc = self.tokenizer(*texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        return {k: v.to(self.device) for k, v in enc.items()}

    @torch.no_grad()
    def score(self, completions: list[str], samples: list[dict]) -> list[float]:
        out: list[float] = []
        for i in range(0, len(completions), self.batch_size):
            enc = self.encode(completions[i : i + self.batch_size], samples[i : i + self.batch_size])
            out += self.model(**enc).logits[:, self.label].float().tolist()
        return out
