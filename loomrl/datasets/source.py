"""The prompt source of a run: samples streamed from shards (`ShardStream`: seeded
shuffle buffer, rank split, resumable position), media decoded and preprocessed
once per content hash (a bounded LRU), prompts tokenized for the policy.

A sample that cannot be read (damaged in the shard: see `ShardStream`), whose media
cannot be decoded (a clip over the length limit included), or whose prompt markers
do not match its media, is skipped, named in a warning (the `loomrl` logger) and
counted (`skipped`, kept in the checkpointed state), never silently lost; the
position moves past it, so a resumed run does not meet it again. A run that trains on
preference pairs (`require_pair`) skips a sample without one the same way (`bad-pair`). A whole epoch
without one usable sample is an error, not an endless loop.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from loomrl.config import RecipeError
from loomrl.datasets.preference import BAD_PAIR, PAIR_FIELDS, pair_problem
from loomrl.datasets.stream import ShardStream
from loomrl.encoders.base import load_medium, modalities
from loomrl.encoders.media import Medium, data_error
from loomrl.platform.backbone.config import ModelConfig

log = logging.getLogger(__name__)


ROLES = ("system", "user", "assistant")


def conversation_of(rec: dict) -> list[dict]:
    """The turns before a sample's prompt (`meta.conversation`, multi-turn data), each {role,
    content}; [] for a single-turn sample. ValueError for a value of another shape."""
    meta = rec.get("meta")
    turns = meta.get("conversation") if isinstance(meta, dict) else None
    if turns is None:
        return []
    if not isinstance(turns, list) or not all(
        isinstance(t, dict) and t.get("role") in ROLES and isinstance(t.get("content"), str) for t in turns
    ):
        raise ValueError("meta.conversation must be a list of {role: system|user|assistant, content: text}")
    return [{"role": t["role"], "content": t["content"]} for t in turns]


def reply_mask(model, tokenizer, pieces: list[tuple[str, bool]], media: list[Medium], ids: list[int]) -> list[int]:
    """1 on the token ids of the reply pieces and the end-of-turn token after each, 0 elsewhere:
    each piece tokenized with its own media, which must give `ids` (the whole prompt's tokens)."""
    markers = [m.marker for m in modalities()]
    out, mask, rest = [], [], list(media)
    for text, reply in pieces:
        n = sum(text.count(marker) for marker in markers)
        part = model.prompt_ids(tokenizer, text, rest[:n])
        rest = rest[n:]
        after_reply = not reply and mask and mask[-1] == 1 and part[:1] == [model.eos_token_id]
        mask += [1] + [0] * (len(part) - 1) if after_reply else [int(reply)] * len(part)
        out += part
    if out != ids or 1 not in mask:
        raise ValueError("its conversation does not tokenize the same cut at the replies as whole")
    return mask


@dataclass
class PromptSample:
    record: dict  # id, prompt, answer, meta (what rewards see); chosen, rejected of a preference pair
    ids: list[int]  # prompt token ids, markers expanded
    media: list[Medium]
    reply_mask: Optional[list[int]] = None  # multi-turn: 1 on the ids of the earlier assistant replies

    @property
    def id(self) -> str:
        return self.record["id"]


class PromptSource:
    def __init__(
        self,
        stream: ShardStream,
        model,
        tokenizer,
        cfg: ModelConfig,
        *,
        media_cache: int = 4096,
        render: Optional[Callable[..., str]] = None,
        pieces: Optional[Callable[[str, list], list]] = None,
    ):
        """render: (the prompt text, the earlier turns of its conversation) -> the model's input
        text (a chat template's `render`); None: as written (a multi-turn sample is then skipped).
        pieces: the same text cut at the earlier assistant replies (`ChatFormat.pieces`), for
        `reply_mask`."""
        self.stream = stream
        self.render, self.pieces = render, pieces
        self.require_answer = False  # supervised use: a sample without an answer is skipped (and counted)
        self.require_pair = False  # preference use (DPO): a sample without a good pair is skipped (`bad-pair`)
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.skipped: list[tuple[str, str]] = []
        self._warned: set[tuple[str, str]] = set()
        self.served = 0
        self.skipped_before = 0  # skipped before a resume (the list holds this process's)
        self._media: OrderedDict[str, Medium] = OrderedDict()
        self._media_cap = media_cache
        self._it: Optional[Iterator[dict]] = None
        self._state = stream.state()
        self._bad_since: Optional[int] = None  # epoch of the first of the current run of skipped samples

    def _medium(self, kind: str, digest: str, data: bytes) -> Medium:
        m = self._media.get(digest)
        if m is None:
            m = self._media[digest] = load_medium(kind, data, self.cfg)
        self._media.move_to_end(digest)
        while len(self._media) > self._media_cap:
            self._media.popitem(last=False)
        return m

    def _skip(self, where: str, why: str) -> None:
        """Count a skipped sample; warn the first time it is met (epochs meet it again)."""
        if (where, why) not in self._warned:
            self._warned.add((where, why))
            log.warning("warning: skipping %s: %s", where, why)
        self.skipped.append((where, why))

    def _prepare(self, rec: dict) -> Optional[PromptSample]:
        if "error" in rec:  # the stream could not read this sample from its shard
            self._skip(rec["source"], rec["error"])
            return None
        try:
            media = [self._medium(kind, digest, data) for kind, digest, data in rec["media"]]
            history = conversation_of(rec)
            if self.render is None and history:
                raise ValueError("a multi-turn sample (meta.conversation) needs a chat template (data.chat_template)")
            text = rec["prompt"] if self.render is None else self.render(rec["prompt"], history)
            ids = self.model.prompt_ids(self.tokenizer, text, media)
            replies = None
            if self.pieces is not None and any(t["role"] == "assistant" for t in history):
                replies = reply_mask(self.model, self.tokenizer, self.pieces(rec["prompt"], history), media, ids)
        except Exception as e:  # a bad sample is reported and counted, never silently lost
            self._skip(rec.get("source", rec.get("id", "?")), data_error(e))
            return None
        if self.require_answer and not rec.get("answer"):
            self._skip(rec.get("source", rec.get("id", "?")), "the sample has no answer to learn (supervised training)")
            return None
        if self.require_pair:
            problem = pair_problem(rec.get("chosen"), rec.get("rejected"))
            if problem is not None:
                self._skip(rec.get("source", rec.get("id", "?")), f"{BAD_PAIR}: {problem}")
                return None
        record = {k: rec[k] for k in ("id", "prompt", "answer", "meta", *PAIR_FIELDS) if k in rec}
        if self.require_pair and not record.get("answer"):  # what rewards read (validation): the chosen answer
            record["answer"] = record["chosen"]
        return PromptSample(record, ids, media, replies)

    def next(self, k: int) -> list[PromptSample]:
        """The next k usable samples (epochs roll over)."""
        if self._it is None:
            self._it = iter(self.stream)
        out: list[PromptSample] = []
        while len(out) < k:
            rec = next(self._it)
            self._state = self.stream.state_after(rec)
            sample = self._prepare(rec)
            if sample is not None:
                out.append(sample)
                self._bad_since = None
                continue
            epoch = rec["position"][0]
            if self._bad_since is None:
                self._bad_since = epoch
            elif epoch >= self._bad_since + 2:  # every sample of epoch _bad_since + 1 was skipped
                where, why = self.skipped[-1]
                raise RecipeError(
                    f"data.shards: no usable sample in a whole epoch of {len(self.stream.files)} "
                    f"shard(s): every one was skipped (the last: {where}: {why})"
                )
        self.served += len(out)
        return out

    def take(self, limit: int) -> list[PromptSample]:
        """Up to `limit` usable samples, until the stream ends (one pass of a validation split)."""
        out: list[PromptSample] = []
        for rec in self.stream:
            if len(out) >= limit:
                break
            sample = self._prepare(rec)
            if sample is not None:
                out.append(sample)
        return out

    def state(self) -> dict:
        """Position after the last sample served (JSON, for checkpoints)."""
        return dict(self._state, served=self.served, skipped=self.skipped_before + len(self.skipped))

    def load_state(self, state: dict) -> None:
        self.stream.load_state(state)
        self._state = self.stream.state()
        self.served = state.get("served", 0)
        self.skipped_before = state.get("skipped", 0) - len(self.skipped)
        self._it = None
