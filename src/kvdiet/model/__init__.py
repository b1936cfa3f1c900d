"""The DeepSeek-V4.1 reference model on CPU, in fp32: leaf modules (`layers` for RMSNorm and RoPE, `hc` for
the mHC hyper-connection streams, `moe` for the routed + shared experts, `engram` for the hashed n-gram
memory) and the attention stack built on them. Parameter names follow DeepSeek's checkpoint, formulas follow
shared/reference/v41-spec.md; this package does not know about cache pools, tiers or serving.
"""
