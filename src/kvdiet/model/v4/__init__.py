"""The DeepSeek-V4-Flash baseline model (`V4Transformer`), held to transformers' ``deepseek_v4``."""

from kvdiet.model.v4.transformer import V4Transformer

__all__ = ["V4Transformer"]
