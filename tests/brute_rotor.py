"""Brute-force oracle for :mod:`fxremat.solvers.rotor` (tests only; chains of L <= 5 stages).

Contract: :func:`brute_force_min_time` explores *every* valid persistent op sequence of a
chain under the memory model of :mod:`fxremat.solvers.rotor` (shared through
:func:`~fxremat.solvers.rotor.step`, so the oracle tests the DP's recurrence, not the model),
keeping only sequences whose peak never exceeds ``memory_slots``, and returns the least total
time, or ``None`` when no sequence finishes. (Like the model, it never recomputes a value that
is still in memory; such a step only adds time and memory.) Sizes in ``costs`` are read in the same unit as
``memory_slots`` (pass a :func:`~fxremat.solvers.rotor.to_slots` chain, or integer sizes with
one slot per byte).

It is a Dijkstra search over memory states (op times are non-negative), so it is exhaustive
over sequences without enumerating them one by one; the state space is exponential in L.
"""

from __future__ import annotations

import heapq
import itertools

from fxremat.solvers.rotor import BWD, FALL, FCK, FN, ChainCosts, Memory, initial_memory, memory_bytes_of, step

__all__ = ["brute_force_min_time", "brute_force_schedule"]

MAX_STAGES = 5


def _moves(costs: ChainCosts, mem: Memory, memory_slots: int):
    """Every (op, memory after) valid, persistent and within ``memory_slots`` from ``mem``."""
    for ell in range(1, costs.length + 1):
        for kind in (FALL, FCK, FN, BWD):
            try:
                new, peak = step(costs, mem, (kind, ell), persistent=True)
            except ValueError:
                continue  # invalid or non-persistent here: not a move
            if peak <= memory_slots:
                yield (kind, ell), new


def brute_force_schedule(costs: ChainCosts, memory_slots: int):
    """``(min time, one optimal op tuple)`` over all persistent sequences, or ``None``."""
    if costs.length > MAX_STAGES:
        raise ValueError(f"chain has {costs.length} stages; the brute force is for L <= {MAX_STAGES}")
    start = initial_memory(costs)
    if memory_bytes_of(costs, start) > memory_slots:
        return None
    tie = itertools.count()
    frontier = [(0, next(tie), start, ())]
    done = set()
    while frontier:
        time, _, mem, ops = heapq.heappop(frontier)
        if mem in done:
            continue
        done.add(mem)
        if ("delta", 0) in mem.values:
            return time, ops
        for op, new in _moves(costs, mem, memory_slots):
            if new not in done:
                dt = costs.ub[op[1] - 1] if op[0] == BWD else costs.uf[op[1] - 1]
                heapq.heappush(frontier, (time + dt, next(tie), new, ops + (op,)))
    return None


def brute_force_min_time(costs: ChainCosts, memory_slots: int):
    """Least time of any valid persistent sequence with peak <= ``memory_slots``, or ``None``."""
    found = brute_force_schedule(costs, memory_slots)
    return None if found is None else found[0]
