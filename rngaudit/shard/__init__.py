"""`shard-check`: the request (no JAX), the device process that runs the checks, and their report."""
