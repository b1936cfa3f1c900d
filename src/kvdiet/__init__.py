"""kvdiet: the KV-cache system of DeepSeek-V4.1-Flash, with DeepSeek-V4-Flash as the baseline.

``from kvdiet import LLM, SamplingParams`` gives the offline API, with `EngineArgs`, `CacheOptions` and
`parse_policy` for its settings (each imported on first use, so the planner and the config tools do not load
torch). Importing it sets ``MKL_CBWR`` unless the environment does (`kvdiet.threads.reproducible_blas`: the
BLAS products' bits then do not depend on the thread count). ``KVDIET_SIMCORE=1`` loads the compiled simulator core
(`kvdiet.sim.simcore`) before anything imports the modules it replaces.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from kvdiet.threads import reproducible_blas

__version__ = "0.1.0"
__all__ = ["LLM", "CacheOptions", "EngineArgs", "SamplingParams", "__version__", "parse_policy"]

_LAZY = {
    "LLM": "kvdiet.engine.llm",
    "SamplingParams": "kvdiet.engine.sampling",
    "EngineArgs": "kvdiet.engine.args",
    "CacheOptions": "kvdiet.cache.options",
    "parse_policy": "kvdiet.cache.policies",
}
"""Public name → the module that defines it, imported on first use (`__getattr__`)."""

# MKL's products with the same bits at any thread count, asked for before anything here runs one
reproducible_blas()

if os.environ.get("KVDIET_SIMCORE") == "1":
    from kvdiet.sim.simcore import activate

    activate()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvdiet' has no attribute {name!r}")
