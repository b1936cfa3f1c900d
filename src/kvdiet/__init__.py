"""kvdiet: the KV-cache system of DeepSeek-V4.1-Flash, with DeepSeek-V4-Flash as the baseline."""

__version__ = "0.1.0"
