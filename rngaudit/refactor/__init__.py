"""Refactor safety (`capture`, `verify`, `diff`): a live Flax model observed, written as a spec, and compared."""
