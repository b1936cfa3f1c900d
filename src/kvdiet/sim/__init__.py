"""Trace-driven study of the cache system: trace readers and statistics (so far); the tier simulation,
the SWA-policy study and reports build on them."""
