"""cython_ggml warns when its compiled extension does not match the ``_ggml.pyx`` beside its
Python code: built from another checkout whose source differs (a ``ray job submit
--working-dir`` copy carries no compiled files, so the job imported the node's install's
extension with the copy's Python), or older than the source (updated without rebuilding)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import cython_ggml

PKG = Path(cython_ggml.__file__).parent


def _import(cwd, env=None):
    return subprocess.run([sys.executable, "-W", "always", "-c",
                           "import cython_ggml, sys; print(cython_ggml._ggml.__file__)"],
                          cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_an_extension_older_than_its_source_is_named(tmp_path):
    pkg = tmp_path / "cython_ggml"
    pkg.mkdir()
    for f in PKG.iterdir():
        if f.is_file() and (f.suffix in (".py", ".pyx", ".so")):
            shutil.copy2(f, pkg / f.name)
    p = _import(tmp_path)
    assert p.returncode == 0 and str(pkg) in p.stdout, p.stderr[-2000:]
    assert "older than" not in p.stderr and "another checkout" not in p.stderr, p.stderr
    so = next(pkg.glob("_ggml*.so"))
    os.utime(so, (1_000_000_000, 1_000_000_000))   # built long before the source
    p = _import(tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "is older than" in p.stderr and "pip install -e ." in p.stderr, p.stderr


def test_an_extension_of_another_checkout_with_other_source_is_named(tmp_path):
    """A copy of the package without its compiled file (what a Ray job's working_dir holds),
    whose ``_ggml.pyx`` differs from the one the imported extension was built from."""
    pkg = tmp_path / "cython_ggml"
    pkg.mkdir()
    shutil.copy2(PKG / "__init__.py", pkg / "__init__.py")
    shutil.copy2(PKG / "_ggml.pyx", pkg / "_ggml.pyx")
    p = _import(tmp_path)
    if p.returncode != 0 or str(PKG) not in p.stdout:
        pytest.skip("the extension is not found outside its folder (not an editable install)")
    assert "another checkout" not in p.stderr, p.stderr   # the same source: nothing to say
    with open(pkg / "_ggml.pyx", "a") as f:
        f.write("\n# changed\n")
    p = _import(tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "was built from another checkout" in p.stderr and str(PKG) in p.stderr, p.stderr
