"""The README's examples run as written (against a real daemon for the client example)."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT, child_env

README = (ROOT / "README.md").read_text()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)


def _block(marker: str) -> str:
    (block,) = [b for b in PYTHON_BLOCKS if marker in b]
    return block


def test_client_example_runs_against_a_daemon(kvd_daemon):
    code = _block('kvd.connect("default")').replace('"default"', repr(kvd_daemon.name))
    result = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "'sessions'" in result.stdout


def test_embedded_example_runs_and_prints_what_it_says():
    code = _block("PagedKVCache(")
    result = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    expected = re.search(r"# (\{'total_blocks'.*?), \.\.\.\}", code).group(1)
    assert result.stdout.startswith(expected)


def test_ci_runs_the_readme_test_command():
    command = re.search(r"# 2\. install and run the tests.*\n(.+)\n", README).group(1)
    assert command in (ROOT / ".ci" / "run").read_text()
