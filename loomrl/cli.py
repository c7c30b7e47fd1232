"""The `loomrl` command line: run, report, export, recipe, plan, shards, bench."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Optional

from loomrl.logs import setup_logging


def lock_run_folder(out: Path):
    """Hold an exclusive lock on the run folder for this process's life (None: another run
    holds it; its pid is in the lock file)."""
    import fcntl

    out.mkdir(parents=True, exist_ok=True)
    f = open(out / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        return None, holder
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f, None


class Refused(Exception):
    """`loomrl run` cannot go on: the message is printed as `error: ...` and the exit code is 2."""


def cmd_run(args) -> int:
    from loomrl.platform import recipe as R
    from loomrl.platform.parts import resolve_sources

    try:
        recipe = R.load_recipe(args.recipe, args.overrides, files=not args.dry_run)
        nodes = job_nodes(args, recipe)
        resolve_sources(recipe, missing_ok=args.dry_run)  # data.source: its shards, made once (by a dry run too)
        if args.dry_run:
            return dry_run(recipe)
        out, lock = run_folder(args, recipe, nodes)  # the lock is held while `lock` lives: this call's length
        resume_from = resume_point(args, recipe, out)
    except R.RecipeError as e:
        print(f"error: recipe {args.recipe}: {e}", file=sys.stderr)
        return 2
    except Refused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if (recipe.training.nproc > 1 or recipe.pipeline.mode == "disaggregated") and nodes.rank == 0:
        from loomrl.platform.parts import shard_files

        shard_files(recipe)  # demo shards written once, here, not by every rank (or node) at the same time
    run_args = [args.recipe, *args.overrides]
    run_args += ["--resume-from", str(resume_from)] if resume_from is not None else []
    run_args += ["--max-steps", str(args.max_steps)] if args.max_steps is not None else []
    if recipe.pipeline.mode == "disaggregated":  # torchrun: training.nproc trainers + pipeline.rollout_workers
        from loomrl.platform.disaggregated import launch

        return launch(recipe, run_args, out, nodes)
    return train(args, recipe, out, resume_from, run_args, nodes)


def job_nodes(args, recipe):
    """The machines of the job (`--nnodes` ...): checked against the recipe's processes, which must
    split evenly over them (Refused otherwise, by --dry-run too)."""
    from loomrl.platform.engines import TRAINING_ENGINES
    from loomrl.platform.engines.launch import Nodes

    nodes = Nodes(args.nnodes, args.node_rank, args.master_addr, args.master_port)
    if nodes.count == 1 and nodes.rank == 0:
        return nodes
    disaggregated = recipe.pipeline.mode == "disaggregated"
    if not disaggregated and not TRAINING_ENGINES.get(recipe.training.engine).trait("distributed", False):
        raise Refused(
            f"--nnodes {nodes.count}: training.engine={recipe.training.engine} runs in one process; "
            "a job over several machines needs a distributed engine (deepspeed, megatron) "
            "or pipeline.mode=disaggregated"
        )
    total = recipe.training.nproc + (recipe.pipeline.rollout_workers if disaggregated else 0)
    what = "training.nproc + pipeline.rollout_workers" if disaggregated else "training.nproc"
    try:
        nodes.per_node(total, what)
    except ValueError as e:
        raise Refused(str(e)) from None
    return nodes


def dry_run(recipe) -> int:
    """`--dry-run`: everything a run would refuse is refused (RecipeError); prints the resolved recipe."""
    from loomrl.platform import recipe as R
    from loomrl.platform.parts import check_text_parts

    notes = check_text_parts(recipe)  # the tokenizer, chat template, media tokens and the data's media, as a run
    print(R.dump(recipe), end="")
    for problem in R.file_problems(recipe):  # a recipe for another machine names its paths
        print(f"# note: not on this machine: {problem}", file=sys.stderr)
    for note in notes:
        print(f"# note: {note}", file=sys.stderr)
    print("# recipe OK", file=sys.stderr)
    return 0


def run_folder(args, recipe, nodes):
    """(the run folder, its lock): --out, the folder a --resume-from checkpoint is in, or
    runs/NAME-TIME; checked (empty unless resuming, a loomrl run when resuming) and locked (the
    lock is held until the returned file object is closed or collected: keep it), except in a rank
    under torchrun, whose launcher did both, and on nodes other than node 0, whose launcher does
    both for the job (lock None). Refused when it cannot be used."""
    out = Path(args.out) if args.out else Path("runs") / f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.resume_from and not args.out:
        out = Path(args.resume_from).resolve().parent.parent  # RUN/checkpoints/step-N
    if args.resume and not args.out:
        raise Refused("--resume needs --out DIR (the run folder to continue)")
    if nodes.count > 1 and not args.out and not args.resume_from:
        raise Refused(f"--nnodes {nodes.count}: give every node the same --out DIR (on a shared filesystem)")
    if "LOOMRL_NPROC_CHILD" in os.environ or nodes.rank > 0:  # a rank under torchrun, or another node
        return out, None
    try:
        existing = [p.name for p in out.iterdir() if p.name != ".lock"] if out.is_dir() else []
        if existing and not (args.resume or args.resume_from):
            raise Refused(
                f"{out} is not empty ({', '.join(sorted(existing)[:5])}); choose another --out, "
                f"or --resume the run in it"
            )
        if existing and not (out / "recipe.yaml").is_file():
            raise Refused(f"{out} holds no loomrl run (no recipe.yaml); nothing to resume")
        lock, holder = lock_run_folder(out)
    except OSError as e:  # a read-only or unlistable folder, a file in the way, ...
        raise Refused(
            f"cannot use {out} as the run folder: {e.strerror or e}"
            f"{f' ({e.filename})' if e.filename and str(e.filename) != str(out) else ''}"
        ) from None
    if lock is None:
        raise Refused(f"{out} is in use by another loomrl run (pid {holder})")
    return out, lock


def resume_point(args, recipe, out: Path) -> Optional[Path]:
    """The checkpoint to resume from (None: start from the beginning); a run folder whose saved
    recipe differs from this one is refused."""
    if not (args.resume or args.resume_from):
        return None
    from loomrl.platform import recipe as R
    from loomrl.platform.checkpoint import latest_checkpoint

    saved = out / "recipe.yaml"
    text = saved.read_text(errors="replace") if saved.exists() else None
    if text is not None and text != R.dump_run(recipe):  # paths absolute, as the run saved them
        raise Refused(
            f"{saved} differs from this recipe and overrides; resume with the same recipe "
            f"(differences: {', '.join(recipe_diff(text, R.dump_run(recipe)))})"
        )
    resume_from = Path(args.resume_from) if args.resume_from else latest_checkpoint(out / "checkpoints")
    if resume_from is None:
        print(f"[run] no checkpoint in {out}/checkpoints: starting from the beginning", file=sys.stderr)
    return resume_from


def train(args, recipe, out: Path, resume_from: Optional[Path], run_args: list[str], nodes) -> int:
    """A colocated run in this process (and, for an engine that needs a process group, under
    torchrun with training.nproc ranks); its summary and exit code."""
    from loomrl.platform import recipe as R
    from loomrl.platform.engines import TRAINING_ENGINES
    from loomrl.platform.engines import launch as engines_launch
    from loomrl.platform.engines.base import world
    from loomrl.platform.metrics import MetricsError
    from loomrl.platform.signals import StopNow
    from loomrl.platform.trainer import Interrupted, Trainer

    distributed = TRAINING_ENGINES.get(recipe.training.engine).trait("distributed", False)
    if distributed:  # DeepSpeed / Megatron: a process group, torchrun above 1 process
        if (recipe.training.nproc > 1 or nodes.count > 1) and not engines_launch.launched():
            return engines_launch.launch(recipe.training.nproc, ["run", *run_args, "--out", str(out)], nodes)
        engines_launch.init_distributed()
    rank = world()[0]  # now: an in-process vLLM tears the default group down when it shuts down
    try:
        result = Trainer(recipe, out, resume_from, args.max_steps).run()
    except R.RecipeError as e:
        print(f"error: recipe {args.recipe}: {e}", file=sys.stderr)
        return 2
    except MetricsError as e:  # the run folder's metrics, not the checkpoint
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        if resume_from is None:
            raise
        print(
            f"error: cannot resume from {resume_from}: {e}\n"
            f"an earlier checkpoint can be named with --resume-from {out}/checkpoints/step-N",
            file=sys.stderr,
        )
        return 2
    except Interrupted as e:
        command = shlex.join(["loomrl", "run", args.recipe, *args.overrides, "--out", str(out), "--resume"])
        print(f"[run] {e}\nresume with: {command}", file=sys.stderr)
        return 130
    except StopNow as e:  # a second signal outside a reward request: no checkpoint of this step
        command = shlex.join(["loomrl", "run", args.recipe, *args.overrides, "--out", str(out), "--resume"])
        print(f"[run] {e}; no checkpoint of the step in progress\nresume with: {command}", file=sys.stderr)
        return 130
    if distributed:
        engines_launch.finish()
        if rank != 0:  # rank 0 alone writes the run folder and reports
            return 0
    print(result.summary, flush=True)
    if result.error:
        return 2
    return 3 if result.goal_met is False else 0


def recipe_diff(a: str, b: str) -> list[str]:
    """Key paths whose values differ between two dumped recipes."""
    import yaml

    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[prefix + k] = v
        return out

    try:
        fa, fb = flat(yaml.safe_load(a) or {}), flat(yaml.safe_load(b) or {})
    except (yaml.YAMLError, ValueError, AttributeError, RecursionError):  # a hand-edited recipe.yaml
        return ["the saved file does not read as a recipe"]
    return sorted(k for k in set(fa) | set(fb) if fa.get(k) != fb.get(k)) or ["formatting"]


def cmd_report(args) -> int:
    from loomrl.commands.report import write_comparison, write_report

    if (len(args.run_dir) > 1) != bool(args.out):
        print(
            "error: several run folders are overlaid into one --out FILE.png; one run folder gets its own "
            "DIR/report.png (no --out)",
            file=sys.stderr,
        )
        return 2
    try:
        if len(args.run_dir) > 1:
            print(write_comparison([Path(d) for d in args.run_dir], Path(args.out)))
        else:
            print(write_report(Path(args.run_dir[0])))
    except (OSError, ValueError) as e:  # not a run folder, a malformed metrics row, a read-only folder
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_export(args) -> int:
    """A checkpoint (or a run folder's newest) as a Hugging Face folder (loomrl.commands.export)."""
    from loomrl.commands.export import export_checkpoint

    try:
        export_checkpoint(Path(args.checkpoint), Path(args.out), args.dtype, args.modality, args.overwrite)
    except (OSError, ValueError) as e:  # the run folder, the checkpoint, --out: each names its file
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_recipe(args) -> int:
    """The recipe reference (every key, type, default, meaning) as a markdown table: printed,
    or with --out written to a file under a one-line header saying it is generated."""
    from loomrl.platform.recipe import field_docs

    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for key, tp, default, doc in field_docs():
        lines.append(f"| `{key}` | {tp} | {('`' + default + '`') if default else ''} | {doc} |")
    table = "\n".join(lines) + "\n"
    out = getattr(args, "out", None)
    if out is None:
        print(table, end="")
        return 0
    header = (
        "Generated by `loomrl recipe --out docs/recipe.md` from each part's config dataclasses, composed "
        "in `loomrl/platform/recipe.py` (docs/extending.md); do not edit by hand. A number must lie in the "
        "range beside its "
        "type (checked when the recipe is loaded); NaN and infinities are always refused, and an "
        "integer must fit in 64 bits.\n\n"
    )
    Path(out).write_text(header + table)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def cmd_plan(args) -> int:
    """Per-rank GPU memory of a recipe by kind (loomrl.commands.plan): 0 fits, 3 does not fit, 2 an error."""
    from loomrl.commands.plan import PlanError, plan_recipe, report
    from loomrl.platform import recipe as R

    try:
        overrides = args.overrides + cluster_overrides(args)
        plan = plan_recipe(args.recipe, overrides, args.gpu_memory, args.seq_len, args.fused_attention)
    except (R.RecipeError, PlanError) as e:
        print(f"error: recipe {args.recipe}: {e}", file=sys.stderr)
        return 2
    if args.nodes is not None:
        plan.ranks.update(nodes=args.nodes, gpus_per_node=args.gpus_per_node)
    report(plan, args.json)
    return 0 if plan.fits else 3


def cluster_overrides(args) -> list[str]:
    """`plan --nodes N --gpus-per-node G`: the job on N x G GPUs, one rank each: training.nproc is
    N x G (disaggregated: less the recipe's rollout workers)."""
    from loomrl.platform import recipe as R

    if (args.nodes is None) != (args.gpus_per_node is None):
        raise R.RecipeError("--nodes and --gpus-per-node go together")
    if args.nodes is None:
        return []
    recipe = R.load_recipe(args.recipe, args.overrides, files=False)
    workers = recipe.pipeline.rollout_workers if recipe.pipeline.mode == "disaggregated" else 0
    trainers = args.nodes * args.gpus_per_node - workers
    if trainers < 1:
        raise R.RecipeError(
            f"pipeline.rollout_workers: {workers} workers leave no GPU to train on "
            f"{args.nodes} x {args.gpus_per_node} GPUs"
        )
    return [f"training.nproc={trainers}"]


def positive_gib(text: str) -> float:
    """--gpu-memory: a finite number of GiB > 0."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB > 0, got {text!r}") from None
    if not (0 < x < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a number of GiB > 0, got {text}")
    return x


def positive_int(text: str) -> int:
    """--seq-len: an integer >= 1."""
    n = steps_count(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {n}")
    return n


# Command groups with their own parsers, in the module that owns the idea.
GROUPS = {
    "shards": ("loomrl.datasets.cli", "prepare, verify and inspect webdataset shards"),
    "bench": ("loomrl.commands.bench", "benchmarks: drafter, encoders (ratios measured side by side)"),
    "doctor": ("loomrl.commands.doctor", "measure the rollout/trainer log-prob mismatch per rounding setting"),
}


def steps_count(text: str) -> int:
    """--max-steps: an integer >= 0."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {n}")
    return n


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in GROUPS:
        import importlib

        return importlib.import_module(GROUPS[argv[0]][0]).main(argv[1:])
    ap = build_parser()
    # Overrides may come after options (`run R.yaml --out D a.b=1`): collect them.
    args, extra = ap.parse_known_args(argv)
    if extra:
        if args.command not in ("run", "plan") or any(x.startswith("-") or "=" not in x for x in extra):
            ap.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = args.overrides + extra
    return args.fn(args)


def build_parser() -> argparse.ArgumentParser:
    """The top-level commands (the groups in GROUPS parse their own arguments)."""
    ap = argparse.ArgumentParser(
        prog="loomrl",
        description="Multimodal RL training platform.",
        epilog="more: " + "; ".join(f"loomrl {k} -h: {v[1]}" for k, v in GROUPS.items()),
    )
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run a recipe: loomrl run RECIPE.yaml [key.path=value ...]")
    p.add_argument("recipe", help="YAML recipe file")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides (YAML values)")
    p.add_argument("--out", help="run folder (default runs/NAME-TIMESTAMP)")
    p.add_argument("--dry-run", action="store_true", help="validate and print the resolved recipe")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    p.add_argument("--resume-from", metavar="CKPT", help="continue from this checkpoint folder (step-N)")
    p.add_argument(
        "--max-steps", type=steps_count, metavar="N", help="stop after N RL steps in total, with a checkpoint"
    )
    nodes = p.add_argument_group("several machines (docs/multi-node.md): the same command on every node")
    nodes.add_argument("--nnodes", type=steps_count, default=1, metavar="N", help="machines in the job (default 1)")
    nodes.add_argument("--node-rank", type=int, default=0, metavar="R", help="this machine's index, 0..N-1")
    nodes.add_argument("--master-addr", default="127.0.0.1", metavar="HOST", help="node 0's address")
    nodes.add_argument("--master-port", type=int, default=29500, metavar="PORT", help="node 0's rendezvous port")
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("report", help="plot DIR/metrics.jsonl into DIR/report.png, or overlay several runs")
    p.add_argument("run_dir", nargs="+", help="a run folder; several: their curves overlaid (needs --out)")
    p.add_argument("--out", metavar="FILE.png", help="the overlay's file (several run folders)")
    p.set_defaults(fn=cmd_report)
    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face folder (transformers, vLLM)")
    p.add_argument("checkpoint", help="RUN/checkpoints/step-N, or a run folder RUN (its newest checkpoint)")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="weights' dtype (default: the checkpoint's)")
    p.add_argument(
        "--modality",
        choices=["image", "audio", "text"],
        help="image: Qwen2-VL / Qwen2.5-VL, audio: Qwen2-Audio, text: Qwen2ForCausalLM "
        "(default: model.init_from's; needed without one)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --out")
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser("recipe", help="print the recipe reference (every key, type, default)")
    p.add_argument("--out", metavar="FILE", help="write it to FILE (docs/recipe.md) with a generated-file header")
    p.set_defaults(fn=cmd_recipe)
    p = sub.add_parser(
        "plan",
        help="per-rank GPU memory of a recipe (weights, gradients, optimizer, activations, "
        "rollout) and whether it fits; exit 0 fits, 3 does not fit, 2 error",
    )
    p.add_argument("recipe", help="YAML recipe file")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides (YAML values)")
    p.add_argument("--json", action="store_true", help="also print the plan as one JSON object, the last line")
    p.add_argument(
        "--gpu-memory", type=positive_gib, default=80.0, metavar="GIB", help="memory of one GPU in GiB (default 80)"
    )
    p.add_argument(
        "--seq-len",
        type=positive_int,
        metavar="N",
        help="tokens per trained sequence (default: rollout.vllm.max_model_len with vLLM rollouts, "
        "else 512 + rollout.max_new_tokens)",
    )
    p.add_argument(
        "--fused-attention",
        action="store_true",
        help="plan activations without the attention score matrix (a fused SDPA / flash kernel)",
    )
    p.add_argument("--nodes", type=positive_int, metavar="N", help="machines (with --gpus-per-node): training.nproc")
    p.add_argument("--gpus-per-node", type=positive_int, metavar="G", help="GPUs per machine, one rank each")
    p.set_defaults(fn=cmd_plan)
    return ap


if __name__ == "__main__":
    sys.exit(main())
