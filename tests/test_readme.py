"""The README's notebook example runs as written, and its commands match the CI entry point."""
import re
import subprocess
import sys


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def test_notebook_example_runs(repo_root, tmp_path):
    readme = (repo_root / "README.md").read_text()
    example = next(b for b in _blocks(readme, "python") if "create_RWKV_Model" in b)
    script = tmp_path / "example.py"
    script.write_text(example)
    result = subprocess.run([sys.executable, str(script)], cwd=repo_root, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "tensor([[" in result.stdout  # the printed probabilities


def test_ci_runs_the_readme_test_command(repo_root):
    readme = (repo_root / "README.md").read_text()
    commands = [line for block in _blocks(readme, "bash") for line in block.splitlines()
                if line and not line.startswith("#")]
    test_command = next(c for c in commands if "pytest" in c)
    assert test_command in (repo_root / ".ci" / "run").read_text()
