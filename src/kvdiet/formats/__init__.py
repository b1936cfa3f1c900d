"""Packed cache-entry formats.

`layout` (torch-free) declares each format's bytes; the torch modules `fp4` (main KV), `mxfp4` (index
keys), `fp8` (window entries) and `v4_record` (V4 baseline) quantise and pack into exactly those bytes.
Importing this package does not import torch.
"""

from kvdiet.formats.layout import (
    EntryFormat,
    bf16_format,
    index_key_format,
    main_kv_format,
    v4_record_format,
    window_format,
)

__all__ = [
    "EntryFormat",
    "bf16_format",
    "index_key_format",
    "main_kv_format",
    "v4_record_format",
    "window_format",
]
