"""The `loomrl` command line: run, report, recipe, shards, bench."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def cmd_run(args) -> int:
    from loomrl.platform import recipe as R

    try:
        recipe = R.load_recipe(args.recipe, args.overrides)
    except R.RecipeError as e:
        print(f"error: recipe {args.recipe}: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(R.dump(recipe), end="")
        print("# recipe OK", file=sys.stderr)
        return 0
    out = Path(args.out) if args.out else Path("runs") / f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if (out / "metrics.jsonl").exists():
        print(f"error: {out} already holds a run (metrics.jsonl); choose another --out", file=sys.stderr)
        return 2
    from loomrl.platform.runner import run

    try:
        result = run(recipe, out)
    except R.RecipeError as e:
        print(f"error: recipe {args.recipe}: {e}", file=sys.stderr)
        return 2
    print(result.summary, flush=True)
    return 3 if result.goal_met is False else 0


def cmd_report(args) -> int:
    from loomrl.platform.report import write_report

    try:
        print(write_report(Path(args.run_dir)))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_recipe(args) -> int:
    from loomrl.platform.recipe import field_docs

    print("| key | type | default | meaning |\n| --- | --- | --- | --- |")
    for key, tp, default, doc in field_docs():
        print(f"| `{key}` | {tp} | {('`' + default + '`') if default else ''} | {doc} |")
    return 0


# Command groups with their own parsers, in the module that owns the idea.
GROUPS = {
    "shards": ("loomrl.datasets.cli", "prepare, verify and inspect webdataset shards"),
    "bench": ("loomrl.bench", "benchmarks: drafter, encoders (ratios measured side by side)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in GROUPS:
        import importlib

        return importlib.import_module(GROUPS[argv[0]][0]).main(argv[1:])
    ap = argparse.ArgumentParser(
        prog="loomrl", description="Multimodal RL training platform.",
        epilog="more: " + "; ".join(f"loomrl {k} -h: {v[1]}" for k, v in GROUPS.items()))
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run a recipe: loomrl run RECIPE.yaml [key.path=value ...]")
    p.add_argument("recipe", help="YAML recipe file")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides (YAML values)")
    p.add_argument("--out", help="run folder (default runs/NAME-TIMESTAMP)")
    p.add_argument("--dry-run", action="store_true", help="validate and print the resolved recipe")
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("report", help="plot DIR/metrics.jsonl into DIR/report.png")
    p.add_argument("run_dir")
    p.set_defaults(fn=cmd_report)
    p = sub.add_parser("recipe", help="print the recipe reference (every key, type, default)")
    p.set_defaults(fn=cmd_recipe)
    # Overrides may come after options (`run R.yaml --out D a.b=1`): collect them.
    args, extra = ap.parse_known_args(argv)
    if extra:
        if args.command != "run" or any(x.startswith("-") or "=" not in x for x in extra):
            ap.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = args.overrides + extra
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
