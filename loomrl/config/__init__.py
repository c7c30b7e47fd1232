"""The config core (schema, shard patterns, user plugins): imports nothing else from loomrl, so every
part can declare its config beside its code (docs/extending.md)."""

from loomrl.config.schema import INT_MAX, SEED_MAX, Range, RecipeError, ranged

__all__ = ["INT_MAX", "SEED_MAX", "Range", "RecipeError", "ranged"]
