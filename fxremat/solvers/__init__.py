"""Solvers: each takes plain numbers (a CostGraph or chain costs) and returns a schedule."""
