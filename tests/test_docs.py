"""The documentation stays true to the repository.

- Every command shown in a shell block of README.md or docs/*.md parses: ``sangam``,
  ``sangam-bench`` and ``python -m sangam...`` command lines go through the real argparse
  parser of that command (in-process; nothing runs), so a flag that does not exist, a bad
  choice or a missing argument fails here. ``make`` targets exist in the Makefile, ``curl``
  URLs are routes of the server and their bodies are JSON, and scripts run with ``python``
  exist.
- Inline commands (a code span beginning with one of those commands) parse the same way,
  except that a span may name a command without its required arguments; and every flag a code
  span mentions is one of Sangam's flags (or a listed flag of another tool).
- Every file a doc links to, or names as a repository path in a code span, exists, and so
  does every heading a link points to.
- README.md is at most 300 lines.
- Code under sangam/ cites the design contract as docs/design.md and nothing that is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300

SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])(?![\w])")
REPO_PATH = re.compile(r"^(?:sangam|tests|csrc|scripts|examples|microbench|docs)/[\w./-]*\w$")
PLACEHOLDER = re.compile(r"(?<![\w-])[A-Z][A-Z_]*(?![\w-])")  # M, DIR, OUTDIR in a pattern
PYTHONS = {"python", "python3", ".venv/bin/python", ".venv/bin/python3"}
SEPARATORS = {"&&", "||", ";", "|"}
# What argparse says of a command named in prose rather than shown whole (`sangam-bench sim`,
# `--plot` without its file): fine inline; a fenced command line must be complete.
FRAGMENT_ERRORS = ("the following arguments are required", "expected one argument")

# Flags of other tools that the docs' code spans name beside Sangam's (add them here).
OTHER_TOOLS_FLAGS: set[str] = set()
# `python -m MODULE` for a package whose __main__ runs on import: the module with its main().
MAIN_OF = {"sangam.serve": "sangam.serve.server"}


def _relative(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


# ---------------------------------------------------------------------------------------------
# Extraction


def _shell_lines(text: str) -> Iterator[str]:
    """Each logical line of the shell blocks of ``text``: backslash continuations joined, a
    leading ``$ `` prompt removed."""
    for match in FENCE.finditer(text):
        if match.group(1).lower() not in SHELL_LANGS:
            continue
        pending = ""
        for raw in match.group(2).splitlines():
            line = pending + raw.strip()
            if line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            if _open_quote(line):
                pending = line + "\n"
                continue
            pending = ""
            yield line.removeprefix("$ ")
        if pending:
            yield pending.removeprefix("$ ")


def _open_quote(line: str) -> bool:
    """Whether a quotation begun on ``line`` goes on to the next line."""
    try:
        shlex.split(line, comments=True)
    except ValueError as e:
        return "quotation" in str(e)
    return False


def _commands(line: str, env: dict[str, str]) -> Iterator[list[str]]:
    """The simple commands of a shell line, variables from ``env`` expanded; an assignment
    alone on a line (``F="..."``) is recorded in ``env`` instead."""
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        tokens = list(lexer)
    except ValueError:  # not shell (a diagram, a table): nothing to check
        return
    words: list[str] = []
    for tok in tokens + [";"]:
        if tok in SEPARATORS:
            while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
                name, value = words.pop(0).split("=", 1)
                if not words:
                    env[name] = value
            if words:
                yield words
            words = []
        elif re.fullmatch(r"\$\{?\w+\}?", tok):
            words.extend(shlex.split(env.get(tok.strip("${}"), tok)))
        else:
            words.append(tok)


def _checked(prog: str) -> bool:
    return prog.startswith(".venv/bin/") or prog in (*PYTHONS, "sangam", "sangam-bench", "make",
                                                     "curl")


def _doc_commands() -> list[tuple[str, list[str]]]:
    found = []
    for doc in DOCS:
        env: dict[str, str] = {}
        for line in _shell_lines(doc.read_text()):
            for words in _commands(line, env):
                if _checked(words[0]):
                    found.append((_relative(doc), words))
    return found


def _inline_spans(doc: Path) -> Iterator[str]:
    text = FENCE.sub("", doc.read_text())
    for match in INLINE.finditer(text):
        yield match.group(1).strip()


# ---------------------------------------------------------------------------------------------
# Parsing a command line with its real parser, without running it


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


@contextlib.contextmanager
def _parse_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make the first top-level ``parse_args`` stop the program right after it parses.
    Subparsers parse through ``parse_known_args``, so they run as usual."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed(self)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_args)
        yield


def _entry_point(words: list[str]) -> tuple[object, list[str]] | None:
    """The main(argv) that would handle this command line, and its argv; None when the
    command is not Sangam's."""
    prog = words[0].removeprefix(".venv/bin/")
    if prog == "sangam":
        return importlib.import_module("sangam.cli").main, words[1:]
    if prog == "sangam-bench":
        return importlib.import_module("sangam.bench.cli").main, words[1:]
    if words[0] in PYTHONS and words[1:2] == ["-m"] and words[2].split(".")[0] == "sangam":
        module = importlib.import_module(MAIN_OF.get(words[2], words[2]))
        assert hasattr(module, "main"), f"python -m {words[2]}: the module has no main()"
        return module.main, words[3:]
    return None


def _parse(main, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> str | None:
    """None if ``main(argv)`` parses its arguments; else argparse's complaint."""
    err = io.StringIO()
    with _parse_only(monkeypatch), contextlib.redirect_stderr(err), \
            contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except _Parsed:
            return None
        except SystemExit as e:  # --help exits 0; an argparse error exits 2
            if e.code in (0, None):
                return None
            complaint = err.getvalue().strip().splitlines()  # usage, then "prog: error: ..."
            return complaint[-1] if complaint else f"exit {e.code}"
    return "the command parsed nothing (it would have run)"


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {t for line in re.findall(r"^([\w. -]+):(?!=)", text, re.M) for t in line.split()}


def _server_source() -> str:
    return "\n".join(p.read_text() for p in (ROOT / "sangam" / "serve").glob("*.py"))


def _route_known(path: str, source: str) -> bool:
    """Whether the server declares a route matching ``path`` (``{param}`` segments match)."""
    for route in set(re.findall(r"\"(/[\w/{}:.-]*)\"", source)):
        pattern = re.sub(r"\\\{[^}]*\\\}", r"[^/]+", re.escape(route))
        if re.fullmatch(pattern, path):
            return True
    return False


def _check_other(words: list[str]) -> str | None:
    """Make targets, curl requests and python scripts; None when fine (or not ours)."""
    prog = words[0].removeprefix(".venv/bin/")
    if prog == "make":
        targets = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
        missing = sorted(set(targets) - _make_targets())
        return f"no make target {missing}" if missing else None
    if prog == "curl":
        urls = [w for w in words[1:] if re.match(r"https?://", w)]
        if not urls:
            return "curl without a URL"
        source = _server_source()
        for url in urls:
            path = re.sub(r"^https?://[^/]+", "", url).split("?")[0] or "/"
            if not _route_known(path, source):
                return f"the server has no route {path}"
        for i, w in enumerate(words[:-1]):
            if w in ("-d", "--data", "--data-raw"):
                import json

                try:
                    json.loads(words[i + 1])
                except ValueError as e:
                    return f"curl body is not JSON: {e}"
        return None
    if words[0] in PYTHONS and len(words) > 1 and words[1].endswith(".py"):
        return None if (ROOT / words[1]).is_file() else f"no script {words[1]}"
    return None


def _known_flags(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Every option string of every Sangam command line, subcommands included."""
    flags: set[str] = set()

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            flags.update(s for s in action.option_strings if s.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)

    # The repository's scripts' own flags (scripts/*.py, microbench/*.sh).
    for script in [*(ROOT / "scripts").rglob("*.py"), *(ROOT / "microbench").glob("*.sh")]:
        flags.update(re.findall(r"[\"'(\s](--[a-z][a-z0-9-]*)[\"')]", script.read_text()))
    walk(importlib.import_module("sangam.bench.cli").build_parser())
    for words in (["sangam", "serve"], ["python", "-m", "sangam.testing", "DIR"],
                  ["python", "-m", "sangam.engine.multi.node"]):
        main, argv = _entry_point(words)
        with _parse_only(monkeypatch), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            try:
                main(argv)
            except _Parsed as parsed:
                walk(parsed.parser)
    return flags


# ---------------------------------------------------------------------------------------------
# Tests

COMMANDS = _doc_commands()


def test_the_docs_show_commands():
    progs = {w[0].removeprefix(".venv/bin/") for _, w in COMMANDS}
    assert {"make", "sangam-bench", "curl"} <= progs, progs


@pytest.mark.parametrize("doc,words", COMMANDS,
                         ids=[f"{d}:{' '.join(w)[:60]}" for d, w in COMMANDS])
def test_every_shown_command_parses(doc, words, monkeypatch):
    entry = _entry_point(words)
    problem = _parse(*entry, monkeypatch) if entry else _check_other(words)
    assert problem is None, f"{doc}: `{shlex.join(words)}`: {problem}"


def test_inline_commands_parse_and_flags_exist(monkeypatch):
    known = _known_flags(monkeypatch) | OTHER_TOOLS_FLAGS
    problems = []
    for doc in DOCS:
        for span in _inline_spans(doc):
            unknown = [f for f in FLAG.findall(span) if f not in known]
            if unknown:
                problems.append(f"{_relative(doc)}: `{span}`: no such flag {unknown}")
                continue
            if any(c in span for c in ("...", "|", "<")) or PLACEHOLDER.search(span):
                continue  # a pattern (`--model M`, `sim|serve ...`), not a command line
            try:
                words = shlex.split(span)
            except ValueError:
                continue
            entry = _entry_point(words) if words else None
            problem = _parse(*entry, monkeypatch) if entry else None
            if problem and not any(e in problem for e in FRAGMENT_ERRORS):
                problems.append(f"{_relative(doc)}: `{span}`: {problem}")
    assert not problems, "\n".join(problems)


def _anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file."""
    anchors = set()
    for line in FENCE.sub("", doc.read_text()).splitlines():
        if match := re.match(r"#{1,6}\s+(.*)", line):
            title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1)).strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_linked_files_exist():
    missing = []
    for doc in DOCS:
        text = FENCE.sub("", doc.read_text())
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (doc.parent / path) if path else doc
            if not linked.exists():
                missing.append(f"{_relative(doc)} links to {target}")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                missing.append(f"{_relative(doc)} links to {target}: no such heading")
        for span in _inline_spans(doc):
            if REPO_PATH.match(span) and not any(c in span for c in "*{}"):
                if not (ROOT / span).exists():
                    missing.append(f"{_relative(doc)} names {span}")
    assert not missing, "\n".join(missing)


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the details go in docs/"


def _citations(pattern: str) -> list[str]:
    found = []
    for path in sorted((ROOT / "sangam").rglob("*")):
        if path.suffix in (".py", ".cpp", ".h", ".md") and path.is_file():
            for n, line in enumerate(path.read_text().splitlines(), 1):
                for cited in re.findall(pattern, line):
                    found.append((f"{path.relative_to(ROOT)}:{n}", cited))
    return found


def test_code_cites_the_design_contract_in_docs():
    stale = [where for where, _ in _citations(r"DESIGN\.md")]
    assert not stale, f"{len(stale)} citations of DESIGN.md (now docs/design.md): {stale[:5]}"


def test_cited_docs_exist():
    missing = [f"{where}: {cited}" for where, cited in _citations(r"docs/[\w./-]+\.md")
               if not (ROOT / cited).is_file()]
    assert not missing, missing
