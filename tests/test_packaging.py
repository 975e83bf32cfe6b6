"""kernels/*.cu ship in the wheel and are found from a non-editable install."""

import json
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from cuattn.backends.toolchain import kernel_dir, kernel_files

ROOT = Path(__file__).resolve().parent.parent
BUILD_LEFTOVERS = (".git", "build", "dist", ".venv", "*.egg-info", "__pycache__", ".*cache")


@pytest.fixture(scope="module")
def installed_python(tmp_path_factory):
    if subprocess.run([sys.executable, "-m", "build", "--version"], capture_output=True).returncode:
        pytest.skip("the 'build' package is not installed")
    tmp = tmp_path_factory.mktemp("wheel")
    # Build from a clean copy: setuptools reuses a checkout's build/ directory, which may hold
    # files that no longer exist.
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*BUILD_LEFTOVERS))
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp / "dist"), str(src)],
        check=True,
        capture_output=True,
    )
    wheel = next((tmp / "dist").glob("cuattn-*.whl"))
    env_dir = tmp / "venv"
    # System site packages provide numpy; cuattn itself comes only from the wheel.
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
    )
    return python, tmp


def test_installed_wheel_finds_its_kernels(installed_python):
    python, cwd = installed_python
    probe = (
        "import json, cuattn, cuattn.backends.toolchain as ks\n"
        "root = ks.kernel_dir()\n"
        "print(json.dumps({'module': cuattn.__file__, 'root': str(root),\n"
        "  'files': [str(p.relative_to(root)) for p in ks.kernel_files()]}))\n"
    )
    res = subprocess.run(
        [str(python), "-c", probe], cwd=cwd, capture_output=True, text=True, check=True
    )
    found = json.loads(res.stdout)
    assert "site-packages" in found["module"] and str(ROOT) not in found["root"]
    expected = sorted(str(p.relative_to(kernel_dir())) for p in kernel_files())
    assert sorted(found["files"]) == expected


def test_installed_cli_runs(installed_python):
    python, cwd = installed_python
    cli = python.parent / "cuattn"
    res = subprocess.run(
        [str(cli), "show", "all", "--n-ctx", "128", "--heads", "1"],
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert "head 0" in res.stdout


def test_the_library_never_imports_the_lab():
    """dev/ (the static model, the compile check, the tiny LM) is not in the wheel: a module of
    cuattn/ that imported it would fail in every installed copy."""
    importers = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "cuattn").rglob("*.py"))
        if re.search(r"^\s*(from dev\b|import dev\b)", path.read_text(), re.MULTILINE)
    ]
    assert not importers
