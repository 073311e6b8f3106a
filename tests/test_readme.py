"""The README's examples run as written (against real daemons), and what it states about the CLI,
its links and its numbers stays true of this checkout."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import ROOT, child_env

README = (ROOT / "README.md").read_text()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)
DOCS = sorted((ROOT / "docs").glob("*.md"))
# One marker per python example, each run by a test below: a new example needs a test here.
EXAMPLE_MARKERS = ('kvd.connect("default")', "PagedKVCache(", "generate_with_kvd(")
# "at 14:54", "today", "on 2026-12-03": a figure names the command that makes it, not its hour
# (history lives in git).
CLOCK_TIME = re.compile(r"\b(?:[01]?\d|2[0-3]):[0-5]\d\b|\btoday\b|\b20\d\d-\d\d-\d\d\b",
                        flags=re.IGNORECASE)


def _block(marker: str) -> str:
    (block,) = [b for b in PYTHON_BLOCKS if marker in b]
    return block


def _found(pattern: str, text: str, flags: int = 0) -> str:
    """The first group of `pattern` in `text`, which must match."""
    match = re.search(pattern, text, flags)
    assert match is not None, f"{pattern!r} not found"
    return match.group(1)


def _run(code: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=child_env(HF_HUB_OFFLINE="1"),
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


def test_every_python_example_is_run_by_a_test():
    for block in PYTHON_BLOCKS:
        assert any(marker in block for marker in EXAMPLE_MARKERS), block


def test_client_example_runs_against_a_daemon(kvd_daemon):
    code = _block('kvd.connect("default")').replace('"default"', repr(kvd_daemon.name))
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert "'sessions'" in result.stdout


def test_embedded_example_runs_and_prints_what_it_says():
    result = _run(_block("PagedKVCache("))
    assert result.returncode == 0, result.stderr
    expected = _found(r"# (\{'total_blocks'.*?), \.\.\.\}", _block("PagedKVCache("))
    assert result.stdout.startswith(expected)


@pytest.mark.integration
def test_transformers_example_runs_against_the_daemon_it_names(daemon_factory):
    if os.environ.get("KVD_REQUIRE_ENGINES") != "1":
        pytest.importorskip("torch", reason="`pip install -e '.[engines]'` runs this example")
        pytest.importorskip("transformers", reason="`pip install -e '.[engines]'`")
    code = _block("generate_with_kvd(")
    start = shlex.split(_found(r"# kvd start --name hf (.+)", code))
    daemon = daemon_factory(start)
    result = _run(code.replace('"hf"', repr(daemon.name)), timeout_s=300)
    assert result.returncode == 0, result.stderr
    expected = _found(r"print\(first.*# (\d+ \d+):", code)
    assert result.stdout.split("\n")[0] == expected


def test_ci_runs_the_readme_test_command():
    command = _found(r"# 2\. install and run the tests.*\n(.+)\n", README)
    assert command in (ROOT / ".ci" / "run").read_text()


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    from kvd.cli import build_parser

    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_cli_synopsis_names_every_command_and_flag():
    synopsis = _found(r"## The `kvd` command\n\n```\n(.*?)```", README, re.DOTALL)
    lines: dict[str, str] = {}
    for line in synopsis.splitlines():  # a command's line and its continuation lines
        command = re.match(r"kvd (\w+)", line)
        if command:
            current = command.group(1)
        lines[current] = lines.get(current, "") + line
    assert set(lines) == set(_subcommands())
    for name, parser in _subcommands().items():
        flags = {option for action in parser._actions for option in action.option_strings
                 if option.startswith("--") and option != "--help"}
        missing = sorted(flag for flag in flags if not re.search(rf"[\[|] ?{flag}\b", lines[name]))
        assert not missing, f"the README's `kvd {name}` synopsis lacks {missing}"


def test_relative_links_resolve():
    for path in [ROOT / "README.md", *DOCS]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text()):
            assert (path.parent / target).exists(), f"{path.name} links to missing {target}"


def test_no_clock_time_logs_in_readme_or_docs():
    for path in [ROOT / "README.md", *DOCS]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not CLOCK_TIME.search(line), f"{path.name}:{number}: {line}"
