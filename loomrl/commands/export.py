"""`loomrl export`: a run's checkpoint as a Hugging Face model folder that transformers
loads (`from_pretrained`) and vLLM serves (`vllm serve DIR`).

A checkpoint (`RUN/checkpoints/step-N/`) holds loomrl's own weights; what they mean (sizes,
tokenizer, the checkpoint the policy started from) is in the run's `RUN/recipe.yaml`. The
export rebuilds the policy exactly as the trainer did (`parts.build_policy_parts`: tokenizer,
chat format, `build_policy`), loads the checkpoint into it (`load_checkpoint`: the manifest's
sha256 sums verified, nothing unpickled) and writes, with `hf_io.export_policy`:

    config.json + model*.safetensors   the HF model of one modality: image -> Qwen2-VL /
                                       Qwen2.5-VL, audio -> Qwen2-Audio, text -> Qwen2ForCausalLM
    tokenizer files                    `save_pretrained` of the run's tokenizer, with the chat
                                       template the run rendered prompts with (a file named by
                                       `data.chat_template` included)
    preprocessor_config.json           image / audio only: init_from's, with the settings that
                                       decide what the policy saw (image sizes, patch and merge
                                       sizes, CLIP mean/std; mel bins, rate, clip length) set to
                                       the recipe's; written from the recipe when init_from has none
    generation_config.json             eos = where the run's completions ended (the chat
                                       template's end-of-turn, else the tokenizer's EOS), pad

The modality is init_from's (qwen2_vl / qwen2_5_vl / qwen3_vl -> image, qwen2_audio -> audio, qwen2 ->
text); a policy with no init_from (the demo: both towers) needs it named. config.json gets the
token ids a server needs beyond `export_policy`'s (vision start/end, video, eos, pad).

Guarantees: the folder appears whole or not at all (filled as a hidden folder `.OUT.export-PID`
beside `out`, fsynced, renamed into place; such a folder of an export that died, its PID gone, is
removed by the next export there); its files are 0666 less the umask; an existing non-empty `out`
is refused unless `overwrite`; an `out` that holds the checkpoint, lies in a run folder, is the
working directory or a mount point is always refused; a link to a folder is followed; every
problem with the run folder or the checkpoint is a ValueError (an OSError for the file system)
naming the file.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from safetensors import safe_open

from loomrl.encoders.audio import HOP, N_FFT, num_frames
from loomrl.platform import recipe as R
from loomrl.platform.backbone.hf_io import export_policy
from loomrl.platform.checkpoint import _fsync, latest_checkpoint, load_checkpoint
from loomrl.platform.faults import maybe_die
from loomrl.platform.parts import build_policy_parts

log = logging.getLogger("loomrl")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODALITIES = ("image", "audio", "text")
MODALITY_OF = {"qwen2_vl": "image", "qwen2_5_vl": "image", "qwen3_vl": "image", "qwen2_audio": "audio", "qwen2": "text"}
"""The modality of an init_from checkpoint, by its config.json's model_type."""
NO_REWARDS = ["algorithm.reward=slot_match", "algorithm.rewards=[]"]
"""Overrides that set a run's reward sources aside when its recipe is read for an export."""
_STORED = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint folder (`step-N`); a run folder or its `checkpoints/`: the newest checkpoint."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: not a checkpoint folder (RUN/checkpoints/step-N) nor a run folder")
    if (path / "checkpoints").is_dir() or (path / "recipe.yaml").is_file():  # a run folder
        path = path / "checkpoints"
    elif latest_checkpoint(path) is None:
        return path  # a step-N folder (load_checkpoint says what is wrong with anything else)
    newest = latest_checkpoint(path)
    if newest is None:
        raise ValueError(f"{path}: no checkpoint (step-N folder) to export")
    return newest


def run_recipe(checkpoint: Path) -> R.Recipe:
    """The recipe of the run a checkpoint belongs to (RUN/recipe.yaml beside RUN/checkpoints/).
    Only what builds the policy must be here: the shards need not be, and the reward sources
    (code or reward models the export never calls) are set aside before validation, so a reward
    module that was importable only where the run ran does not block its export."""
    file = checkpoint.resolve().parent.parent / "recipe.yaml"
    if not file.is_file():
        raise ValueError(
            f"{file}: not found; a checkpoint is exported from its run folder "
            f"(RUN/checkpoints/step-N beside RUN/recipe.yaml, which says what the weights are)"
        )
    try:
        recipe = R.load_recipe(file, NO_REWARDS, files=False)
    except R.RecipeError as e:
        raise ValueError(str(e) if str(file) in str(e) else f"{file}: {e}") from None
    problems = [p for p in R.file_problems(recipe) if p.startswith("model.")]  # tokenizer, init_from
    if problems:
        raise ValueError(f"{file}: {problems[0]}")
    return recipe


def choose_modality(model, init_from: Optional[str], modality: Optional[str]) -> str:
    """The HF model to write: `modality` if given (the policy must read that medium), else
    init_from's; a policy with no init_from must name it when it reads two media (the demo)."""
    readable = [
        kind
        for kind, tower in (("image", "visual"), ("audio", "audio_tower"))
        if getattr(model, tower, None) is not None and getattr(model, f"{kind}_token_id") is not None
    ]
    source = None
    if init_from is not None:
        source = _read_json(Path(init_from) / "config.json").get("model_type")
    if modality is None:
        if source is not None:
            modality = MODALITY_OF.get(source)
            if modality is None:
                raise ValueError(
                    f"{init_from}/config.json: model_type {source!r} has no export "
                    f"(expected one of {sorted(MODALITY_OF)})"
                )
        elif len(readable) <= 1:
            modality = readable[0] if readable else "text"
        else:
            raise ValueError(
                f"the policy has no model.init_from and reads {' and '.join(readable)}: "
                f"name the model to write with --modality image|audio|text (image: Qwen2-VL, "
                f"audio: Qwen2-Audio, text: Qwen2ForCausalLM, the language model alone)"
            )
    if modality not in MODALITIES:
        raise ValueError(f"modality {modality!r}: expected one of {', '.join(MODALITIES)}")
    if modality != "text" and modality not in readable:
        started = f"model.init_from is a {source} checkpoint" if source else "model.init_from is null"
        raise ValueError(
            f"--modality {modality}: the policy has no {modality} tower or token ({started}); "
            f"it can be exported as {' or '.join(readable + ['text'])}"
        )
    return modality


def export_checkpoint(
    checkpoint: Path,
    out: Path,
    dtype: str | torch.dtype | None = None,
    modality: Optional[str] = None,
    overwrite: bool = False,
) -> Path:
    """Write the policy of `checkpoint` (a `step-N` folder, or a run folder: its newest) as a
    Hugging Face folder `out`; returns `out`.

    dtype: "float32" / "bfloat16" (None: the checkpoint's). modality: "image", "audio" or
    "text" (None: init_from's). overwrite: replace an existing non-empty `out`."""

    checkpoint, out = resolve_checkpoint(Path(checkpoint)), Path(out)
    if out.is_symlink() and out.is_dir():  # a link to a folder: the export goes where it points
        out = out.resolve()
    _check_out(out, checkpoint, overwrite)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    recipe = run_recipe(checkpoint)
    tokenizer, chat, model = build_policy_parts(recipe)
    load_checkpoint(checkpoint, model)  # verified against its manifest, or a ValueError naming the file
    model.eval()
    init_from = recipe.model.init_from
    modality = choose_modality(model, init_from, modality)
    dtype = dtype or _stored_dtype(checkpoint / "model.safetensors")

    # a hidden staging folder beside `out` (same file system: the final rename is atomic); the
    # folder is filled at stage/hf, export_policy's own temporary folder lands in the stage too
    stage = out.parent / f".{out.name}.export-{os.getpid()}"
    tmp = stage / "hf"
    _remove_stale_stages(out.parent)
    _remove(stage)
    stage.mkdir(parents=True)
    try:
        export_policy(model, tmp, modality, dtype)
        config = _complete_config(_read_json(tmp / "config.json"), model, tokenizer, modality, init_from)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if chat.template is not None:  # the template prompts were rendered with (a file's, too)
            tokenizer.chat_template = chat.template
        tokenizer.save_pretrained(tmp)
        pre = preprocessor_config(recipe.model, config["model_type"], init_from)
        if pre is not None:
            (tmp / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
        gen = generation_config(model, tokenizer, init_from)
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        _set_modes(tmp)
        for p in tmp.iterdir():
            _fsync(p)
        _fsync(tmp)
        maybe_die("export")  # tests: killed with the folder filled, before it is renamed into place
        _replace(tmp, out, stage / "old")
    finally:
        _remove(stage)
    params = _count_params(out)
    log.info(
        "[export] %s -> %s: %s, %.2fM params, %s",
        checkpoint.name,
        out,
        config["architectures"][0],
        params / 1e6,
        str(dtype).removeprefix("torch."),
    )
    log.info("[export] wrote %s", ", ".join(sorted(p.name for p in out.iterdir())))
    return out


# --------------------------------------------------------------------------- the files beside the weights


def _complete_config(config: dict, model, tokenizer, modality: str, init_from: Optional[str]) -> dict:
    """config.json with the token ids loaders and servers read: eos / pad / bos (init_from's bos,
    else the tokenizer's, else none: never transformers' default, a Qwen id outside a small
    vocabulary), and for Qwen2-VL the vision start / end tokens (vLLM's M-RoPE positions find
    images by them) and init_from's video token."""
    source = _read_json(Path(init_from) / "config.json") if init_from is not None else {}
    bos = source.get("bos_token_id", source.get("text_config", {}).get("bos_token_id", tokenizer.bos_token_id))
    ids = {"eos_token_id": model.eos_token_id, "pad_token_id": model.pad_token_id, "bos_token_id": bos}
    config.update(ids)
    if "text_config" in config:
        config["text_config"].update(ids)
    if modality == "image":
        image = model.media_tokens_of["image"]
        if len(image.before) == 1 and len(image.after) == 1:
            config["vision_start_token_id"], config["vision_end_token_id"] = image.before[0], image.after[0]
        if "video_token_id" in source:
            config["video_token_id"] = source["video_token_id"]
    return config


def preprocessor_config(model_cfg: R.ModelConfig, model_type: str, init_from: Optional[str]) -> Optional[dict]:
    """preprocessor_config.json for an image (Qwen2-VL family) or audio (Qwen2-Audio) model;
    None for text. init_from's file is the base; the settings loomrl preprocessed the run's
    media with replace its values (a server then feeds the policy what it was trained on)."""
    if model_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        v = model_cfg.vision
        processor = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}.get(
            model_type, "Qwen3VLProcessor"
        )
        base = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": processor}
        ours = {
            "do_resize": True,
            "resample": 3,
            "do_rescale": True,
            "rescale_factor": 1 / 255,  # PIL bicubic
            "do_normalize": True,
            "image_mean": _short(v.image_mean),
            "image_std": _short(v.image_std),
            "do_convert_rgb": True,
            "min_pixels": v.min_pixels,
            "max_pixels": v.max_pixels,
            "size": {"shortest_edge": v.min_pixels, "longest_edge": v.max_pixels},
            "patch_size": v.patch_size,
            "temporal_patch_size": v.temporal_patch_size,
            "merge_size": v.spatial_merge_size,
        }
    elif model_type == "qwen2_audio":
        a = model_cfg.audio
        # WhisperFeatureExtractor pads / cuts to chunk_length whole seconds: the recipe's clip
        # must be that long, in as many frames as the audio tower takes
        seconds = int(a.clip_seconds)
        if seconds != a.clip_seconds or seconds * a.sample_rate // HOP != num_frames(a):
            log.warning(
                "[export] no preprocessor_config.json: model.audio.clip_seconds=%s is not a whole "
                "number of seconds, which WhisperFeatureExtractor needs",
                a.clip_seconds,
            )
            return None
        base = {
            "feature_extractor_type": "WhisperFeatureExtractor",
            "processor_class": "Qwen2AudioProcessor",
            "padding_side": "right",
            "padding_value": 0.0,
            "return_attention_mask": True,
        }
        ours = {
            "feature_size": a.num_mel_bins,
            "sampling_rate": a.sample_rate,
            "hop_length": HOP,
            "n_fft": N_FFT,
            "chunk_length": seconds,
            "n_samples": seconds * a.sample_rate,
            "nb_max_frames": seconds * a.sample_rate // HOP,
        }
    else:
        return None
    if init_from is not None and (Path(init_from) / "preprocessor_config.json").is_file():
        source = Path(init_from) / "preprocessor_config.json"
        base = _read_json(source)
        changed = sorted(k for k in ours if k in base and base[k] != ours[k])
        if changed:
            log.info(
                "[export] preprocessor_config.json: %s of %s set to the recipe's (what the policy was trained on)",
                ", ".join(changed),
                source,
            )
    return {**base, **ours}


def _short(values) -> list[float]:
    """float32 numbers as their shortest decimals (0.48145467, not 0.48145467042922974)."""
    return [float(str(np.float32(v))) for v in values]


def generation_config(model, tokenizer, init_from: Optional[str]) -> dict:
    """generation_config.json: init_from's (its sampling defaults) with eos = where the run's
    completions ended (the policy's stop token), the tokenizer's EOS and init_from's, and pad."""
    base = {}
    if init_from is not None and (Path(init_from) / "generation_config.json").is_file():
        base = _read_json(Path(init_from) / "generation_config.json")
    theirs = base.get("eos_token_id")
    eos = list(
        dict.fromkeys(
            i
            for i in [model.eos_token_id, tokenizer.eos_token_id, *(theirs if isinstance(theirs, list) else [theirs])]
            if isinstance(i, int)
        )
    )
    gen = {**base, "eos_token_id": eos[0] if len(eos) == 1 else eos}
    if model.pad_token_id is not None:
        gen["pad_token_id"] = model.pad_token_id
    if "bos_token_id" not in gen and tokenizer.bos_token_id is not None:
        gen["bos_token_id"] = tokenizer.bos_token_id
    return gen


# --------------------------------------------------------------------------- files and folders


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise ValueError(f"{file}: not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: not a JSON object")
    return data


def _stored_dtype(file: Path) -> torch.dtype:
    """The dtype most of a safetensors file's floating tensors are stored in (float32 if none)."""

    with safe_open(str(file), framework="pt") as f:
        kinds = Counter(f.get_slice(k).get_dtype() for k in f.keys())
    stored = [k for k, _ in kinds.most_common() if k in _STORED]
    return _STORED[stored[0]] if stored else torch.float32


def _count_params(folder: Path) -> int:

    n = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for k in f.keys():
                n += int(torch.Size(f.get_slice(k).get_shape()).numel())
    return n


_STAGE = re.compile(r"\..+\.export-([0-9]+)")
"""The name of an export's staging folder (`.OUT.export-PID`, beside `out`)."""


def _remove_stale_stages(folder: Path) -> None:
    """Remove the staging folders in `folder` of exports that died midway (SIGKILL, power loss):
    those whose PID is no longer a live process; a live export's folder is left alone."""
    try:
        names = [p for p in folder.iterdir() if _STAGE.fullmatch(p.name)] if folder.is_dir() else []
    except OSError:
        return  # an unlistable folder: the export itself says what is wrong with it
    for stage in names:
        pid = int(_STAGE.fullmatch(stage.name).group(1))  # type: ignore[union-attr]
        if pid == os.getpid() or not _alive(pid):
            log.info("[export] removing %s, left by an export (pid %d) that did not finish", stage, pid)
            _remove(stage)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    except (OverflowError, OSError):  # not a valid pid
        return False
    return True


def _set_modes(folder: Path) -> None:
    """The folder and its files readable as any new file is (0666 / 0777 less the umask): the
    writers of temporary files create them 0600 / 0700."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for p in folder.iterdir():
        if p.is_file() and not p.is_symlink():
            p.chmod(0o666 & ~umask)


def _run_folder_of(path: Path) -> Optional[Path]:
    """The loomrl run folder (recipe.yaml and checkpoints/) that `path` (resolved) is or lies in."""
    for folder in (path, *path.parents):
        if (folder / "recipe.yaml").is_file() and (folder / "checkpoints").is_dir():
            return folder
    return None


def _check_out(out: Path, checkpoint: Path, overwrite: bool) -> None:
    """Refuse an `out` that holds (or lies in) the checkpoint or lies in any run folder (a run's
    checkpoints would then hold a folder that is not one), the working directory or a mount point
    (neither can be replaced), and an existing non-empty one unless `overwrite`."""
    o, c = out.resolve(), checkpoint.resolve()
    if o == c or o in c.parents or c in o.parents:
        raise ValueError(f"--out {out}: holds or lies in the checkpoint {checkpoint}; choose a folder outside it")
    run = _run_folder_of(o)
    if run is not None:
        raise ValueError(
            f"--out {out}: lies in the loomrl run folder {run} (a run's folder holds only what the run "
            f"writes); choose a folder outside it"
        )
    if o == Path.cwd().resolve() or os.path.ismount(o):
        what = "the current directory" if o == Path.cwd().resolve() else "a mount point"
        raise ValueError(f"--out {out}: is {what}, which cannot be replaced; name a folder inside it")
    if not out.exists() and not out.is_symlink():
        return
    if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        return
    if not overwrite:
        what = "a folder that is not empty" if out.is_dir() else "a file"
        raise FileExistsError(f"{out}: already exists ({what}); choose another --out, or --overwrite it")


def _replace(tmp: Path, out: Path, old: Path) -> None:
    """Move the filled `tmp` to `out`; an existing `out` is first moved aside to `old` (the
    staging folder, removed after), so `out` is only ever the old folder or the new one whole."""
    if out.exists() or out.is_symlink():
        os.replace(out, old)
    os.replace(tmp, out)
    _fsync(out.parent)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
