"""Trace-driven study of the cache system (``kvdiet replay``): trace readers (`traces`), the model-free tier
simulation (`model_free`, with the compute model in `cost`), engine-mode replay (`engine_mode`), the policy
study and its findings (`study`), reports (`report`) and the command (`command`)."""
