"""`kvdiet fidelity`: the approximations DeepSeek-V4.1's designers left unquantified, measured against their
exact counterparts in the same run — FP4/MXFP4/FP8 caches against fp32 caches, CSA2's shared top-k against
what each layer would pick itself, bounded replay against a full prefill. This package drives the model
(`kvdiet.model`); it knows nothing about the cache system or serving.
"""
