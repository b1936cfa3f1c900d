"""Cache control plane (no tensors): byte specs per cache kind and SWA policies."""
