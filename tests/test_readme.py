"""The README's two commands are the ones that work (CI runs the test command verbatim), and the
Python snippets of the README and of the docs it points to run as pasted."""

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


# every ```python block of these files runs as pasted: the README's client snippet, and the
# snippets that moved with their sections into docs/
SNIPPETS = {"README.md": 1, "docs/design.md": 1, "docs/vllm.md": 1}


def _python_snippets(doc: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (ROOT / doc).read_text(), re.M | re.S)


@pytest.mark.ray
@pytest.mark.parametrize(
    ("doc", "index"), [(doc, i) for doc, n in SNIPPETS.items() for i in range(n)]
)
def test_doc_python_snippets_run_as_pasted(doc: str, index: int, tmp_path: Path) -> None:
    """Each ```python block of the README and of the docs it points to, run as it stands, in a
    plain shell's environment (PATH and HOME only; for a vLLM snippet also vLLM's cache of
    model classes, filled here: test-only, integrations/vllm_env.py says why): it must
    finish and its own asserts must hold."""
    snippets = _python_snippets(doc)
    assert len(snippets) == SNIPPETS[doc], f"update SNIPPETS when {doc} gains or loses a snippet"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    if "from vllm" in snippets[index]:
        pytest.importorskip("vllm", reason="the vLLM snippet needs the optional extra 'vllm'")
        from integrations.vllm_env import warm_vllm_cache

        from raykv.integrations.vllm.tiny import build_tiny_llama

        # the snippet's model is a tiny Llama too: vLLM inspects the same class
        env["VLLM_CACHE_ROOT"] = warm_vllm_cache(build_tiny_llama(tmp_path / "llama"))
    script = tmp_path / "snippet.py"
    script.write_text(snippets[index])
    # a snippet that runs "after `raykv up`" (its section says so) gets the service first
    up = "after `raykv up`" in _section_of(doc, snippets[index])
    raykv = [str(Path(sys.executable).parent / "raykv")]
    if up:
        started = subprocess.run([*raykv, "up"], env=env, capture_output=True,
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


def _section_of(doc: str, snippet: str) -> str:
    """The file's text from the snippet's section heading to the snippet."""
    text = (ROOT / doc).read_text()
    before = text[: text.index(snippet)]
    return before[before.rindex("\n## ") :]


def test_readme_stays_short_and_links_the_docs() -> None:
    """The README is the front page (<= 250 lines); the depth lives in docs/, and every local
    link of the README and the docs points at a file of the repository."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             ROOT / "helm" / "raykv" / "README.md"]  # fmt: skip
    for page in pages:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            path = (page.parent / target).resolve()
            assert path.is_relative_to(ROOT), f"{page.name} links outside the repository: {target}"
            assert path.exists(), f"{page.relative_to(ROOT)} links to a missing file: {target}"
