"""`weights_checksum`: the identity of a model's weights, part of the cache fingerprint (a prefix hit is only
valid on the weights that wrote it)."""

from __future__ import annotations

import hashlib

import torch

from kvdiet.device import to_host

__all__ = ["weights_checksum"]


def weights_checksum(model: torch.nn.Module) -> str:
    """SHA-256 hex of every parameter's name, shape, dtype and bytes (part of the model fingerprint).

    Tensors not in memory (routed experts and Engram tables a checkpoint serves on first use) count by their
    name and shape, and the model's ``weights_digest`` (the checkpoint's headers, sizes and times) stands
    for their bytes.
    """
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        if p.device.type != "meta":
            h.update(to_host(p.reshape(-1).view(torch.uint8)).numpy().tobytes())
    h.update(str(getattr(model, "weights_digest", "")).encode())
    return h.hexdigest()
