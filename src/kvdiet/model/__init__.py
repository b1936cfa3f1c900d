"""The DeepSeek-V4.1 reference model on CPU, in fp32: leaf modules (`layers` for RMSNorm and RoPE, `hc` for
the mHC hyper-connection streams, `moe` for the routed + shared experts, `engram` for the hashed n-gram
memory) and the attention stack built on them, with the state they compute into (per-request state, the
paged device pool, window snapshots as bytes). Parameter names follow DeepSeek's checkpoint, formulas follow
shared/reference/v41-spec.md; this package does not know about ref counts, prefix hashes, tiers or serving:
block ids come from an allocator the caller passes (`kvdiet.model.block_ids`).
"""
