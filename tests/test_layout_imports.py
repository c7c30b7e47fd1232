"""The package's import graph, read from the source with `ast`: no import cycle anywhere in
`loomrl/` (imports inside functions count too: a cycle dodged by a local import is still one;
`if TYPE_CHECKING:` imports, for annotations only, do not), and the config core
(`loomrl/config/`) imports nothing else from loomrl."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "loomrl"


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_graph() -> dict[str, set[str]]:
    """module -> the loomrl modules it imports (a `from pkg import name` names pkg.name when that
    is a module, else pkg)."""
    mods = modules()

    def resolve(name: str) -> str:
        while name not in mods and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in mods else ""

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and _type_checking(block.test)
            for stmt in block.body
            for n in ast.walk(stmt)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:  # `if TYPE_CHECKING:` imports are for annotations, never executed
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            graph[mod].update(t for t in map(resolve, targets) if t and t != mod and t.startswith("loomrl"))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_graph_sees_imports_of_every_kind():
    graph = import_graph()
    assert "loomrl.platform.recipe" in graph["loomrl.platform.trainer"]  # `from loomrl.platform import recipe`
    assert "loomrl.config.schema" in graph["loomrl.platform.recipe"]
    assert "loomrl.platform.disaggregated" in graph["loomrl.cli"]  # imported inside a function
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_config_core_imports_nothing_else_from_loomrl():
    graph = import_graph()
    for mod in (m for m in graph if m.startswith("loomrl.config")):
        assert all(t.startswith("loomrl.config") for t in graph[mod]), (mod, graph[mod])


def test_the_core_never_imports_the_commands():
    """doctor, plan, export, report and every bench (loomrl/commands/) use the library; the
    library (everything else but the command line) does not use them."""
    graph = import_graph()
    front = {"loomrl.cli"}
    for mod, targets in graph.items():
        if mod.startswith("loomrl.commands") or mod in front:
            continue
        assert not any(t.startswith("loomrl.commands") for t in targets), (mod, sorted(targets))


def test_the_library_never_imports_test_code():
    """loomrl/testing/ (the tests' reference paths) is imported by tests only."""
    for mod, targets in import_graph().items():
        if not mod.startswith("loomrl.testing"):
            assert not any(t.startswith("loomrl.testing") for t in targets), (mod, sorted(targets))


# Imported inside functions by design: optional heavy dependencies, and libraries whose import costs
# seconds (transformers' model modules: importing the recipe takes 2.9 s with them lazy, 8.3 s at top)
LAZY = {"vllm", "deepspeed", "megatron", "arctic_inference", "transformers", "tokenizers", "matplotlib", "torchaudio"}
LAZY |= {"mpmath"}  # the math reward's fallback
LAZY |= {"wandb", "mlflow"}  # the experiment trackers (the `trackers` extra), imported when one starts
# torch's FSDP2 / DTensor packages: ~1.6 s at import, needed only when the fsdp2 engine is built;
# torch.distributed.checkpoint (~1.2 s), needed only for the fsdp2 engine's sharded state
LAZY_SUBMODULES = {"torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.device_mesh"}
LAZY_SUBMODULES |= {"torch.distributed.checkpoint"}
DISPATCH = {"loomrl/cli.py"}  # the command line loads a command's module when that command runs


def function_imports(path: Path) -> list[str]:
    """'line: module' of each import inside a function of `path` that is not of a LAZY library."""
    out = []
    for f in ast.walk(ast.parse(path.read_text())):
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for n in ast.walk(f):
                if not isinstance(n, (ast.Import, ast.ImportFrom)):
                    continue
                names = [n.module or ""] if isinstance(n, ast.ImportFrom) else [a.name for a in n.names]
                if any(
                    x.split(".")[0] not in LAZY and not any(x == s or x.startswith(s + ".") for s in LAZY_SUBMODULES)
                    for x in names
                ):
                    out.append(f"{n.lineno}: {', '.join(names)}")
    return out


def test_imports_sit_at_module_top():
    found = {
        rel: hits
        for path in PACKAGE.rglob("*.py")
        if (rel := path.relative_to(PACKAGE.parent).as_posix()) not in DISPATCH and (hits := function_imports(path))
    }
    assert not found, found
    assert function_imports(PACKAGE / "cli.py")  # the check sees imports inside functions
