"""kvoffload.sim: trace-driven evaluation of cache policies and sizes through the real manager."""
