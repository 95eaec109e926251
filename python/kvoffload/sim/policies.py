"""Out-of-tree policies for the simulator: libCacheSim's ARC with vLLM's as its base.

They moved to `kvoffload.reference.arc_paper` (``LibCacheSimArc`` is the built-in
``"arc-paper"`` of both managers); the names stay importable from here.
"""

from __future__ import annotations

from kvoffload.reference.arc_paper import LibCacheSimArc, VllmArcWithSwitches

__all__ = ["LibCacheSimArc", "VllmArcWithSwitches"]
