"""User code named by a recipe (`module:function`): imported from the Python path, or from the
recipe's own folder (`set_recipe_folder`), with an error naming the key when it is in neither."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any, Optional

from loomrl.config.schema import RecipeError, cut, is_dir, is_file, show

_recipe_folder: Optional[Path] = None
"""The folder of the recipe file being loaded (set by `load_recipe`): a `module:function` whose
module is not importable is also looked for there."""


def set_recipe_folder(folder: Optional[str | Path]) -> None:
    """Where `resolve_callable` also looks for a `module:function`'s module (`load_recipe` sets the
    recipe file's folder, absolute, so the working directory does not matter; None: nowhere)."""
    global _recipe_folder
    _recipe_folder = Path(folder).resolve() if folder is not None else None


def import_beside_recipe(mod: str, spec: str, key: str) -> Any:
    """import_module(mod); when `mod` itself is not found and the recipe's folder holds
    `<top>.py` or a `<top>/` package, that folder is appended to sys.path and the import retried.
    Still not found: a RecipeError naming the key and the module, with the hint."""

    def ours(e: ModuleNotFoundError) -> bool:  # mod (or a parent) is missing, not something it imports
        return e.name is not None and (mod == e.name or mod.startswith(e.name + "."))

    top = mod.split(".")[0]
    try:
        return importlib.import_module(mod)
    except ModuleNotFoundError as e:
        if not ours(e):
            raise
        missing = e.name
    folder = _recipe_folder
    if folder is not None and (is_file(str(folder / f"{top}.py")) or is_dir(str(folder / top))):
        if str(folder) not in sys.path:
            sys.path.append(str(folder))
        importlib.invalidate_caches()
        try:
            return importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if not ours(e):
                raise
            missing = e.name
    beside = f"beside the recipe ({cut(str(folder), 200)})" if folder is not None else "beside the recipe"
    raise RecipeError(
        f"{key}: cannot load {show(spec)}: no module named {show(missing)}; put {top}.py {beside} or on PYTHONPATH"
    )
