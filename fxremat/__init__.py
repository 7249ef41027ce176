"""fxremat: a graph-level recomputation compiler for PyTorch.

``fxremat.compile(model, budget)`` returns a module that trains with its activation peak under
``budget`` and with the least recomputation, for any torch.fx-traceable ``nn.Module``.
"""

from .api import RematModule, compile, load_plan, plan
from .errors import InfeasibleBudgetError, PlanBudgetError, TraceError
from .measure import measure_peak
from .identity import PlanMismatchError
from .records import Plan, Segment

__all__ = ["compile", "plan", "RematModule", "Plan", "Segment", "measure_peak", "InfeasibleBudgetError", "PlanBudgetError", "TraceError",
           "PlanMismatchError", "load_plan"]
__version__ = "0.1.0"
