"""The planner: bytes per token, capacity and charts, summed from the cache specs."""
