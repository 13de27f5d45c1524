"""The user docs (README.md, docs/*.md) hold: their links resolve and their commands run.

What is checked, page by page:

* **Links.** Every relative link ``[text](path#anchor)`` resolves: the file or folder
  exists, and an ``#anchor`` names a heading of the page it points to (GitHub's rule:
  lower case, punctuation dropped, spaces to hyphens, ``-1``, ``-2`` for repeats).
  URLs are not fetched.
* **Python blocks** (```` ```python ````) parse.
* **Shell blocks** (```` ```bash ````, ``sh``, ``shell``): every line is a command (a
  trailing backslash joins the next line; blank lines and ``#`` lines are skipped). Each
  page runs in a fresh directory of its own that links ``examples``, ``scripts``,
  ``tests`` and ``tools`` from the repository, its blocks in page order (a later block may
  use what an earlier one wrote), with this environment's ``bin/`` first on ``PATH``. An
  ``autopartition`` command runs in this process (``partitioner.cli.main``, no second torch
  import); any other runs in ``bash``; each must exit 0 within ``_TIMEOUT_S``. A planning
  command another page already ran with the same arguments (``--out`` aside) gets a copy
  of that plan directory instead of planning again.

Markers: an HTML comment alone on the line before a block's fence (GitHub does not show it):

* ``<!-- docs: long -->``: the block takes over a few seconds or spawns ranks (``verify``,
  ``run``, large models, benchmarks, the demo, the suite);
* ``<!-- docs: gpu -->``: the block needs GPUs or several machines;
* ``<!-- docs: file NAME -->``: the block is not run but written to ``NAME`` in the page's
  directory (a model file that later commands use).

Commands of ``long`` and ``gpu`` blocks are not run but checked, so that a renamed option
or a moved file still fails here:

* ``autopartition ...``: parsed by the command's own parser (options, values, choices);
  ``run``'s torchrun options by torchrun's parser; ``MODEL.py[:FACTORY]`` exists and
  defines ``FACTORY`` (else ``build_model`` or ``model``);
* ``python FILE``, ``bash FILE`` and the script after ``run ... --``: ``FILE`` exists, and
  each ``--option`` given to a Python script is a string literal in its source;
  ``python -m MODULE``: the module is importable;
* every other ``*.py`` argument exists; environment assignments (``NAME=value``) are
  skipped; a program other than those and ``torchrun`` fails (add it here when the docs
  need one).

An unknown marker, a marker that is not followed by a fence, or an unterminated fence
fails too.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib.util
import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

_ROOT = Path(__file__).resolve().parents[1]
_PAGES = [_ROOT / "README.md", *sorted((_ROOT / "docs").glob("*.md"))]
_LINKED = ("examples", "scripts", "tests", "tools")  # what the commands name, linked into each page's directory
_SHELLS = ("bash", "sh", "shell")
_MARKER = re.compile(r"^<!--\s*docs:\s*(.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_TIMEOUT_S = 60
_OPERATORS = {"&&", "||", ";", "|"}

# Identical planning commands across pages: (argv without --out) -> the plan directory made.
_PLANNED: dict[tuple[str, ...], Path] = {}


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    text: str
    marker: str  # "", "long", "gpu" or "file NAME"


# ----------------------------------------------------------------- reading pages


def _page_id(page: Path) -> str:
    return str(page.relative_to(_ROOT)) if page.is_relative_to(_ROOT) else page.name


def read_blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` with their markers; a stray marker or open fence raises."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    marker, marker_line, i = "", 0, 0
    while i < len(lines):
        line = lines[i]
        found = _MARKER.match(line.strip())
        if found:
            marker, marker_line = found.group(1), i + 1
            if not re.fullmatch(r"long|gpu|file \S+", marker):
                raise ValueError(f"{_page_id(page)}:{i + 1}: unknown docs marker {marker!r}")
            i += 1
            continue
        fence = _FENCE.match(line)
        if fence:
            start, close = i, fence.group(1)
            i += 1
            while i < len(lines) and not lines[i].startswith(close):
                i += 1
            if i == len(lines):
                raise ValueError(f"{_page_id(page)}:{start + 1}: a fence that never closes")
            if marker and marker_line != start:
                raise ValueError(f"{_page_id(page)}:{marker_line}: a docs marker not on the line before a fence")
            blocks.append(Block(page, start + 1, fence.group(2).lower(), "\n".join(lines[start + 1:i]) + "\n", marker))
            marker = ""
        elif marker and line.strip():
            raise ValueError(f"{_page_id(page)}:{marker_line}: a docs marker not on the line before a fence")
        i += 1
    if marker:
        raise ValueError(f"{_page_id(page)}:{marker_line}: a docs marker at the end of the page")
    return blocks


def commands(block: Block) -> list[str]:
    """The command lines of a shell block: continuations joined, blanks and comments dropped."""
    found: list[str] = []
    pending = ""
    for raw in block.text.splitlines():
        line = (pending + " " + raw.strip()).strip() if pending else raw.strip()
        if line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        pending = ""
        if line and not line.startswith("#"):
            found.append(line)
    if pending:
        found.append(pending)
    return found


def _prose(page: Path) -> Iterator[str]:
    """The page's lines outside fenced blocks."""
    inside = ""
    for line in page.read_text().splitlines():
        fence = _FENCE.match(line)
        if fence and not inside:
            inside = fence.group(1)
        elif inside and line.startswith(inside):
            inside = ""
        elif not inside:
            yield line


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of ``page``."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for line in _prose(page):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    """Every relative link of ``page`` that does not resolve, with why."""
    broken = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path_text, _, anchor = target.partition("#")
            path = (page.parent / path_text).resolve() if path_text else page
            where = f"{_page_id(page)}:{number}: {target}"
            if not path.exists():
                broken.append(f"{where}: no such file")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{where}: no heading with that anchor in {path.name}")
    return broken


# ----------------------------------------------------------------- checking commands


@contextlib.contextmanager
def _time_limit(seconds: int, what: str) -> Iterator[None]:
    def expire(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"{what}: over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _parse(parser: argparse.ArgumentParser, args: list[str], *, known: bool = False) -> argparse.Namespace:
    """Parse as the command would; an argparse error becomes an AssertionError with its message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if known:
                return parser.parse_known_args(args)[0]
            return parser.parse_args(args)
    except SystemExit as exc:
        if exc.code == 0:  # --help
            return argparse.Namespace()
        raise AssertionError(err.getvalue().strip()) from None


def _defines(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
    return False


def _check_model(spec: str) -> None:
    path_text, _, factory = spec.partition(":")
    path = Path(path_text)
    assert path.is_file(), f"model file {path_text} does not exist"
    if factory:
        assert _defines(path, factory), f"{path_text} defines no factory {factory}"
    else:
        assert _defines(path, "build_model") or _defines(path, "model"), f"{path_text} defines no build_model"


def _check_script(args: list[str]) -> None:
    """``FILE [args]`` run by Python: the file exists and names every --option given to it."""
    assert args, "python without a script"
    if args[0] == "-c":
        return
    if args[0] == "-m":
        assert importlib.util.find_spec(args[1]) is not None, f"no module {args[1]}"
        return
    path = Path(args[0])
    assert path.is_file(), f"script {args[0]} does not exist"
    source = path.read_text()
    for option in (a.split("=", 1)[0] for a in args[1:] if a.startswith("--")):
        assert f'"{option}"' in source or f"'{option}'" in source, f"{args[0]} has no option {option}"


def _check_autopartition(args: list[str]) -> None:
    from partitioner import cli

    if args and args[0] == "run":
        own, script = (args[1:args.index("--")], args[args.index("--") + 1:]) if "--" in args else (args[1:], [])
        parser = cli._run_parser()
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                _, torchrun_args = parser.parse_known_args(own)
        except SystemExit:
            raise AssertionError(err.getvalue().strip()) from None
        if torchrun_args:
            from torch.distributed.run import get_args_parser

            _parse(get_args_parser(), [*torchrun_args, "script.py"])
        assert script, "autopartition run without `-- script.py`"
        _check_script(script)
        return
    parsers = {"show": cli._show_parser, "verify": cli._verify_parser,
               "calibrate": cli._calibrate_parser, "export": cli._export_parser}
    if args and args[0] in parsers:
        parsed = _parse(parsers[args[0]](), args[1:])
    else:
        parsed = _parse(cli._plan_parser(), args)
    if getattr(parsed, "model", None):
        _check_model(parsed.model)


def _parts(line: str) -> list[list[str]]:
    """The simple commands of a shell line: split at operators, redirections and assignments dropped."""
    tokens = shlex.split(line, comments=True)
    parts: list[list[str]] = [[]]
    skip = False
    for token in tokens:
        if skip:
            skip = False
        elif token in _OPERATORS:
            parts.append([])
        elif re.fullmatch(r"\d*>>?", token):
            skip = True  # the file it redirects to
        elif not re.fullmatch(r"\d*>>?&?\S*", token) and not (parts[-1] == [] and "=" in token):
            parts[-1].append(token)  # a redirection (2>&1, >file) or a leading NAME=value is dropped
    return [p for p in parts if p]


def check_command(line: str) -> None:
    """What a command that is not run must satisfy (see the module docstring)."""
    for program, *args in _parts(line):
        for arg in args:
            if arg.endswith(".py") or ".py:" in arg:
                assert Path(arg.split(":")[0]).exists(), f"{arg.split(':')[0]} does not exist"
        if program == "autopartition":
            _check_autopartition(args)
        elif program in ("python", "python3"):
            _check_script(args)
        elif program in ("bash", "sh"):
            assert args and Path(args[0]).is_file(), f"script {args[:1]} does not exist"
        elif program == "torchrun":
            from torch.distributed.run import get_args_parser

            _parse(get_args_parser(), args)
        else:
            raise AssertionError(f"unknown program {program!r} (tests/test_docs.py knows autopartition, python, bash, torchrun)")


def _planning_key(args: list[str]) -> tuple[tuple[str, ...], str] | None:
    """(argv without --out, the --out directory) of a planning command of the repository's examples; else None."""
    if not args or not args[0].startswith("examples/") or "--force" in args:
        return None
    rest: list[str] = []
    out, i = "plan", 0
    while i < len(args):
        if args[i] == "--out" and i + 1 < len(args):
            out, i = args[i + 1], i + 2
        elif args[i].startswith("--out="):
            out, i = args[i].partition("=")[2], i + 1
        else:
            rest, i = [*rest, args[i]], i + 1
    return tuple(rest), out


def run_command(line: str, directory: Path) -> tuple[int, str]:
    """Run one command line in ``directory``: its exit code and output."""
    parts = _parts(line)
    simple = len(parts) == 1 and not re.search(r"[|;&<>`$]", line)
    if simple and parts[0][0] == "autopartition":
        from partitioner.cli import main

        args = parts[0][1:]
        key = _planning_key(args)
        if key is not None and key[0] in _PLANNED:  # the same plan, made by another page
            shutil.copytree(_PLANNED[key[0]], directory / key[1], dirs_exist_ok=True)
            return 0, f"(copied from {_PLANNED[key[0]]})"
        out, err = io.StringIO(), io.StringIO()
        with _time_limit(_TIMEOUT_S, line), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(args)
        if code == 0 and key is not None:
            _PLANNED[key[0]] = directory / key[1]
        return code, out.getvalue() + err.getvalue()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    try:
        done = subprocess.run(["bash", "-eo", "pipefail", "-c", line], check=False, cwd=directory, env=env,
                              capture_output=True, text=True, timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return 124, f"over {_TIMEOUT_S} s"
    return done.returncode, done.stdout + done.stderr


def run_page(page: Path, directory: Path) -> list[str]:
    """Run or check every block of ``page`` from ``directory`` (the current directory); the failures."""
    for name in _LINKED:
        (directory / name).symlink_to(_ROOT / name, target_is_directory=True)
    failures = []
    for block in read_blocks(page):
        where = f"{_page_id(page)}:{block.line}"
        if block.language == "python" and not block.marker.startswith("file "):
            try:
                ast.parse(block.text)
            except SyntaxError as exc:
                failures.append(f"{where}: python block does not parse: {exc}")
        if block.marker.startswith("file "):
            target = directory / block.marker.split(maxsplit=1)[1]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.text)
            continue
        if block.language not in _SHELLS:
            continue
        for line in commands(block):
            try:
                if block.marker:  # long or gpu: checked, not run
                    check_command(line)
                    continue
                code, output = run_command(line, directory)
            except AssertionError as exc:
                failures.append(f"{where}: {line}\n    {exc}")
                continue
            if code != 0:
                tail = "\n".join(output.strip().splitlines()[-15:])
                failures.append(f"{where}: {line}\n    exit {code}:\n{tail}")
    return failures


# ----------------------------------------------------------------- tests


@pytest.mark.parametrize("page", _PAGES, ids=_page_id)
def test_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


@pytest.mark.parametrize("page", _PAGES, ids=_page_id)
def test_commands_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    failures = run_page(page, tmp_path)
    assert not failures, "\n".join(failures)


def test_every_page_is_linked_from_the_readme_or_the_index() -> None:
    linked = {
        (page.parent / target.partition("#")[0]).resolve()
        for page in (_ROOT / "README.md", _ROOT / "docs" / "README.md")
        for target in _LINK.findall(page.read_text())
    }
    assert [p.name for p in _PAGES[1:] if p.resolve() not in linked and p.name != "README.md"] == []


def test_the_check_fails_on_a_broken_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A misspelt option in a long block, a command that fails, a renamed factory, a dead link: each is caught."""
    docs = tmp_path / "docs"
    docs.mkdir()
    page = docs / "broken.md"
    page.write_text(
        "# Broken\n\nSee [the plan](plan-format.md) and [here](#nowhere).\n\n"
        "<!-- docs: long -->\n```bash\n"
        "autopartition examples/llama.py:llama3_70b --gpus 64 --device h100 --precison bf16-mixed\n"
        "autopartition examples/llama.py:llama4_70b --gpus 64 --device h100\n"
        "autopartition run plan/ --nnodez 2 -- examples/train_gpt.py --steps 3\n"
        "```\n\n```bash\nautopartition show no-plan/\n```\n"
    )
    assert [b.split(": ")[-1] for b in broken_links(page)] == ["no such file", "no heading with that anchor in broken.md"]
    monkeypatch.chdir(tmp_path)
    failures = run_page(page, tmp_path)
    assert len(failures) == 4, "\n".join(failures)
    assert "--precison" in failures[0]
    assert "no factory llama4_70b" in failures[1]
    assert "--nnodez" in failures[2]
    assert "exit 2" in failures[3]
    with pytest.raises(ValueError, match="unknown docs marker"):
        page.write_text("<!-- docs: slow -->\n```bash\nls\n```\n")
        read_blocks(page)
