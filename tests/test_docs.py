"""The docs follow the code: the recipe reference is generated (and cannot drift), the README
stays a front door (<= 20 KB), every relative markdown link points at a file of the repo, and
no file of the repo refers to paths outside it."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_BYTES = 20_000
REGENERATE = ".venv/bin/loomrl recipe --out docs/recipe.md"


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def repo_files() -> list[Path]:
    """Files tracked by git, plus new ones git does not ignore (so a page not committed yet
    is checked too)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if out.returncode != 0:
        pytest.skip(f"not a git checkout: {out.stderr.strip()}")
    return sorted({ROOT / name for name in out.stdout.split("\0") if name})


TEXT_SUFFIXES = {".md", ".py", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".sh"}


def is_text(path: Path) -> bool:
    rel = path.relative_to(ROOT).as_posix()
    return path.suffix in TEXT_SUFFIXES or path.name == "Makefile" or rel == ".ci/run"


def run_recipe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "loomrl.cli", "recipe", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_recipe_reference_is_what_loomrl_recipe_generates(tmp_path):
    out = tmp_path / "recipe.md"
    p = run_recipe("--out", str(out))
    assert p.returncode == 0, p.stderr
    generated = out.read_text()
    header, _, table = generated.partition("\n\n")
    assert "\n" not in header and "generated" in header.lower(), header  # a one-line header says so
    printed = run_recipe()
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == table  # `loomrl recipe` prints the same reference, without the header
    assert printed.stdout.startswith("| key | type | default | meaning |")
    committed = ROOT / "docs" / "recipe.md"
    assert committed.is_file(), f"docs/recipe.md is missing: run `{REGENERATE}`"
    assert committed.read_text() == generated, (
        f"docs/recipe.md differs from what `loomrl recipe` generates now (loomrl/platform/recipe.py "
        f"changed): run `{REGENERATE}`"
    )


def test_readme_is_a_front_door():
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, (
        f"README.md is {size} bytes, over {README_MAX_BYTES}: move the detail into a page under docs/"
    )
    text = (ROOT / "README.md").read_text()
    # CI (.ci/run -> make test) relies on it: the README names the Makefile's two passes.
    makefile = (ROOT / "Makefile").read_text()
    assert "`make test` runs every test" in text
    for shown, ran in (
        ('-n 2 -m "not two_cores" tests', '-n 2 --dist loadgroup -m "not two_cores" tests'),
        ("-m two_cores tests", "-m two_cores tests"),
    ):
        assert shown in text
        assert ran in makefile
    assert "\n## Not yet here\n" in text


FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)


def relative_links(text: str) -> list[str]:
    """The link targets of a markdown text that are paths (not URLs, not in-page anchors),
    outside code blocks and code spans."""
    text = CODE_SPAN.sub("", FENCE.sub("", text))
    targets = INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)
    return [t for t in targets if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", t) and not t.startswith("#")]


def test_relative_links_point_at_files_of_the_repo():
    problems = []
    checked = 0
    for md in markdown_files():
        for target in relative_links(md.read_text()):
            path = target.split("#", 1)[0].split("?", 1)[0]
            resolved = (ROOT / path.lstrip("/")) if path.startswith("/") else (md.parent / path)
            resolved = resolved.resolve()
            where = f"{md.relative_to(ROOT)}: ({target})"
            checked += 1
            if not resolved.is_relative_to(ROOT):
                problems.append(f"{where} points outside the repo")
            elif not resolved.exists():
                problems.append(f"{where} points at {resolved.relative_to(ROOT)}, which does not exist")
    assert checked > 0
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_link_finder():
    text = (
        '[a](docs/x.md) ![img](p.png "t") [`code`](../y.py#L3) [web](https://e.org) [in](#top)\n'
        "`[not](a/link.md)`\n```\n[not](either.md)\n```\n[ref]: docs/z.md\n"
    )
    assert relative_links(text) == ["docs/x.md", "p.png", "../y.py#L3", "docs/z.md"]


# "../" once or more followed by a name, not inside a longer path (x/../../y stays inside x)
ESCAPE = re.compile(r"(?<![\w./\\-])((?:\.\./)+)([A-Za-z_][\w.-]*)")
OUTSIDE_NAMES = re.compile(r"\.\./" + "shared" + r"\b")  # the folder beside the checkout, by name


def test_no_file_refers_to_paths_outside_the_repo():
    """A reference such as the workspace folder beside the checkout means nothing in a fresh
    clone: every path a file names must resolve inside the repo (from the file's folder)."""
    problems = []
    for path in repo_files():
        if not path.is_file() or not is_text(path):
            continue
        rel = path.relative_to(ROOT)
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE_NAMES.search(line):
                problems.append(f"{rel}:{n}: {line.strip()[:160]}")
                continue
            for m in ESCAPE.finditer(line):
                target = (path.parent / (m.group(1) + m.group(2))).resolve()
                if not target.is_relative_to(ROOT):
                    problems.append(f"{rel}:{n}: {m.group(0)} leaves the repo: {line.strip()[:160]}")
    assert not problems, (
        "files refer to paths outside the repo (name the file's role instead, e.g. "
        "`--traces PATH`):\n" + "\n".join(problems)
    )
