"""`loomrl shards make | verify | inspect`.

Exit codes: 0 fine; 1 the data has faults (a rejection under --strict, no
sample written, a verify fault, an unreadable shard); 2 the command itself is
wrong (bad option, no such manifest, no shard matches, output exists) or the
output cannot be written (disk full, no permission: nothing is left behind).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from loomrl.config.patterns import expand_pattern
from loomrl.datasets.check import shard_stats, verify_shards
from loomrl.datasets.files import NotRegularFile
from loomrl.datasets.layouts import LAYOUTS
from loomrl.datasets.manifest import FIELD_KEYS, ReadOptions
from loomrl.datasets.prepare import Limits, MakeResult, RejectionEcho, make_shards, rejected_path
from loomrl.datasets.shards import MAX_MEMBER_BYTES, ShardError, check_pattern, existing_shards
from loomrl.datasets.sources import SourceError
from loomrl.encoders.config import MAX_VIDEO_SECONDS

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


def byte_count(text: str) -> int:
    """'3000000', '500MB', '1.5GiB' -> bytes (at least 1)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (e.g. 500MB, 1GiB, 3000000)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not 1 <= value < 2**63:  # "0" would silently mean "no limit"; "1e999" is infinite
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count from 1 byte to 8 EiB")
    return int(value)


def positive_int(text: str, most: int | None = None) -> int:
    """A whole number of at least 1 (a count, a rate, a pixel limit), and at most `most`."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1 or (most is not None and value > most):
        span = "at least 1" if most is None else f"from 1 to {most}"
        raise argparse.ArgumentTypeError(f"must be {span}, got {value}")
    return value


def thread_count(text: str) -> int:
    return positive_int(text, most=256)  # a thread per pending sample: a huge count would be that many threads


def positive_seconds(text: str, most: float = float("inf")) -> float:
    """A finite number of seconds above 0 (and at most `most`)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0, got {text!r}")
    if value > most:
        raise argparse.ArgumentTypeError(f"must be at most {most:g} seconds, got {text!r}")
    return value


def video_seconds(text: str) -> float:
    """The longest video: positive, at most MAX_VIDEO_SECONDS (3 hours)."""
    return positive_seconds(text, MAX_VIDEO_SECONDS)


def field_mapping(text: str) -> tuple[str, str]:
    """'prompt=text' -> ('prompt', 'text'): `--field NAME=KEY`, NAME one of the manifest's fields."""
    name, eq, key = text.partition("=")
    name, key = name.strip(), key.strip()
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=KEY (e.g. prompt=question)")
    if name not in FIELD_KEYS:
        raise argparse.ArgumentTypeError(f"unknown field {name!r} in {text!r}; NAME is one of {', '.join(FIELD_KEYS)}")
    return name, key


def expand(patterns: list[str]) -> list[str]:
    """Shard files of glob / brace patterns (or plain paths the shell already expanded)."""

    files: list[str] = []
    for p in patterns:
        files.extend(f for f in expand_pattern(p) if f not in files)
    return files


def progress_wanted() -> bool:
    return sys.stderr.isatty()


# --------------------------------------------------------------------------- make


class Refused(Exception):
    """`shards make` cannot start, or cannot write: the message is printed as `error: ...` and the exit code is 2."""


def cmd_make(args) -> int:
    try:
        check_out(args.out)
        options = read_options(args)
        check_nothing_to_overwrite(args.out)
        result = run_make(args, options)
    except Refused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**result.to_json(), "rejected_file": rejected_path(args.out)}, indent=1))
    else:
        print(result.summary())
        if result.rejected:
            print(f"rejections listed in {rejected_path(args.out)}")
    if result.samples == 0:
        print("error: no sample passed validation; nothing was written", file=sys.stderr)
        return 1
    if args.strict and result.rejected:
        print(f"error: --strict: {len(result.rejected)} sample(s) rejected", file=sys.stderr)
        return 1
    return 0


def check_out(pattern: str) -> None:
    """--out is a shard pattern; Refused otherwise."""
    try:
        check_pattern(pattern)
    except ValueError as e:
        raise Refused(f"--out: {e}") from None


def read_options(args) -> ReadOptions:
    """How the source's records are read: the --field mapping (each NAME once), --require-markers,
    --allow-outside and --format; Refused for a bad mapping."""
    mapping: dict[str, str] = {}
    for name, key in args.field:
        if name in mapping and mapping[name] != key:
            raise Refused(f"--field: {name} given twice ({mapping[name]!r} and {key!r})")
        mapping[name] = key
    try:
        return ReadOptions.with_fields(
            mapping, require_markers=args.require_markers, allow_outside=args.allow_outside, layout=args.format
        )
    except ValueError as e:
        raise Refused(f"--field: {e}") from None


def check_nothing_to_overwrite(pattern: str) -> None:
    """No shard matches `pattern` yet; Refused otherwise. The split's rejection list of an earlier
    make that wrote no shard (it failed, or every sample was rejected) is replaced, so a retry runs."""
    try:
        existing = existing_shards(pattern)
    except OSError as e:  # the target folder cannot be listed (no permission)
        raise Refused(f"--out: cannot look for existing shards in {e.filename or pattern}: {e.strerror or e}") from None
    if existing:
        raise Refused(
            f"--out: {len(existing)} file(s) already match {pattern!r} (first: {existing[0]}); "
            f"remove them or choose another --out"
        )
    stale = rejected_path(pattern)
    if os.path.lexists(stale):
        try:
            os.remove(stale)  # a link is removed, never followed
        except OSError as e:
            raise Refused(f"--out: cannot replace {stale} (an earlier make's rejections): {e.strerror or e}") from None
        print(f"replacing {stale}: an earlier make of this split wrote no shard", file=sys.stderr)


def run_make(args, options: ReadOptions) -> MakeResult:
    """`make_shards` with the command line's limits, rejections echoed on stderr; Refused when there
    is no manifest or the output cannot be written."""
    limits = Limits(
        sample_rate=args.sample_rate,
        max_pixels=args.max_pixels,
        max_audio_seconds=args.max_audio_seconds,
        max_video_seconds=args.max_video_seconds,
        max_file_bytes=args.max_file_bytes,
    )
    echo = RejectionEcho()
    try:
        result = make_shards(
            args.source,
            args.out,
            maxcount=args.maxcount,
            maxsize=args.maxsize,
            limits=limits,
            workers=args.workers,
            on_reject=echo,
            progress=progress_wanted(),
            options=options,
        )
    except (FileNotFoundError, NotRegularFile, SourceError) as e:  # no source, a FIFO, a kind not read
        raise Refused(str(e)) from None
    except OSError as e:  # a full disk, no permission: make_shards has removed what it wrote
        where = f"{e.filename}: " if e.filename else ""
        raise Refused(f"{where}{e.strerror or e}; no shard was written and no partial file is left") from None
    echo.close()
    return result


# --------------------------------------------------------------------------- verify / inspect


def cmd_verify(args) -> int:

    files = expand(args.patterns)
    if not files:
        print(f"error: no shards match {' '.join(args.patterns)}", file=sys.stderr)
        return 2
    result = verify_shards(
        files,
        on_fault=lambda f: print(f"FAULT {f}", file=sys.stderr, flush=True),
        progress=progress_wanted(),
        sample_rate=args.sample_rate,
        max_pixels=args.max_pixels,
        max_member_bytes=args.max_member_bytes,
        max_audio_seconds=args.max_audio_seconds,
        max_video_seconds=args.max_video_seconds,
    )
    status = "OK" if not result.faults else f"{len(result.faults)} FAULT(S)"
    print(f"verified {result.samples} samples in {result.shards} shard(s): {status}")
    return 1 if result.faults else 0


def cmd_inspect(args) -> int:

    files = expand(args.patterns)
    if not files:
        print(f"error: no shards match {' '.join(args.patterns)}", file=sys.stderr)
        return 2
    try:
        stats = shard_stats(files, args.max_member_bytes)
    except (ShardError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(stats, indent=1))
        return 0
    mb = 1e6
    print(f"shards        {stats['shards']} ({stats['shard_bytes'] / mb:.2f} MB)")
    print(f"samples       {stats['samples']}")
    print("modalities    " + ", ".join(f"{k} {v}" for k, v in stats["modalities"].items()))
    print(
        f"media         {stats['media_total']} ("
        + ", ".join(f"{k} {v}" for k, v in stats["media"].items())
        + f"), {stats['media_bytes'] / mb:.2f} MB"
    )
    print(f"unique media  {stats['media_unique']} by sha256, {stats['media_unique_bytes'] / mb:.2f} MB")
    print("shard sizes:")
    for s in stats["shard_sizes"]:
        print(f"  {s['file']}  {s['samples']} samples  {s['bytes'] / mb:.2f} MB")
    return 0


# --------------------------------------------------------------------------- parser


def add_media_limits(p: argparse.ArgumentParser, rate: str) -> None:
    """The media bounds `make` and `verify` share (prepare.Limits); `rate`: what the audio rate does."""
    p.add_argument("--sample-rate", type=positive_int, default=16000, help=f"audio is {rate}")
    p.add_argument("--max-pixels", type=positive_int, default=50_000_000, help="largest image or video frame (w x h)")
    p.add_argument(
        "--max-audio-seconds",
        type=positive_seconds,
        default=60.0,
        help="longest audio clip, checked from its header before decoding (default 60)",
    )
    p.add_argument(
        "--max-video-seconds",
        type=video_seconds,
        default=600.0,
        help="longest video, checked from its header before decoding (default 600)",
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="loomrl shards", description="Prepare, verify and inspect webdataset shards.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "make",
        help="validate a dataset's samples and write shards",
        description="Validate every sample of a source (a JSONL manifest, a .json list, parquet, a "
        "folder of them, or a Hugging Face datasets folder; vqa, llava, chat, verl or easyr1 records) "
        "and write the good ones to tar shards; bad ones go to the split's rejection list beside them "
        "(DIR/train-rejected.jsonl for DIR/train-%%06d.tar).",
    )
    p.add_argument("source", help=".jsonl, .json or .parquet file, a folder of them, or a datasets save_to_disk folder")
    p.add_argument("--out", required=True, help="shard pattern, e.g. 'data/train/train-%%06d.tar'")
    p.add_argument("--maxcount", type=positive_int, default=1000, help="samples per shard (default 1000)")
    p.add_argument("--maxsize", type=byte_count, default=None, help="bytes per shard, e.g. 1GB (default: no limit)")
    p.add_argument("--strict", action="store_true", help="exit 1 if any sample is rejected")
    add_media_limits(p, "stored mono at this rate (Hz)")
    p.add_argument(
        "--max-file-bytes",
        type=byte_count,
        default=MAX_MEMBER_BYTES,
        help=f"largest media file, as read and as stored (default {MAX_MEMBER_BYTES})",
    )
    p.add_argument("--workers", type=thread_count, default=4, help="decoding threads (default 4)")
    p.add_argument(
        "--field",
        type=field_mapping,
        action="append",
        default=[],
        metavar="NAME=KEY",
        help="read field NAME (id, prompt, answer, images, audio, videos, chosen, rejected) from manifest key "
        "KEY only; repeatable (default keys: docs/shards.md)",
    )
    p.add_argument(
        "--require-markers",
        action="store_true",
        help="reject a prompt with media but no <image>/<audio>/<video> marker "
        "(default: the media are placed before its text)",
    )
    p.add_argument(
        "--allow-outside",
        action="store_true",
        help="allow media paths that resolve outside the manifest's folder (trusted manifests only)",
    )
    p.add_argument(
        "--format",
        choices=LAYOUTS,
        default=None,
        help="read every record in this layout (default: detected per record; docs/shards.md)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(fn=cmd_make)

    for name, fn, text in (
        ("verify", cmd_verify, "read every sample back: hashes, decodability"),
        ("inspect", cmd_inspect, "counts, modalities, unique media, bytes, shard sizes"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("patterns", nargs="+", metavar="PATTERN", help="shard files, globs or brace ranges")
        p.add_argument(
            "--max-member-bytes", type=byte_count, default=MAX_MEMBER_BYTES, help="largest tar member accepted"
        )
        if name == "verify":
            add_media_limits(p, "decoded at this rate (Hz)")
        else:
            p.add_argument("--json", action="store_true", help="print the numbers as JSON")
        p.set_defaults(fn=fn)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
