"""Request-level driving of the model: the cache system (`ModelRunner`), single-request generation, and the
continuous-batching engine (request, scheduler, engine, loop) behind `kvdiet.LLM` and ``kvdiet serve``."""
