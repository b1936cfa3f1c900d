"""Request-level driving of the model: sampling and (for now) single-request generation."""
