"""Exceptions raised by fxremat. Each message names the API, the value received and the fix."""

__all__ = ["InfeasibleBudgetError", "PlanBudgetError", "TraceError", "format_bytes"]


def format_bytes(n: float) -> str:
    """Human-readable bytes with binary units, e.g. ``format_bytes(3 * 2**20) == '3.0 MiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _mib_gib(n: int) -> str:
    mib = f"{n / 2**20:.2f} MiB"
    return f"{mib} = {n / 2**30:.2f} GiB" if n >= 2**30 else mib


class InfeasibleBudgetError(ValueError):
    """The budget is below the smallest peak any recomputation plan reaches.

    ``min_feasible_bytes`` holds that smallest peak; ``budget="min"`` plans for it. ``hint``, where
    given, replaces the advice at the end (:attr:`ADVICE`): for an input signature planned at a
    training step, the budget passed to :func:`fxremat.compile` is what to change; where one leaf
    node holds most of that peak, the hint names it too (see ``fxremat.api._leaf_hint``).
    """

    ADVICE = "raise the budget or use budget='min'"

    def __init__(self, budget_bytes: int, min_feasible_bytes: int, hint: str | None = None):
        self.budget_bytes = int(budget_bytes)
        self.min_feasible_bytes = int(min_feasible_bytes)
        self.hint = hint
        super().__init__(
            f"fxremat: budget {budget_bytes} bytes ({_mib_gib(budget_bytes)}) is below the "
            f"smallest feasible peak {min_feasible_bytes} bytes ({_mib_gib(min_feasible_bytes)}) "
            f"for this model and input; {hint or self.ADVICE}"
        )


class PlanBudgetError(ValueError):
    """A saved plan (``plan=``) does not fit the budget given with it.

    ``budget_bytes`` is the budget resolved on the current model (``None`` for ``"min"``),
    ``plan_peak_bytes`` the plan's peak simulated again on the current graph.
    """

    def __init__(self, origin: str, budget_bytes: int | None, plan_peak_bytes: int, saved_budget_bytes: int):
        self.budget_bytes = None if budget_bytes is None else int(budget_bytes)
        self.plan_peak_bytes = int(plan_peak_bytes)
        if budget_bytes is None:
            problem = ("budget='min' asks for the least peak, which only planning finds, but this plan was made "
                       f"for a budget of {saved_budget_bytes} bytes ({_mib_gib(saved_budget_bytes)})")
        else:
            problem = (f"its peak on this model, {plan_peak_bytes} bytes ({_mib_gib(plan_peak_bytes)}), is above "
                       f"the budget {budget_bytes} bytes ({_mib_gib(budget_bytes)})")
        super().__init__(
            f"fxremat: {origin} does not fit the budget given with it: {problem}; pass a budget of at least "
            f"{plan_peak_bytes} bytes with this plan, or plan again at this budget without plan="
        )


class TraceError(RuntimeError):
    """torch.fx could not trace the model (for example data-dependent Python control flow).

    ``module_class`` names the class of the module that failed and ``where`` the line of its code
    (``file:line``) where it did, when known.
    """

    def __init__(self, qualified_name: str, cause: BaseException, hint: str | None = None, *,
                 module_class: str | None = None, where: str | None = None):
        self.qualified_name = qualified_name
        self.module_class = module_class
        self.where = where
        what = f"submodule {qualified_name!r}" if qualified_name else "the top-level module"
        if module_class:
            what += f" ({module_class})"
        at = f" at {where}" if where else ""
        if hint is None:
            hint = (
                f"pass leaf_modules=({qualified_name!r},) (or its class) so fxremat treats it as one node"
                if qualified_name
                else "make its forward traceable by torch.fx (no Python control flow on tensor values), or pass "
                     "example_inputs=, with which fxremat captures a forward torch.fx cannot "
                     "trace with torch.export"
            )
        super().__init__(f"fxremat: could not trace {what}{at}: {type(cause).__name__}: {cause}; {hint}")
