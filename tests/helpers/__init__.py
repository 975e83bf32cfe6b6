"""Helpers shared by the tests: the dense float64 oracles and the case tables."""
