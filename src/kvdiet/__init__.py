"""kvdiet: the KV-cache system of DeepSeek-V4.1-Flash, with DeepSeek-V4-Flash as the baseline.

``from kvdiet import LLM, SamplingParams`` gives the offline API (imported on first use, so the planner
and the config tools do not load torch). ``KVDIET_SIMCORE=1`` loads the compiled simulator core
(`kvdiet.sim.simcore`) before anything imports the modules it replaces.
"""

from __future__ import annotations

import os
from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if os.environ.get("KVDIET_SIMCORE") == "1":
    from kvdiet.sim.simcore import activate

    activate()


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvdiet.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvdiet.engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvdiet' has no attribute {name!r}")
