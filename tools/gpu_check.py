"""The prepared device check (docs/gpu.md): what loomrl does on one CUDA GPU, in one command
that fits a short lease (at most 8 minutes on one H200).

    bash tools/gpu_check.sh OUT_DIR        # installs carried wheels (.whl/) first, then this

Checks, each timed and written to OUT_DIR/gpu_check.json (the last stdout line too):
  env          torch, CUDA, the GPU's name
  logprobs     the demo policy's log-probs of the same rollouts, same FP32 weights, on the CPU
               and on the GPU (TF32 off): mean and max |difference|
  checkpoint   gradients of one micro-batch with and without activation checkpointing on the
               GPU (max |difference|, expected ~0)
  demo_fp32    `loomrl run recipes/demo.yaml training.device=cuda`: goal met?, reward first ->
  demo_bf16    last, run seconds, host <-> device copies per step, peak GPU memory (these two
               run at the same time, one process each, each with 4 CPU threads)
  lora         a short LoRA run (model.lora.rank=8) on the GPU: exit status, peak memory

Exit status 0 when every check ran and both demos met their goal, 1 otherwise.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("loomrl.gpu_check")
DEVICE = "cuda"  # --device


def env() -> dict:
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "available": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def policy_and_trajectories(out: Path):
    """The demo policy (FP32, on the CPU) and 8 prompts x 4 rollouts of it, sampled on the CPU."""
    from loomrl.commands.doctor import torch_engine, trajectories
    from loomrl.platform import recipe as R
    from loomrl.platform.parts import build_policy_parts, configure_torch, prompt_source, shard_files, to_prompts
    from loomrl.platform.rollout.base import SamplingParams

    recipe = R.load_recipe(ROOT / "recipes/demo.yaml", ["training.device=cpu", f"data.shards={out}/demo/demo-*.tar"])
    configure_torch(recipe.training)
    tokenizer, chat, model = build_policy_parts(recipe)
    prompts = to_prompts(prompt_source(recipe, shard_files(recipe), model, tokenizer, chat).next(8))
    params = SamplingParams(n=4, temperature=1.0, top_p=1.0, max_new_tokens=recipe.rollout.max_new_tokens)
    rollouts = torch_engine(model, prompts, params, torch.Generator().manual_seed(0))
    return model, trajectories(prompts, rollouts)


def logprobs(model, trajs) -> dict:
    from loomrl.commands.doctor import trainer_logprobs

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cpu = trainer_logprobs(model.eval(), trajs, 1.0)
    gpu = trainer_logprobs(copy.deepcopy(model).to(DEVICE).eval(), trajs, 1.0)
    diffs = [abs(a - b) for x, y in zip(cpu, gpu) for a, b in zip(x, y)]
    return {"tokens": len(diffs), "mean_abs": sum(diffs) / len(diffs), "max_abs": max(diffs)}


def checkpointing(model, trajs) -> dict:
    from loomrl.platform.trajectory.batch import micro_batches

    grads = []
    for on in (False, True):
        m = copy.deepcopy(model).to(DEVICE).train()
        m.requires_grad_(True)  # the demo freezes its towers: here they train, so their checkpointing is checked too
        m.set_activation_checkpointing(on)
        mb = micro_batches(trajs[:16], m.pad_token_id, 16, device=m.device)[0]
        logp, _ = m.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.media)
        (-(logp * mb.loss_mask).sum() / mb.loss_mask.sum()).backward()
        grads.append({n: p.grad.detach().cpu() for n, p in m.named_parameters() if p.grad is not None})
    return {"tensors": len(grads[0]), "max_abs": max(float((grads[0][n] - grads[1][n]).abs().max()) for n in grads[0])}


def start_run(name: str, out: Path, extra: list[str]) -> tuple[subprocess.Popen, Path, float]:
    folder = out / name
    cmd = [
        sys.executable,
        "-m",
        "loomrl.cli",
        "run",
        str(ROOT / "recipes/demo.yaml"),
        "--out",
        str(folder),
        f"training.device={DEVICE}",
        "training.threads=4",
        f"data.shards={out}/demo/demo-*.tar",
        *extra,
    ]
    log.info("[gpu_check] %s: %s", name, " ".join(cmd[2:]))
    logf = open(out / f"{name}.log", "w")
    return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=ROOT), folder, time.perf_counter()


def finish_run(proc: subprocess.Popen, folder: Path, t0: float) -> dict:
    rc = proc.wait()
    res: dict = {"exit": rc, "process_s": round(time.perf_counter() - t0, 1)}
    summary = folder / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        res.update({k: s.get(k) for k in ("goal", "goal_met", "wall_s", "error")})
    rows = (
        [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        if (folder / "metrics.jsonl").is_file()
        else []
    )
    if rows:
        last = rows[-1]
        res.update(
            {k: last.get(k) for k in ("h2d_copies", "h2d_mb", "d2h_copies", "d2h_mb", "device_peak_mb", "step_s")}
        )
        res["reward_first5"] = sum(r["reward_mean"] for r in rows[:5]) / len(rows[:5])
        res["reward_last10"] = sum(r["reward_mean"] for r in rows[-10:]) / len(rows[-10:])
    return res


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--lora-steps", type=int, default=20)
    ap.add_argument("--device", default="cuda", help="cpu: the same checks on the CPU (a smoke test of this script)")
    ap.add_argument(
        "--override",
        action="append",
        default=[],
        help="a recipe override for every run (a smoke test's shorter runs); repeatable",
    )
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"date": time.strftime("%Y-%m-%d"), "env": env()}
    log.info("[gpu_check] %s", result["env"])
    if DEVICE == "cuda" and not torch.cuda.is_available():
        log.error("[gpu_check] torch sees no CUDA device; nothing to check")
        print(json.dumps(result))
        return 1
    model, trajs = policy_and_trajectories(out)  # writes the demo shards once, for every run below
    runs = {
        name: start_run(name, out, extra)
        for name, extra in (("demo_fp32", args.override), ("demo_bf16", ["training.precision=bf16", *args.override]))
    }
    for name, fn in (("logprobs", logprobs), ("checkpoint", checkpointing)):
        t0 = time.perf_counter()
        result[name] = dict(fn(model, trajs), seconds=round(time.perf_counter() - t0, 1))
        log.info("[gpu_check] %s: %s", name, result[name])
    for name, (proc, folder, t0) in runs.items():
        result[name] = finish_run(proc, folder, t0)
        log.info("[gpu_check] %s: %s", name, result[name])
    proc = start_run(
        "lora", out, [*args.override, "model.lora.rank=8", f"training.steps={args.lora_steps}", "goal=null"]
    )
    result["lora"] = finish_run(*proc)
    log.info("[gpu_check] lora: %s", result["lora"])
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    ok = all(result[n].get("goal_met") for n in runs) and result["lora"]["exit"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
