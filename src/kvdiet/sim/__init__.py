"""Trace-driven study of the cache system: trace readers (so far); trace replay and reports to come."""
