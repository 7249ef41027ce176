"""Shared fixtures.

``dp_impl`` runs a test once with the pure-Python DP kernels and once with the compiled ones
(``fxremat._dp``), skipping the compiled run when the extension is not built. To run the whole
suite on the reference instead, set ``FXREMAT_PURE_PYTHON=1``.
"""

import pytest

from fxremat import _kernels


@pytest.fixture(params=_kernels.IMPLEMENTATIONS)
def dp_impl(request):
    """The kernel implementation in force for the test: ``"python"`` or ``"cython"``."""
    if request.param == "cython" and not _kernels.compiled_available():
        pytest.skip(f"fxremat._dp is not built; build it with: {_kernels.BUILD_HINT}")
    with _kernels.use(request.param):
        yield request.param
