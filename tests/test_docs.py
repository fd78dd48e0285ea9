"""The README and docs/ stay true to the repository: links resolve, commands parse, named files exist.

Checked in README.md and every docs/*.md (and the files docs/glossary.md names under saguaro/):
  * every relative Markdown link points at a file that exists (and, with ``#anchor``, at a heading of it);
  * every ``saguaro ...`` / ``python -m saguaro.cli ...`` command in a bash code block parses with the CLI's
    own parser (parsed, never run), and ``saguaro bench NAME`` names a script in benchmarks/;
  * every ``python -m benchmarks.X`` names a module there, and every ``benchmarks/``, ``scripts/`` or
    ``results/`` path exists;
  * the README stays a front door (under 160 lines), and its test command is the one CI runs (``.ci/run``).
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from saguaro.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
# a repository path: a template such as benchmarks/bench_<name>.py (followed by "<") is not one
REPO_PATH = re.compile(r"(?<![\w./~-])((?:benchmarks|scripts|results)/[\w./-]*\w)(?![\w<])")
BENCH_MODULE = re.compile(r"python3? -m benchmarks\.(\w+)")


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", page.read_text(), re.M)}


def _links() -> list[tuple[str, str]]:
    return [(_rel(page), m.group(1)) for page in PAGES for m in LINK.finditer(page.read_text())
            if not re.match(r"[a-z]+:", m.group(1))]


def _commands() -> list[tuple[str, list[str]]]:
    """Each saguaro command of the pages' bash blocks, as the words the shell would pass to it."""
    found = []
    for page in PAGES:
        for block in CODE_BLOCK.findall(page.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                for part in line.split("&&"):
                    words = shlex.split(part, comments=True)
                    if words[:1] == ["saguaro"]:
                        found.append((_rel(page), words[1:]))
                    elif words[:3] in (["python", "-m", "saguaro.cli"], ["python3", "-m", "saguaro.cli"]):
                        found.append((_rel(page), words[3:]))
    return found


def _paths() -> list[tuple[str, str]]:
    return sorted({(_rel(page), m.group(1)) for page in PAGES for m in REPO_PATH.finditer(page.read_text())})


def test_the_pages_exist_and_show_commands():
    assert len(PAGES) > 5 and _links() and _commands() and _paths()


@pytest.mark.parametrize("page,target", _links())
def test_relative_links_resolve(page, target):
    path, _, anchor = target.partition("#")
    file = (ROOT / page).parent / path if path else ROOT / page
    assert file.exists(), f"{page}: link {target!r} points at a missing file"
    if anchor:
        assert anchor in _anchors(file), f"{page}: link {target!r}: no heading with that anchor in {path or page}"


@pytest.mark.parametrize("page,words", _commands(), ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_commands_parse(page, words):
    try:
        args = build_parser().parse_args(words)
    except SystemExit as e:
        pytest.fail(f"{page}: `saguaro {shlex.join(words)}` does not parse (exit {e.code})")
    if args.command == "bench":
        assert (ROOT / "benchmarks" / f"bench_{args.name}.py").exists(), f"{page}: no benchmark {args.name!r}"


@pytest.mark.parametrize("page,path", _paths())
def test_named_paths_exist(page, path):
    assert (ROOT / path).exists(), f"{page} names {path}, which does not exist"


@pytest.mark.parametrize("page", [_rel(p) for p in PAGES])
def test_benchmark_modules_exist(page):
    for module in BENCH_MODULE.findall((ROOT / page).read_text()):
        assert (ROOT / "benchmarks" / f"{module}.py").exists(), f"{page}: no module benchmarks.{module}"


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) < 160, f"README.md has {len(lines)} lines: move the depth into docs/"


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1].strip()
    blocks = CODE_BLOCK.findall(README.read_text())
    commands = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    assert ci in commands, f".ci/run runs {ci!r}, which the README's commands do not show"


def _glossary_files() -> list[str]:
    """The files and folders the glossary's "where" column names (paths under saguaro/)."""
    rows = [line.split("|") for line in (ROOT / "docs" / "glossary.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| word")]
    return sorted({m for row in rows for m in re.findall(r"`([\w/]+(?:\.py|/))`", row[3])})


@pytest.mark.parametrize("path", _glossary_files())
def test_glossary_files_exist(path):
    assert (ROOT / "saguaro" / path).exists(), f"docs/glossary.md names saguaro/{path}, which does not exist"
