"""Chat templates: how a sample's prompt becomes the text an Instruct checkpoint expects.

A shard prompt is plain text with loomrl's media markers (`<image>`, `<audio>`). With a
chat template (`data.chat_template`: `auto` takes the tokenizer's own, a path names a
Jinja file, `none` turns it off), the prompt is rendered as one user turn, after an
optional system turn (`data.system_prompt`), with the generation prompt appended:

    <|im_start|>system ...<|im_end|>
    <|im_start|>user
    <image>What animal is this?<|im_end|>
    <|im_start|>assistant

The markers pass through the template as text and are expanded afterwards
(`VLM.prompt_ids`: `<|vision_start|>`, the placeholders, `<|vision_end|>`), which is
what Qwen-VL's own processor writes for an image part placed before the text.

A multi-turn sample (`meta.conversation`: the turns before its prompt, each {role, content},
markers in the content) is rendered whole: system, the earlier turns, then the prompt as the last
user turn, so RL sees the history. SFT trains on every assistant turn of it (`pieces`: the rendered
conversation cut at each reply, the replies marked trained) and on the answer. A conversation needs
a chat template: without one such a sample is skipped, named and counted.

A completion ends at the template's end-of-turn token (`<|im_end|>` for Qwen), found by
rendering a two-turn conversation and reading the first special token after the
assistant's text; SFT targets end with it too, so what SFT teaches is what rollouts stop at.
Without a template, prompts are used as written and completions end at the tokenizer's EOS.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from loomrl.config import RecipeError
from loomrl.datasets.config import DataConfig
from loomrl.platform.backbone.template_render import TemplateLimit, render_bounded

log = logging.getLogger("loomrl")

MAX_TEMPLATE_BYTES = 1 << 20


class ChatFormat:
    """Renders prompts with a chat template (or passes them through) and names the stop token."""

    def __init__(self, tokenizer, data: DataConfig):
        self.tokenizer = tokenizer
        self.system_prompt = data.system_prompt
        self.template = self._template(tokenizer, data.chat_template)
        self.where = self._where(tokenizer, data.chat_template)
        if self.template is None and self.system_prompt:
            why = "is 'none'" if data.chat_template == "none" else "is 'auto' and the tokenizer has none"
            raise RecipeError(
                f"data.system_prompt: needs a chat template to be placed in, but data.chat_template {why}"
            )
        self.stop_token_id = tokenizer.eos_token_id if self.template is None else self._end_of_turn()

    @staticmethod
    def _template(tokenizer, spec: str) -> Optional[str]:
        if spec == "none":
            return None
        if spec == "auto":
            return getattr(tokenizer, "chat_template", None) or None
        path = Path(spec)
        try:
            if not path.is_file():
                raise RecipeError(f"data.chat_template: {spec!r} is not 'auto', 'none' nor a template file")
            if path.stat().st_size > MAX_TEMPLATE_BYTES:
                raise RecipeError(f"data.chat_template: {spec} is over {MAX_TEMPLATE_BYTES} bytes")
            return path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise RecipeError(f"data.chat_template: cannot read {spec}: {e}") from None

    @staticmethod
    def _where(tokenizer, spec: str) -> str:
        """How an error names the template: the file it came from."""
        if spec != "auto":
            return spec
        folder = Path(getattr(tokenizer, "name_or_path", "") or ".")
        for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"):
            if (folder / name).is_file():
                return f"auto: the checkpoint's {folder / name}"
        return "auto: the tokenizer's own"

    def _apply(self, messages: list[dict], generation_prompt: bool) -> str:
        """The template rendered under bounds (template_render.py): time, output size, loop items."""
        assert self.template is not None
        try:
            return render_bounded(self.tokenizer, self.template, messages, generation_prompt)
        except TemplateLimit as e:
            raise RecipeError(f"data.chat_template: the template is stopped ({self.where}): {e}") from None
        except Exception as e:  # noqa: BLE001 - a Jinja template runs arbitrary logic: any failure is the template's
            raise RecipeError(
                f"data.chat_template: the template fails to render a conversation ({self.where}): "
                f"{type(e).__name__}: {str(e)[:300]}"
            ) from None

    def _messages(self, text: str, history: list[dict] | None = None) -> list[dict]:
        """data.system_prompt (unless the conversation has its own system turn), the earlier turns,
        then `text` as the last user turn."""
        history = list(history or [])
        own = any(t["role"] == "system" for t in history)
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt and not own else []
        return system + history + [{"role": "user", "content": text}]

    def _end_of_turn(self) -> int:
        """The first special token the template writes after an assistant turn's text."""
        reply = "loomrl-reply-probe"
        text = self._apply(self._messages("question") + [{"role": "assistant", "content": reply}], False)
        if reply not in text:
            raise RecipeError("data.chat_template: the template does not write the assistant's reply")
        after = self.tokenizer(text[text.rindex(reply) + len(reply) :], add_special_tokens=False)["input_ids"]
        special = set(self.tokenizer.all_special_ids) | {
            i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special
        }
        special.discard(self.tokenizer.unk_token_id)  # text the vocabulary lacks, not a marker
        for i in after:
            if i in special:
                return i
        if self.tokenizer.eos_token_id is None:
            raise RecipeError(
                "data.chat_template: no special token ends an assistant turn, and the tokenizer "
                "has no EOS token to stop completions at"
            )
        log.warning(
            "[data] the chat template ends an assistant turn with no special token; completions stop at "
            "the tokenizer's EOS (%s)",
            self.tokenizer.eos_token,
        )
        return self.tokenizer.eos_token_id

    def render(self, prompt: str, history: list[dict] | None = None) -> str:
        """The model's input text for one prompt, after the earlier turns of its conversation
        (`history`; markers kept for `VLM.prompt_ids`)."""
        if self.template is None:
            if history:
                raise ValueError("a multi-turn sample (meta.conversation) needs a chat template (data.chat_template)")
            return prompt
        return self._apply(self._messages(prompt, history), True)

    def pieces(self, prompt: str, history: list[dict]) -> list[tuple[str, bool]]:
        """The rendered conversation (as `render`) cut into (text, is_reply) pieces: each earlier
        assistant turn's content is a reply piece, what the template writes around it is not.
        ValueError when the template does not render a conversation's start as a prefix of it."""
        messages = self._messages(prompt, history)
        full = self.render(prompt, history)
        out, pos = [], 0
        for j, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._apply(messages[:j], True)  # ends with the generation prompt of turn j
            if not (full.startswith(before) and full.startswith(m["content"], len(before))):
                raise ValueError(
                    f"the chat template does not write assistant turn {j} after the turns before it as they "
                    f"render alone; its replies cannot be trained on"
                )
            out += [(full[pos : len(before)], False), (m["content"], True)]
            pos = len(before) + len(m["content"])
        return out + [(full[pos:], False)]

    def describe(self) -> str:
        if self.template is None:
            return "no chat template (prompts as written)"
        return f"chat template, completions end at {self.tokenizer.convert_ids_to_tokens(self.stop_token_id)!r}"
