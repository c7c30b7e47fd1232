"""The demo task: describe a procedural picture and/or tone in a short sentence.

Every prompt has an image, an audio clip or both. Images are a small or large
coloured disc or square (the outline is a distractor, not asked for) on a
dark, noisy background; clips are a low, middle or high sine tone over noise. The answer is
a fixed sentence template whose slot words name what is seen and heard, e.g.
"the picture shows a large red shape on a dark background ." The sample metadata
carries the template, the true slot words and each slot's choices, so the
`slot_match` reward can score a completion and a `format` warm-up can teach
the sentence shape without the content.
"""

from __future__ import annotations

import io
import math
import random

import numpy as np
import soundfile as sf
from PIL import Image, ImageDraw

from loomrl.datasets.shards import write_shards

COLORS = {"red": (215, 45, 40), "green": (40, 190, 70), "blue": (50, 90, 235)}
SIZES = {"small": (5, 9), "large": (16, 22)}  # radius range in pixels of a 64x64 image
OUTLINES = ("circle", "square")
PITCHES = {"low": 250.0, "middle": 700.0, "high": 2000.0}

TASKS = {
    "image": ("<image> describe the picture .", "the picture shows a {size} {color} shape on a dark background ."),
    "audio": ("<audio> describe the sound .", "the sound is a {pitch} tone played over soft noise ."),
    "both": (
        "<image> <audio> describe the picture and the sound .",
        "a {size} {color} shape is shown while a {pitch} tone plays .",
    ),
}
CHOICES = {"size": list(SIZES), "color": list(COLORS), "pitch": list(PITCHES)}


def vocabulary() -> list[str]:
    words = set()
    for prompt, answer in TASKS.values():
        words.update(prompt.split())
        words.update(w for w in answer.split() if not w.startswith("{"))
    for choices in CHOICES.values():
        words.update(choices)
    return sorted(words)


def render_image(color: str, size_word: str, rng: random.Random, size: int = 64) -> bytes:

    noise = np.random.default_rng(rng.getrandbits(32)).integers(0, 40, (size, size, 3), dtype=np.uint8)
    img = Image.fromarray(noise + 20)
    draw = ImageDraw.Draw(img)
    r = rng.randint(*SIZES[size_word])
    cx, cy = rng.randint(r + 2, size - r - 2), rng.randint(r + 2, size - r - 2)
    jitter = tuple(max(0, min(255, c + rng.randint(-25, 25))) for c in COLORS[color])
    box = (cx - r, cy - r, cx + r, cy + r)
    (draw.ellipse if rng.choice(OUTLINES) == "circle" else draw.rectangle)(box, fill=jitter)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def render_tone(pitch: str, rng: random.Random, sample_rate: int = 16000, seconds: float = 1.0) -> bytes:

    n = int(sample_rate * seconds)
    t = np.arange(n) / sample_rate
    f = PITCHES[pitch] * (2 ** (rng.uniform(-0.25, 0.25)))
    onset, length = rng.uniform(0.0, 0.3), rng.uniform(0.4, 0.7)
    env = ((t >= onset) & (t < onset + length)).astype(np.float32)
    noise = np.random.default_rng(rng.getrandbits(32)).normal(0, 0.02, n)
    wave = 0.4 * env * np.sin(2 * math.pi * f * t + rng.uniform(0, 6.28)) + noise
    buf = io.BytesIO()
    sf.write(buf, wave.astype(np.float32), sample_rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def make_sample(index: int, rng: random.Random) -> dict:
    """One demo sample: {id, prompt, answer, meta, media: [(kind, filename, bytes)]}."""
    kind = ("image", "audio", "both")[index % 3]
    prompt, template = TASKS[kind]
    slots = {}
    media = []
    if kind in ("image", "both"):
        slots["size"], slots["color"] = rng.choice(CHOICES["size"]), rng.choice(CHOICES["color"])
        media.append(("image", "img0.png", render_image(slots["color"], slots["size"], rng)))
    if kind in ("audio", "both"):
        slots["pitch"] = rng.choice(CHOICES["pitch"])
        media.append(("audio", "aud0.wav", render_tone(slots["pitch"], rng)))
    meta = {"task": kind, "template": template, "slots": slots, "choices": {k: CHOICES[k] for k in slots}}
    return {
        "id": f"demo-{index:06d}",
        "prompt": prompt,
        "answer": template.format(**slots),
        "meta": meta,
        "media": media,
    }


def write_demo_shards(directory: str, samples: int, samples_per_shard: int, seed: int) -> list[str]:

    rng = random.Random(seed)
    return write_shards((make_sample(i, rng) for i in range(samples)), f"{directory}/demo-%06d.tar", samples_per_shard)


def format_only_answer(meta: dict, rng: random.Random) -> str:
    """The answer template with every slot filled at random from its choices."""
    return meta["template"].format(**{k: rng.choice(v) for k, v in meta["choices"].items()})
