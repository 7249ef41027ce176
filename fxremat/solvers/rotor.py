"""Optimal persistent checkpointing of a heterogeneous chain ("rotor").

Beaumont, Eyraud-Dubois, Herrmann, Joly, Shilova, *Optimal checkpointing for heterogeneous
chains* (Inria RR-9302, 2019), ``shared/seeds/000_a36739dd7d64ce67.txt``.

Contract: :func:`solve_rotor` takes a :class:`ChainCosts` and a memory budget in bytes and
returns the fastest *memory-persistent* operation sequence whose peak, in the paper's memory
model, is at most the budget (a :class:`RotorSchedule`), or ``None`` when none exists.

Indexing (paper indexing; defined once here)
--------------------------------------------
- The chain has L stages numbered ℓ = 1..L. Stage ℓ reads a^{ℓ-1} and writes a^ℓ; a^0 is the
  chain input. Operations name stages by this paper number: ``("Fall", ℓ)``.
- Per-stage tuples (``uf, ub, wabar, of, ob``) have length L; entry ``[ℓ - 1]`` is stage ℓ.
- ``wa`` has length L + 1; entry ``[ℓ]`` is ω_a^ℓ, so ``wa[0]`` is the input a^0 and
  ``wa[ℓ]`` the output of stage ℓ.
- δ^ℓ = ∂loss/∂a^ℓ. As the paper does "in practice", ω_δ^ℓ = ω_a^ℓ, so ``wa`` also sizes the
  gradients. δ^L, the gradient entering the chain, is treated as present from the start (the
  paper's δ^{L+1} = 1 of its loss stage F^{L+1}/B^{L+1}). To model the loss exactly as the
  paper does, make it the last stage (a scalar output, so ``wa[L]`` is tiny); otherwise
  counting δ^L during the forward is conservative.

Paper symbols → fields
----------------------
- u_f^ℓ = ``uf[ℓ-1]``, u_b^ℓ = ``ub[ℓ-1]``: forward / backward time of stage ℓ.
- ω_a^ℓ = ``wa[ℓ]``: bytes of a^ℓ (and of δ^ℓ).
- ω_ā^ℓ = ``wabar[ℓ-1]``: bytes of ā^ℓ, everything autograd keeps when stage ℓ runs with
  F_all (all its backward needs, *including* its output a^ℓ, excluding its input a^{ℓ-1});
  hence ``wabar[ℓ-1] >= wa[ℓ]`` is required.
- o_f^ℓ = ``of[ℓ-1]``, o_b^ℓ = ``ob[ℓ-1]``: transient bytes during F^ℓ / B^ℓ.
- S = ``slots``; M = ``memory_bytes``; C_BP(s, t, m) = ``RotorTable.cost(s, t, m)``.

Memory model (Section 3.1, Table 1)
-----------------------------------
Memory is a set of values a^j, ā^j, δ^j; it starts as {a^0, δ^L}. An operation's peak is the
bytes in memory before it, plus its new outputs, plus its overhead. Ops (``kind`` strings):

- ``"Fall"`` F_all^ℓ: needs a^{ℓ-1} (alone or inside ā^{ℓ-1}); adds ā^ℓ. Time u_f^ℓ.
- ``"Fck"``  F_ck^ℓ:  needs a^{ℓ-1}; keeps it, adds a^ℓ. Time u_f^ℓ.
- ``"Fn"``   F_∅^ℓ:   needs a^{ℓ-1} stored alone; replaces it by a^ℓ. Time u_f^ℓ.
- ``"B"``    B^ℓ:     needs δ^ℓ, ā^ℓ and a^{ℓ-1}; replaces δ^ℓ and ā^ℓ by δ^{ℓ-1} and drops a
  lone a^{ℓ-1} (a^{ℓ-1} inside ā^{ℓ-1} stays, Table 1's second line). Time u_b^ℓ.

Recomputing a value already in memory is rejected (it only wastes time and memory). A
sequence is *persistent* (Section 4.1) if no kept checkpoint is dropped before its backward:
here, once F_ck^{j+1} or F_all^{j+1} has read a lone a^j without consuming it, F_∅^{j+1} may
not consume that a^j.

Interpretations of the paper
----------------------------
- m_all^{s,t}: the paper's backward term ω_δ^s + ω_ā^s + o_b^s omits the output δ^{s-1}, yet
  Section 3.1 counts outputs in an op's memory; we count it (+ω_δ^{s-1}), so the DP agrees
  with :func:`simulate_schedule`.
- m_∅^{s,t}: instead of bounding all F_∅ steps up to t, each split s' checks exactly the
  F_ck^s, F_∅^{s+1..s'-1} it runs; the later steps are checked by the sub-problem. Same optimum.
- Algorithm 1 loops s ascending, which would read C[s', t] (s' > s) before computing it;
  :func:`rotor_table` fills the table by increasing chain length t - s instead.
- Memory sizes become slots of M / S bytes, rounded up, so a schedule within S slots is within
  M bytes (Section 5.2).

Nested form (for emitting ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``)
------------------------------------------------------------------------------------------
Algorithm 2 builds every sequence from Seq(s, t), one of
``F_all^s, Seq(s+1, t), B^s`` (or ``F_all^s, B^s`` when s = t) and
``F_ck^s, F_∅^{s+1..s'-1}, Seq(s', t), Seq(s, s'-1)``.
:meth:`RotorSchedule.nested` turns it into a tuple of nodes run in order over stages s..t:

- :class:`PlainStage` ℓ: run stage ℓ normally (autograd saves ā^ℓ): F_all^ℓ, later B^ℓ.
- :class:`CheckpointSegment` (first, last, body): ``checkpoint(run(body), a^{first-1})``: the
  forward saves only its input (F_ck^first, F_∅^{first+1..last}); when backward reaches it,
  torch re-runs ``body`` — itself a node tuple over first..last — which is Seq(first, last).

A node tuple's sequence is its forward sweep (in order) followed by its backward sweep (in
reverse: B^ℓ for a plain stage, the body's full sequence for a segment), which is exactly how
nested non-reentrant checkpoints run (tests/test_rotor.py checks the order against torch; its
early stop can only skip trailing forward work that saves nothing, i.e. make torch faster).
Every sequence Algorithm 2 produces has this form. Persistent sequences that do not (e.g. a
segment recomputed before the backward reaches it, or wasted forwards; the brute force finds
such ties) make :meth:`RotorSchedule.nested` raise ``ValueError``: :func:`solve_rotor` never
returns them.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import Sequence, Union

from .. import _kernels

__all__ = [
    "FALL", "FCK", "FN", "BWD", "ChainCosts", "CheckpointSegment", "PlainStage", "RotorSchedule", "RotorSolver",
    "RotorTable", "flatten_nested", "rotor_row", "rotor_table", "simulate_schedule", "solve_rotor",
    "step", "initial_memory", "to_slots", "Memory", "memory_bytes_of",
]

FALL, FCK, FN, BWD = "Fall", "Fck", "Fn", "B"
Op = tuple[str, int]
INF = math.inf

# Choice-table codes: a stage number s' > s means the F_ck branch with split s'.
CHOICE_INFEASIBLE = -1
CHOICE_FALL = 0


# --------------------------------------------------------------------------- costs


def _check_numbers(name: str, values: tuple, want_int: bool) -> None:
    for i, v in enumerate(values):
        ok_type = isinstance(v, int) if want_int else isinstance(v, (int, float))
        if isinstance(v, bool) or not ok_type or not math.isfinite(v) or v < 0:
            kind = "non-negative int (bytes)" if want_int else "finite non-negative number"
            raise ValueError(f"ChainCosts.{name}[{i}] = {v!r}; pass a {kind}")


@dataclass(frozen=True)
class ChainCosts:
    """Per-stage costs of an L-stage chain; see the module docstring for the indexing."""

    uf: tuple[float, ...]
    ub: tuple[float, ...]
    wa: tuple[int, ...]
    wabar: tuple[int, ...]
    of: tuple[int, ...]
    ob: tuple[int, ...]

    def __post_init__(self):
        for name in ("uf", "ub", "wa", "wabar", "of", "ob"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        n = len(self.uf)
        if n == 0:
            raise ValueError("ChainCosts.uf is empty; a chain needs at least one stage")
        for name in ("ub", "wabar", "of", "ob"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"ChainCosts.{name} has {len(getattr(self, name))} entries but uf "
                                 f"has {n}; give one entry per stage")
        if len(self.wa) != n + 1:
            raise ValueError(f"ChainCosts.wa has {len(self.wa)} entries; give L + 1 = {n + 1} "
                             "(wa[0] is the chain input a^0, wa[l] the output of stage l)")
        for name in ("uf", "ub"):
            _check_numbers(name, getattr(self, name), want_int=False)
        for name in ("wa", "wabar", "of", "ob"):
            _check_numbers(name, getattr(self, name), want_int=True)
        for ell in range(1, n + 1):
            if self.wabar[ell - 1] < self.wa[ell]:
                raise ValueError(f"ChainCosts.wabar[{ell - 1}] = {self.wabar[ell - 1]} < wa[{ell}] = "
                                 f"{self.wa[ell]}; ā^{ell} includes the output a^{ell}, so count it")

    @property
    def length(self) -> int:
        """L, the number of stages."""
        return len(self.uf)


def _slots_of(size_bytes: int, memory_bytes: int, slots: int) -> int:
    return -(-size_bytes * slots // memory_bytes)  # ceil(size / (M / S)) in exact integers


def to_slots(costs: ChainCosts, memory_bytes: int, slots: int) -> ChainCosts:
    """``costs`` with every size rounded up to slots of ``memory_bytes / slots`` bytes."""
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes <= 0:
        raise ValueError(f"memory_bytes = {memory_bytes!r}; pass a positive int budget in bytes")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots <= 0:
        raise ValueError(f"slots = {slots!r}; pass a positive int (the paper uses 500)")

    def conv(sizes):
        return tuple(_slots_of(b, memory_bytes, slots) for b in sizes)

    return ChainCosts(costs.uf, costs.ub, conv(costs.wa), conv(costs.wabar), conv(costs.of), conv(costs.ob))


# --------------------------------------------------------------------------- DP table


def _leaf_row(s, uf, ub, wa, wabar, of, ob, slots):
    """C_BP(s, s, m) for m = 0..S (Eq. 1)."""
    i = s - 1
    peak = max(wa[s] + wabar[i] + of[i], wa[s] + wabar[i] + wa[s - 1] + ob[i])
    cost = [INF] * (slots + 1)
    choice = [CHOICE_INFEASIBLE] * (slots + 1)
    for m in range(peak, slots + 1):
        cost[m] = uf[i] + ub[i]
        choice[m] = CHOICE_FALL
    return cost, choice


def _fall_branch(s, t, cost_table, uf, ub, wa, wabar, of, ob, cost, choice):
    """C_all(s, t, m) where m >= m_all^{s,t} (Eq. 2, second case)."""
    i = s - 1
    peak = max(wa[t] + wabar[i] + of[i], wa[s] + wabar[i] + wa[s - 1] + ob[i])
    rest = cost_table[s + 1][t]
    for m in range(peak, len(cost)):
        c = uf[i] + rest[m - wabar[i]] + ub[i]
        if c < cost[m]:
            cost[m] = c
            choice[m] = CHOICE_FALL


def _fck_branches(s, t, cost_table, uf, wa, of, cost, choice):
    """min over s' of C_ck(s, s', t, m), each s' checked against its own forward peak."""
    slots = len(cost) - 1
    fwd_peak = wa[t] + wa[s] + of[s - 1]  # F_ck^s with δ^t present; a^{s-1} is outside m
    fwd_time = 0
    for sp in range(s + 1, t + 1):
        if sp > s + 1:  # F_∅^{sp-1}: a^{sp-2} in, a^{sp-1} out
            fwd_peak = max(fwd_peak, wa[t] + wa[sp - 2] + wa[sp - 1] + of[sp - 2])
        fwd_time += uf[sp - 2]
        if fwd_peak > slots:
            break  # later splits run these same forward steps
        right, left, held = cost_table[sp][t], cost_table[s][sp - 1], wa[sp - 1]
        for m in range(max(fwd_peak, held), slots + 1):
            c = fwd_time + right[m - held] + left[m]
            if c < cost[m]:
                cost[m] = c
                choice[m] = sp


def rotor_row(n: int, s: int, t: int) -> int:
    """Row of C_BP(s, t, .) in :func:`rotor_table`'s flat tables: rows run s = 1..L, then t = s..L."""
    return (s - 1) * (n + 1) - (s - 1) * s // 2 + (t - s)


def rotor_table(uf, ub, wa_slots, wabar_slots, of_slots, ob_slots, slots):
    """C_BP and its argmin for every sub-chain (Theorem 1, Algorithm 1), in slot units.

    Inputs are plain lists indexed like :class:`ChainCosts` (sizes in slots). Returns two flat
    arrays ``(cost, choice)``, ``array("d")`` and ``array("i")``, of L (L + 1) / 2 rows of
    ``slots + 1`` entries: with ``k = rotor_row(L, s, t) * (slots + 1) + m``, ``cost[k]`` =
    C_BP(s, t, m) for 1 <= s <= t <= L and 0 <= m <= slots (``math.inf`` when infeasible),
    where m excludes a^{s-1} and includes δ^t, and ``choice[k]`` is ``-1`` (infeasible), ``0``
    (start with F_all^s) or s' in s+1..t (F_ck^s, F_∅^{s+1..s'-1}, then split at s').
    :class:`RotorTable` reads them. The Cython kernel in fxremat/_dp.pyx implements this same
    signature and returns equal arrays.
    """
    n = len(uf)
    cost_table = [[None] * (n + 1) for _ in range(n + 1)]
    choice_table = [[None] * (n + 1) for _ in range(n + 1)]
    for s in range(1, n + 1):
        cost_table[s][s], choice_table[s][s] = _leaf_row(s, uf, ub, wa_slots, wabar_slots,
                                                         of_slots, ob_slots, slots)
    for span in range(1, n):
        for s in range(1, n - span + 1):
            t = s + span
            cost = [INF] * (slots + 1)
            choice = [CHOICE_INFEASIBLE] * (slots + 1)
            _fall_branch(s, t, cost_table, uf, ub, wa_slots, wabar_slots, of_slots, ob_slots, cost, choice)
            _fck_branches(s, t, cost_table, uf, wa_slots, of_slots, cost, choice)
            cost_table[s][t], choice_table[s][t] = cost, choice
    flat_cost, flat_choice = array("d"), array("i")
    for s in range(1, n + 1):
        for t in range(s, n + 1):
            flat_cost.extend(cost_table[s][t])
            flat_choice.extend(choice_table[s][t])
    return flat_cost, flat_choice


@dataclass(frozen=True)
class RotorTable:
    """:func:`rotor_table`'s flat arrays for a ``num_stages``-stage chain and ``slots`` slots."""

    num_stages: int
    slots: int
    costs: array
    choices: array

    def index(self, s: int, t: int, m: int) -> int:
        """Position of (s, t, m) in the flat arrays; 1 <= s <= t <= L, 0 <= m <= slots."""
        if not (1 <= s <= t <= self.num_stages and 0 <= m <= self.slots):
            raise IndexError(f"RotorTable: (s, t, m) = {(s, t, m)} outside 1 <= s <= t <= "
                             f"{self.num_stages}, 0 <= m <= {self.slots}")
        return rotor_row(self.num_stages, s, t) * (self.slots + 1) + m

    def cost(self, s: int, t: int, m: int) -> float:
        """C_BP(s, t, m) in time units (``math.inf`` when infeasible)."""
        return self.costs[self.index(s, t, m)]

    def choice(self, s: int, t: int, m: int) -> int:
        """-1 infeasible, 0 F_all^s first, s' > s: F_ck^s, F_∅^{s+1..s'-1}, split at s'."""
        return self.choices[self.index(s, t, m)]


# --------------------------------------------------------------------------- reconstruction


def _reconstruct(table: RotorTable, wa, wabar, s, t, m) -> tuple[Op, ...]:
    """Algorithm 2 (OptRec) with an explicit stack, so long chains do not hit recursion limits."""
    ops: list[Op] = []
    stack: list = [(s, t, m)]
    while stack:
        item = stack.pop()
        if isinstance(item[0], str):
            ops.append(item)
            continue
        s, t, m = item
        pick = table.choice(s, t, m)
        if pick == CHOICE_FALL:
            ops.append((FALL, s))
            stack.append((BWD, s))
            if s < t:
                stack.append((s + 1, t, m - wabar[s - 1]))
        elif pick > s:
            ops.append((FCK, s))
            ops.extend((FN, k) for k in range(s + 1, pick))
            stack.append((s, pick - 1, m))
            stack.append((pick, t, m - wa[pick - 1]))
        else:
            raise AssertionError(f"choice({s}, {t}, {m}) = {pick} on a feasible path")
    return tuple(ops)


def _op_time(costs: ChainCosts, op: Op) -> float:
    kind, ell = op
    return costs.ub[ell - 1] if kind == BWD else costs.uf[ell - 1]


def solve_rotor(costs: ChainCosts, memory_bytes: int, *, slots: int = 500) -> RotorSchedule | None:
    """Fastest persistent sequence with peak <= ``memory_bytes``, or ``None`` if infeasible."""
    return RotorSolver(costs, memory_bytes, slots=slots).at_slots(slots)


class RotorSolver:
    """One DP table for budgets up to ``memory_bytes``: :meth:`at_slots` gives the optimal
    schedule within m of its ``slots`` slots (``memory_bytes / slots`` bytes each) for every m,
    without solving again (C_BP(1, L, m) is a row of the same table)."""

    def __init__(self, costs: ChainCosts, memory_bytes: int, *, slots: int = 500):
        self.costs, self.memory_bytes, self.slots = costs, memory_bytes, slots
        self.sized = to_slots(costs, memory_bytes, slots)
        sl = self.sized
        kernel = _kernels.pick(rotor_table, "rotor_table")  # the Cython kernel when it is built
        self.table = RotorTable(costs.length, slots, *kernel(list(sl.uf), list(sl.ub), list(sl.wa),
                                                             list(sl.wabar), list(sl.of), list(sl.ob), slots))

    def feasible(self, m: int) -> bool:
        avail = m - self.sized.wa[0]  # Algorithm 1 solves C_BP(1, L, M - ω_a^0)
        return 0 <= avail and self.table.cost(1, self.costs.length, min(avail, self.slots)) != INF

    def at_slots(self, m: int) -> RotorSchedule | None:
        """The fastest schedule within ``m`` slots (0 <= m <= slots), or ``None``."""
        if not 0 <= m <= self.slots:
            raise ValueError(f"RotorSolver.at_slots: m = {m} outside 0..{self.slots}")
        if not self.feasible(m):
            return None
        n = self.costs.length
        ops = _reconstruct(self.table, self.sized.wa, self.sized.wabar, 1, n, m - self.sized.wa[0])
        return RotorSchedule(ops=ops, predicted_time=sum(_op_time(self.costs, op) for op in ops), num_stages=n)

    def least_slots(self) -> int | None:
        """The fewest slots with a feasible schedule (C_BP never grows with memory)."""
        if not self.feasible(self.slots):
            return None
        lo, hi = -1, self.slots
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self.feasible(mid) else (mid, hi)
        return hi


# --------------------------------------------------------------------------- nested form


@dataclass(frozen=True)
class PlainStage:
    """Stage ``index`` (paper number) run normally: F_all in the forward, B in the backward."""

    index: int


@dataclass(frozen=True)
class CheckpointSegment:
    """Stages first..last under one non-reentrant checkpoint; ``body`` is its recompute plan."""

    first: int
    last: int
    body: tuple[Union[PlainStage, "CheckpointSegment"], ...]


Node = Union[PlainStage, CheckpointSegment]


class _OpReader:
    def __init__(self, ops):
        self.ops, self.pos = tuple(ops), 0

    def peek(self):
        return self.ops[self.pos] if self.pos < len(self.ops) else None

    def take(self, expected: Op) -> None:
        got = self.peek()
        if got != expected:
            raise ValueError(f"op #{self.pos} is {got!r} but the nested form needs {expected!r} here; "
                             "only Algorithm-2 shaped sequences (see fxremat.solvers.rotor) nest")
        self.pos += 1


def _read_forward_sweep(reader: _OpReader, first: int, last: int) -> list:
    """Forward sweep over first..last: F_all^ℓ → plain stage; F_ck^ℓ, F_∅... → (first, last)."""
    sweep, ell = [], first
    while ell <= last:
        kind = reader.peek()[0] if reader.peek() else None
        if kind == FALL:
            reader.take((FALL, ell))
            sweep.append(PlainStage(ell))
            ell += 1
            continue
        reader.take((FCK, ell))
        end = ell
        while end < last and reader.peek() == (FN, end + 1):
            reader.take((FN, end + 1))
            end += 1
        sweep.append((ell, end))
        ell = end + 1
    return sweep


def _read_nodes(reader: _OpReader, first: int, last: int) -> tuple[Node, ...]:
    sweep = _read_forward_sweep(reader, first, last)
    bodies = {}
    for item in reversed(sweep):
        if isinstance(item, PlainStage):
            reader.take((BWD, item.index))
        else:
            bodies[item] = _read_nodes(reader, item[0], item[1])
    return tuple(it if isinstance(it, PlainStage) else CheckpointSegment(it[0], it[1], bodies[it])
                 for it in sweep)


def flatten_nested(nodes: Sequence[Node]) -> tuple[Op, ...]:
    """The op sequence a node tuple runs: forward sweep, then backward sweep in reverse."""
    ops: list[Op] = []
    for node in nodes:
        if isinstance(node, PlainStage):
            ops.append((FALL, node.index))
        else:
            ops.append((FCK, node.first))
            ops.extend((FN, k) for k in range(node.first + 1, node.last + 1))
    for node in reversed(nodes):
        ops.extend([(BWD, node.index)] if isinstance(node, PlainStage) else flatten_nested(node.body))
    return tuple(ops)


@dataclass(frozen=True)
class RotorSchedule:
    """A persistent sequence over stages 1..``num_stages``; ops are (kind, paper stage number)."""

    ops: tuple[Op, ...]
    predicted_time: float
    num_stages: int

    def nested(self) -> tuple[Node, ...]:
        """Nested-checkpoint tree over stages 1..L; ``flatten_nested`` of it gives back ``ops``."""
        reader = _OpReader(self.ops)
        nodes = _read_nodes(reader, 1, self.num_stages)
        if reader.pos != len(self.ops):
            raise ValueError(f"ops continue after the full schedule at op #{reader.pos}: "
                             f"{self.ops[reader.pos]!r}; drop the trailing ops")
        return nodes


# --------------------------------------------------------------------------- simulation


@dataclass(frozen=True)
class Memory:
    """Abstract memory: ``values`` holds ("a" | "abar" | "delta", j); ``kept`` the j of kept a^j."""

    values: frozenset
    kept: frozenset


def initial_memory(costs: ChainCosts) -> Memory:
    """{a^0, δ^L}; a^0 counts as kept (it is the chain input, it cannot be recomputed)."""
    return Memory(frozenset({("a", 0), ("delta", costs.length)}), frozenset({0}))


def _size(costs: ChainCosts, value) -> int:
    kind, j = value
    return costs.wabar[j - 1] if kind == "abar" else costs.wa[j]


def memory_bytes_of(costs: ChainCosts, mem: Memory) -> int:
    """Bytes held by ``mem`` (sizes in the units of ``costs``)."""
    return sum(_size(costs, v) for v in mem.values)


def _has_input(mem: Memory, j: int) -> bool:
    return ("a", j) in mem.values or ("abar", j) in mem.values


def _forward(costs: ChainCosts, mem: Memory, op: Op, persistent: bool):
    kind, ell = op
    if not _has_input(mem, ell - 1):
        raise ValueError(f"invalid op {op!r}: its input a^{ell - 1} is not in memory")
    out = ("abar", ell) if kind == FALL else ("a", ell)
    if out in mem.values:
        raise ValueError(f"invalid op {op!r}: {out[0]}^{ell} is already in memory")
    values, kept = set(mem.values) | {out}, set(mem.kept)
    if kind == FN:
        if ("a", ell - 1) not in mem.values:
            raise ValueError(f"invalid op {op!r}: a^{ell - 1} is only inside ā^{ell - 1}; use Fck")
        if persistent and ell - 1 in kept:
            raise ValueError(f"invalid op {op!r}: it drops the checkpoint a^{ell - 1} before B^{ell} "
                             "(not memory persistent)")
        values.discard(("a", ell - 1))
        kept.discard(ell - 1)
    elif ("a", ell - 1) in mem.values:
        kept.add(ell - 1)
    return Memory(frozenset(values), frozenset(kept)), _size(costs, out) + costs.of[ell - 1]


def _backward(costs: ChainCosts, mem: Memory, op: Op):
    _, ell = op
    for need in (("delta", ell), ("abar", ell)):
        if need not in mem.values:
            raise ValueError(f"invalid op {op!r}: its input {need[0]}^{need[1]} is not in memory")
    if not _has_input(mem, ell - 1):
        raise ValueError(f"invalid op {op!r}: its input a^{ell - 1} is not in memory")
    values = set(mem.values) - {("delta", ell), ("abar", ell), ("a", ell - 1)}
    values.add(("delta", ell - 1))
    new = Memory(frozenset(values), mem.kept - {ell - 1})
    return new, costs.wa[ell - 1] + costs.ob[ell - 1]


def step(costs: ChainCosts, mem: Memory, op: Op, *, persistent: bool = False) -> tuple[Memory, int]:
    """Apply one op: ``(memory after, peak during)``; ``ValueError`` names an invalid op."""
    kind, ell = op
    if kind not in (FALL, FCK, FN, BWD) or not isinstance(ell, int) or not 1 <= ell <= costs.length:
        raise ValueError(f"invalid op {op!r}: want (kind, stage) with kind in Fall/Fck/Fn/B and "
                         f"1 <= stage <= {costs.length}")
    before = memory_bytes_of(costs, mem)
    if kind == BWD:
        new, extra = _backward(costs, mem, op)
    else:
        new, extra = _forward(costs, mem, op, persistent)
    return new, before + extra


def simulate_schedule(costs: ChainCosts, ops: Sequence[Op], *, persistent: bool = False) -> tuple[float, int]:
    """Run ``ops`` in the paper's memory model: ``(total time, peak bytes)``.

    Raises ``ValueError`` naming the first invalid op, or if the sequence ends before B^1.
    With ``persistent=True`` a non-persistent op is invalid too.
    """
    mem = initial_memory(costs)
    peak, total = memory_bytes_of(costs, mem), 0
    for op in ops:
        mem, op_peak = step(costs, mem, tuple(op), persistent=persistent)
        peak, total = max(peak, op_peak), total + _op_time(costs, op)
    if ("delta", 0) not in mem.values:
        raise ValueError(f"schedule of {len(ops)} ops ends before B^1 produced δ^0; "
                         "append the missing backward steps")
    return total, peak
