"""`loomrl bench NAME ...`: benchmarks that print ratios measured side by side in one run.

Each benchmark is a module with a `main(argv) -> int`; this file only dispatches.
"""

from __future__ import annotations

import importlib
import sys

BENCHES = {
    "attention": "loomrl.commands.bench_attention",
    "demo": "loomrl.commands.bench_demo",
    "drafter": "loomrl.commands.bench_drafter",
    "encoders": "loomrl.commands.bench_encoders",
    "rollout": "loomrl.commands.bench_rollout",
    "shards": "loomrl.commands.bench_shards",
    "staleness": "loomrl.commands.bench_staleness",
    "sync": "loomrl.commands.bench_sync",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHES:
        print("usage: loomrl bench {" + ",".join(BENCHES) + "} [options]   (loomrl bench NAME -h)", file=sys.stderr)
        return 2
    return importlib.import_module(BENCHES[argv[0]]).main(argv[1:])
