"""Build the Cython DP kernels (fxremat/_dp.pyx) with the package."""
from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [Extension("fxremat._dp", ["fxremat/_dp.pyx"])],
        compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False},
    )
)
