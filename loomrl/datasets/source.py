"""The prompt source of a run: samples read from shards, media decoded and
preprocessed once, served in a seeded shuffled order, epoch after epoch, with
a position that a checkpoint records."""
from __future__ import annotations

import random
import sys
from dataclasses import dataclass

from loomrl.encoders.media import Medium, load_medium
from loomrl.platform.recipe import ModelConfig


@dataclass
class PromptSample:
    record: dict            # id, prompt, answer, meta (what rewards see)
    ids: list[int]          # prompt token ids, markers expanded
    media: list[Medium]

    @property
    def id(self) -> str:
        return self.record["id"]


class PromptSource:
    def __init__(self, records: list[dict], model, tokenizer, cfg: ModelConfig, seed: int):
        self.samples: list[PromptSample] = []
        self.skipped: list[tuple[str, str]] = []
        for rec in records:
            try:
                media = [load_medium(kind, data, cfg) for kind, _, data in rec["media"]]
                ids = model.prompt_ids(tokenizer, rec["prompt"], media)
            except Exception as e:  # a bad sample is reported and counted, never silently lost
                self.skipped.append((rec.get("source", rec.get("id", "?")), f"{type(e).__name__}: {e}"))
                print(f"warning: skipping {self.skipped[-1][0]}: {self.skipped[-1][1]}", file=sys.stderr)
                continue
            record = {k: rec[k] for k in ("id", "prompt", "answer", "meta") if k in rec}
            self.samples.append(PromptSample(record, ids, media))
        if not self.samples:
            raise ValueError("no usable samples in the shards")
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.samples)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self, k: int) -> list[PromptSample]:
        out = []
        while len(out) < k:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._shuffled(self.epoch)
            out.append(self.samples[self._order[self.position]])
            self.position += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._shuffled(self.epoch)
