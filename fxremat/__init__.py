"""fxremat: a graph-level recomputation compiler for PyTorch.

``fxremat.compile(model, budget)`` returns a module that trains with its activation peak under
``budget`` and with the least recomputation, for any torch.fx-traceable ``nn.Module``.
"""

from .api import RematModule, compile, plan
from .errors import InfeasibleBudgetError, PlanBudgetError, TraceError
from .measure import measure_peak
from .plan import Plan, Segment
from .views import load_plan

__all__ = ["compile", "plan", "RematModule", "Plan", "Segment", "measure_peak", "InfeasibleBudgetError", "PlanBudgetError", "TraceError",
           "load_plan"]
__version__ = "0.1.0"
