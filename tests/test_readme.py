"""The README's two commands are the ones that work: CI runs the test command verbatim."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    head = text.split("\n## ", 1)[0]
    return re.findall(r"^    (\S.*)$", head, flags=re.M)


def test_readme_starts_with_main_job_and_test_command():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    main_job, test_cmd = commands
    assert "raykv " in main_job
    assert "pytest" in test_cmd


def test_ci_runs_the_readme_test_command_verbatim():
    test_cmd = _readme_commands()[1]
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci_lines


def _python_snippets() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)


@pytest.mark.ray
@pytest.mark.parametrize("index", range(3))
def test_readme_python_snippets_run_as_pasted(index: int, tmp_path: Path) -> None:
    """Each ```python block of the README, run as it stands, in a plain shell's environment
    (PATH and HOME only): it must finish and its own asserts must hold."""
    snippets = _python_snippets()
    assert len(snippets) == 3, "update the range above when the README gains a snippet"
    if "from vllm" in snippets[index]:
        pytest.importorskip("vllm", reason="the vLLM snippet needs the optional extra 'vllm'")
    script = tmp_path / "snippet.py"
    script.write_text(snippets[index])
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    # the vLLM snippet runs "after `raykv up`", as the README says
    up = "after `raykv up`" in _section_of(snippets[index])
    raykv = [str(Path(sys.executable).parent / "raykv")]
    if up:
        small = ["--pool-mem", "64MiB", "--cpu-mem", "32MiB", "--max-model-len", "256"]
        started = subprocess.run([*raykv, "up", *small], env=env, capture_output=True,
                                 text=True, timeout=300)  # fmt: skip
        assert started.returncode == 0, started.stdout + started.stderr
    try:
        done = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
        )
    finally:
        if up:
            subprocess.run([*raykv, "down"], env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, snippets[index] + done.stderr[-3000:]


def _section_of(snippet: str) -> str:
    """The README's text from the snippet's section heading to the snippet."""
    text = (ROOT / "README.md").read_text()
    before = text[: text.index(snippet)]
    return before[before.rindex("\n## ") :]
