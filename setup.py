"""Builds the cython_ggml extension. It compiles without llama.cpp's headers or library: the
few declarations it needs are written out in cython_ggml/_ggml.pyx, and libggml-base is loaded
at import time (see cython_ggml/__init__.py)."""
from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [Extension("cython_ggml._ggml", ["cython_ggml/_ggml.pyx"], extra_compile_args=["-O2"])],
        compiler_directives={"language_level": "3"},
    ),
)
