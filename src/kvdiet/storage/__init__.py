"""Torch-free byte tiers behind small protocols: SWA pool (in-process, Redis), persistent store, clock."""
