"""Which DP kernels run: the compiled ones in ``fxremat._dp`` or the pure-Python references.

Every kernel has a pure-Python reference next to the code that calls it (in
:mod:`fxremat.lowersets` and :mod:`fxremat.solvers.kusumoto`) and a compiled twin of the same
name, signature and integer results in ``fxremat/_dp.pyx``. :func:`pick` chooses between them:

- ``FXREMAT_PURE_PYTHON=1`` in the environment (read once, here) forces the references;
- otherwise the compiled kernels, if ``fxremat._dp`` imports;
- if it does not, the references, after one warning that names the command that builds it
  (``pip install -e .``). Never silently.

:func:`use` switches the implementation for a block (tests run the suite against both).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import warnings

__all__ = ["IMPLEMENTATIONS", "current", "compiled_available", "pick", "use"]

IMPLEMENTATIONS = ("python", "cython")
_ENV = "FXREMAT_PURE_PYTHON"
BUILD_HINT = "pip install -e .  (from the fxremat checkout; needs Cython and a C compiler)"

_state = {"forced": None, "warned": False, "module": None, "error": None, "loaded": False}


def _load():
    """Import ``fxremat._dp`` once; remember the error if it is missing."""
    if not _state["loaded"]:
        _state["loaded"] = True
        try:
            _state["module"] = importlib.import_module("fxremat._dp")
        except ImportError as err:
            _state["error"] = err
    return _state["module"]


def compiled_available() -> bool:
    """Whether the compiled kernels (``fxremat._dp``) import."""
    return _load() is not None


def _default() -> str:
    if os.environ.get(_ENV, "") not in ("", "0"):
        return "python"
    if _load() is not None:
        return "cython"
    if not _state["warned"]:
        _state["warned"] = True
        warnings.warn(
            f"fxremat: the compiled DP kernels (fxremat._dp) are not built ({_state['error']}); "
            f"using the pure-Python reference, which is much slower. Build them with: {BUILD_HINT}. "
            f"Set {_ENV}=1 to choose the reference and silence this warning.",
            RuntimeWarning,
            stacklevel=3,
        )
    return "python"


def current() -> str:
    """``"python"`` or ``"cython"``: the implementation :func:`pick` returns now."""
    return _state["forced"] or _default()


def pick(reference, name: str):
    """The kernel to call: ``reference`` itself, or ``fxremat._dp.<name>`` when compiled."""
    if current() == "python":
        return reference
    return getattr(_load(), name)


@contextlib.contextmanager
def use(implementation: str):
    """Run a block with ``"python"`` or ``"cython"`` kernels (raises if cython is not built)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"fxremat._kernels.use: implementation must be one of {IMPLEMENTATIONS}, "
                         f"got {implementation!r}")
    if implementation == "cython" and _load() is None:
        raise ImportError(f"fxremat._kernels.use('cython'): fxremat._dp is not built "
                          f"({_state['error']}); build it with: {BUILD_HINT}")
    previous = _state["forced"]
    _state["forced"] = implementation
    try:
        yield
    finally:
        _state["forced"] = previous
