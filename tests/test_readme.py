"""The README's two commands are the ones that work: CI runs the test command verbatim."""

import re
from pathlib import Path

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
