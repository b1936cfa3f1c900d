"""Cache tiers behind small protocols: device pool, SWA pool, persistent store, clock."""
