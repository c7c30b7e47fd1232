"""Chat templates (`data.chat_template`, `data.system_prompt`): prompts rendered as a user turn,
media markers expanded inside it, completions stopping at the template's end-of-turn token."""

import time

import pytest
from qwen_checkpoints import CHAT_TEMPLATE, _tokenizer

from loomrl.platform.backbone.chat import ChatFormat
from loomrl.platform.recipe import DataConfig, RecipeError


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return _tokenizer(
        tmp_path_factory.mktemp("tok"),
        words=["system", "user", "assistant", "what", "cat"],
        chat_template=CHAT_TEMPLATE,
    )


def test_renders_a_user_turn_and_stops_at_end_of_turn(tok):
    chat = ChatFormat(tok, DataConfig())
    assert chat.render("<image>what") == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<image>what<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat.stop_token_id == tok.convert_tokens_to_ids("<|im_end|>") != tok.eos_token_id


def test_system_prompt_replaces_the_default(tok):
    chat = ChatFormat(tok, DataConfig(system_prompt="cat"))
    assert chat.render("what").startswith("<|im_start|>system\ncat<|im_end|>\n<|im_start|>user\nwhat")


def test_none_and_a_template_file(tok, tmp_path):
    plain = ChatFormat(tok, DataConfig(chat_template="none"))
    assert plain.render("<image>what") == "<image>what" and plain.stop_token_id == tok.eos_token_id
    path = tmp_path / "t.jinja"
    path.write_text(
        "{% for m in messages %}[{{ m['content'] }}]<|im_end|>{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    chat = ChatFormat(tok, DataConfig(chat_template=str(path)))
    assert chat.render("what") == "[what]<|im_end|>>"
    assert chat.stop_token_id == tok.convert_tokens_to_ids("<|im_end|>")


def test_bad_settings_name_the_key(tok, tmp_path):
    with pytest.raises(RecipeError, match="data.chat_template"):
        ChatFormat(tok, DataConfig(chat_template=str(tmp_path / "missing.jinja")))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] | nosuchfilter }}{% endfor %}")
    with pytest.raises(RecipeError, match="data.chat_template: the template fails"):
        ChatFormat(tok, DataConfig(chat_template=str(broken)))
    with pytest.raises(RecipeError, match="data.system_prompt"):
        ChatFormat(tok, DataConfig(chat_template="none", system_prompt="cat"))


def test_media_expand_inside_the_turn_and_padding_is_never_sampled(tmp_path):
    """The policy's prompt ids: the template's tokens around `<|vision_start|>`, one placeholder
    per image token, `<|vision_end|>`; the end-of-turn token stops completions and Qwen's padding
    (which doubles as the base EOS) is banned once it no longer stops anything."""
    from qwen_checkpoints import _qwen2_vl

    from loomrl.encoders.base import load_medium
    from loomrl.platform import recipe as R
    from loomrl.platform.parts import build_policy_parts

    _qwen2_vl(tmp_path, words=["system", "user", "assistant", "what", "cat"], chat_template=CHAT_TEMPLATE)
    # sizes and tokenizer come from the checkpoint, the chat template from its tokenizer (`auto`)
    recipe = R.load_recipe(None, [f"model.init_from={tmp_path}"], files=False)
    tok, chat, model = build_policy_parts(recipe)
    end, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert model.eos_token_id == end
    assert pad in model.banned_token_ids.tolist() and end not in model.banned_token_ids.tolist()

    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((56, 56, 3), 128, np.uint8)).save(buf, format="PNG")
    image = load_medium("image", buf.getvalue(), model.cfg)
    ids = model.prompt_ids(tok, chat.render("<image>what"), [image])
    t = tok.convert_tokens_to_ids
    n = model.media_tokens(image)
    user = [
        t("<|im_start|>"),
        t("user"),
        t("<|vision_start|>"),
        *[t("<|image_pad|>")] * n,
        t("<|vision_end|>"),
        t("what"),
        end,
    ]
    assert n >= 1 and user == ids[ids.index(t("user")) - 1 : ids.index(end, ids.index(t("user"))) + 1]
    assert ids[-2:] == [t("<|im_start|>"), t("assistant")]


def test_a_multi_turn_sample_is_rendered_whole_and_sft_trains_every_reply(tmp_path):
    """A conversation (meta.conversation + the prompt as the last user turn): RL's prompt is the
    whole rendered history; SFT's loss covers exactly each assistant reply and its end-of-turn
    token plus the answer, checked token by token against a hand-written sequence."""
    import io

    import numpy as np
    from PIL import Image
    from qwen_checkpoints import _qwen2_vl

    from loomrl.datasets.shards import write_shards
    from loomrl.datasets.source import PromptSource
    from loomrl.datasets.stream import ShardStream
    from loomrl.platform import recipe as R
    from loomrl.platform.parts import build_policy_parts
    from loomrl.platform.supervised import SupervisedSteps
    from loomrl.platform.trajectory.batch import collate

    _qwen2_vl(
        tmp_path / "ckpt", words=["system", "user", "assistant", "what", "cat", "dog"], chat_template=CHAT_TEMPLATE
    )
    recipe = R.load_recipe(None, [f"model.init_from={tmp_path / 'ckpt'}"], files=False)
    tok, chat, model = build_policy_parts(recipe)
    buf = io.BytesIO()
    Image.fromarray(np.full((56, 56, 3), 90, np.uint8)).save(buf, format="PNG")
    conversation = [{"role": "user", "content": "<image>what"}, {"role": "assistant", "content": "cat"}]
    sample = {"id": "a", "prompt": "what", "answer": "dog", "meta": {"conversation": conversation}}
    write_shards([{**sample, "media": [("image", "img0.png", buf.getvalue())]}], str(tmp_path / "s-%d.tar"), 10)
    stream = ShardStream([str(tmp_path / "s-0.tar")], shuffle_buffer=0, epochs=1, rank=0, world_size=1)
    (s,) = PromptSource(stream, model, tok, model.cfg, render=chat.render, pieces=chat.pieces).next(1)

    t = tok.convert_tokens_to_ids
    start, end, n = t("<|im_start|>"), t("<|im_end|>"), model.media_tokens(s.media[0])
    system = [start, t("system"), *tok("You are a helpful assistant.", add_special_tokens=False)["input_ids"], end]
    image = [t("<|vision_start|>"), *[t("<|image_pad|>")] * n, t("<|vision_end|>")]
    context1 = [*system, start, t("user"), *image, t("what"), end, start, t("assistant")]
    context2 = [start, t("user"), t("what"), end, start, t("assistant")]
    assert s.ids == [*context1, t("cat"), end, *context2]  # RL's prompt: the whole history
    traj = SupervisedSteps.multi_turn_trajectory(s, [t("dog"), end])
    mb = collate([traj], model.pad_token_id)
    seq = mb.input_ids[0].tolist()
    trained = [seq[j + 1] for j in range(len(seq) - 1) if mb.loss_mask[0, j] == 1]
    assert seq == [*context1, t("cat"), end, *context2, t("dog"), end]
    assert trained == [t("cat"), end, t("dog"), end]  # the replies and their end-of-turn; no user or template token
    assert traj.trained_tokens() == 4


# Qwen2-VL's own chat template, as its checkpoints ship it (image / video parts, namespaces)
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# loops, range, tojson, the special tokens, whitespace control and loop controls
FEATURES_TEMPLATE = (
    "{{ bos_token or '' }}{%- for m in messages %}\n  {% for i in range(loop.index) %}{{ i }}{% endfor %}"
    "{% if m.role == 'system' %}{% continue %}{% endif %}"
    "[{{ m.role | upper }}] {{ m.content | tojson }}{{ eos_token }}\n{%- endfor %}"
    "{% if add_generation_prompt %}>>{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "what"}],
    [{"role": "system", "content": "cat"}, {"role": "user", "content": '<image>what "x" é'}],
    [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what"}]},
        {"role": "assistant", "content": "cat"},
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "and?"}]},
    ],
]


@pytest.mark.parametrize("source", [CHAT_TEMPLATE, QWEN2_VL_TEMPLATE, FEATURES_TEMPLATE])
def test_bounded_rendering_is_byte_identical_to_transformers(tok, source):
    from loomrl.platform.backbone.template_render import render_bounded

    for messages in CONVERSATIONS:
        if source == CHAT_TEMPLATE and not isinstance(messages[0]["content"], str):
            continue
        for gen in (False, True):
            want = tok.apply_chat_template(messages, chat_template=source, tokenize=False, add_generation_prompt=gen)
            assert render_bounded(tok, source, messages, gen) == want


HOSTILE_TEMPLATES = {
    # the hostile pass's template: 41 s and 7.1 GB before a MemoryError, without bounds
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "silent nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "output flood": "{% for i in range(1000) %}{{ 'x' * 100000 }}{% endfor %}",
    # no range, no output: the watchdog stops it (the content repeated at render time, not folded)
    "silent loop, no range": "{% for m in messages %}{% for c in m['content'] * 2000000 %}"
    "{% for d in m['content'] %}{% endfor %}{% endfor %}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_a_hostile_template_is_stopped_and_named(tok, tmp_path, name):
    """Before the bounds: nested ranges ran for tens of seconds to a MemoryError (the render was
    `tokenizer.apply_chat_template`, unbounded)."""
    path = tmp_path / "hostile.jinja"
    path.write_text(HOSTILE_TEMPLATES[name])
    t0 = time.monotonic()
    with pytest.raises(RecipeError, match=r"data.chat_template: the template is stopped \(.*hostile.jinja\)"):
        ChatFormat(tok, DataConfig(chat_template=str(path)))
    assert time.monotonic() - t0 < 5  # the render's bound is 2 s


def test_a_checkpoint_template_is_named_by_its_file(tmp_path):
    """`auto` takes the checkpoint's chat_template.jinja: a hostile one is named by that file."""
    from qwen_checkpoints import _tokenizer
    from transformers import AutoTokenizer

    _tokenizer(tmp_path, words=["what"], chat_template=HOSTILE_TEMPLATES["nested ranges"])
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    with pytest.raises(RecipeError, match=rf"the checkpoint's {tmp_path}/chat_template.jinja\): its loops"):
        ChatFormat(loaded, DataConfig())


def test_a_deeply_nested_tokenizer_json_is_named(tmp_path):
    """tokenizer.json nested 100000 deep: before, a RecursionError traceback from the loader."""
    from qwen_checkpoints import _tokenizer

    from loomrl.platform.backbone.tokenizer import json_depth, load_tokenizer

    _tokenizer(tmp_path, words=["what"])
    path = tmp_path / "tokenizer.json"
    text = path.read_text()
    path.write_text(text[: text.rindex("}")] + ', "x": ' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(ValueError, match=rf"{path}: JSON nested deeper than 64"):
        load_tokenizer(str(tmp_path))
    assert json_depth(b'{"a": "[[[{{", "b": [{"c": "\\"["}]}') == 3
    path.write_text(text)
    (tmp_path / "tokenizer_config.json").write_bytes(b" " * (17 << 20))
    with pytest.raises(ValueError, match="tokenizer_config.json: .* bytes, over the"):
        load_tokenizer(str(tmp_path))
