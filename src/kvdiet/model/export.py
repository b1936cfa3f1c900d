"""Write weights in DeepSeek's released checkpoint layout: a folder with ``config.json`` and safetensors shards
listed in ``model.safetensors.index.json``, tensors named and stored as the release stores them.

Storage by tensor (v41-spec §10; the census of ``shared/golden/tiny-fp8``); every ``.scale`` is F8_E8M0, per
32×32 tile for FP8 linears:

| tensors | stored |
|---|---|
| ``attn.wq_a/wq_b/wkv/wo_b``, ``attn.indexer.wq_b``, ``ffn.shared_experts.w*``, ``engram.wkv`` | F8_E4M3 + ``.scale`` |
| ``ffn.experts.{e}.w1/w2/w3`` (routed) | F4 (``float4_e2m1fn_x2``) + ``.scale`` per 32 inputs |
| ``engram.embed.weight`` / ``.scale`` | F8_E4M3 / F8_E8M0 (the table's own bytes) |
| ``attn_sink``, ``hc_*``, ``gate.bias``, ``head.weight``, ratio-2 compressor weights | F32 |
| everything else | BF16 |

`save_checkpoint` writes a model; `write_random_checkpoint` writes seeded random weights for any config one
shard at a time, without building the model (a checkpoint larger than memory, for loader tests and
benchmarks). The loader (`kvdiet.model.loader`) reads both back. Where the config's Engram needs a
compressed-token map (``engram_compressed_vocab_size`` ≠ ``vocab_size``) the map the weights were made with
(the model's, or the random weights' placeholder) is written beside them as ``engram_token_map.safetensors``
(`kvdiet.model.checkpoint_token_map`), so the folder loads without a tokenizer. Every file is created with the
process's umask, as ``open`` creates files.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from kvdiet.config import ModelConfig
from kvdiet.model.checkpoint_token_map import (
    TOKEN_MAP_FILE,
    needs_token_map,
    placeholder_token_map,
    save_token_map,
)
from kvdiet.model.engram import Fp8Embedding
from kvdiet.model.linear import FP4_BLOCK, Linear, quantize_fp4_weight, quantize_fp8_weight
from kvdiet.model.transformer import Transformer

__all__ = ["check_fp4_experts", "save_checkpoint", "stored_tensors", "write_random_checkpoint"]

_FP8 = re.compile(
    r"(attn\.(wq_a|wq_b|wkv|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]|engram\.wkv)$"
)
_FP4 = re.compile(r"ffn\.experts\.\d+\.w[123]$")
_F32 = re.compile(r"(attn_sink|hc_(attn|ffn)_(fn|base|scale)|gate\.bias|^head\.weight)$")
_INIT_STD = 0.02
BLOCK = 32  # V4.1's FP8 tile edge (config quantization_config.weight_block_size)


def stored_tensors(
    prefix: str, module: torch.nn.Module, *, ratio: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors one module contributes to a released checkpoint: ``(name, tensor)`` in stored dtypes.

    Args:
        prefix: the module's name in the model (``layers.3.attn.wq_a``).
        module: a `Linear`, an `Fp8Embedding` or any module with parameters (its own, not its children's).
        ratio: the layer's compress ratio (ratio-2 compressor weights are stored F32).
    """
    dot = f"{prefix}." if prefix else ""
    if isinstance(module, Linear):
        w = module.dense_weight()
        if _FP8.search(prefix):
            q, s = quantize_fp8_weight(w, block=BLOCK)
            yield f"{dot}weight", q
            yield f"{dot}scale", s
        elif _FP4.search(prefix):
            q, s = quantize_fp4_weight(w)
            yield f"{dot}weight", q
            yield f"{dot}scale", s
        else:
            f32 = _F32.search(f"{dot}weight") or (".compressor." in prefix and ratio > 1)
            yield f"{dot}weight", w.to(torch.float32 if f32 else torch.bfloat16)
    elif isinstance(module, Fp8Embedding):
        yield f"{dot}weight", module.weight.view(torch.float8_e4m3fn)
        yield f"{dot}scale", module.scale.view(torch.float8_e8m0fnu)
    else:
        for name, p in module.named_parameters(recurse=False):
            full = f"{dot}{name}"
            yield full, p.detach().to(torch.float32 if _F32.search(full) else torch.bfloat16)


def save_checkpoint(model: Transformer, directory: str | Path, *, shard_bytes: int = 4 << 30) -> Path:
    """Write ``model`` as a released checkpoint (quantised as the module docstring says) into ``directory``.

    Raises:
        ValueError: a tensor is not resident (a model whose experts are read on first use), or routed experts
            too narrow for FP4 (`check_fp4_experts`).
    """
    check_fp4_experts(model.cfg)
    ratios = {f"layers.{b.info.layer_id}.": b.info.compress_ratio for b in model.layers}
    token_map = model.hasher.token_map if needs_token_map(model.cfg) else None

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for prefix, module in model.named_modules():
            if any(t.device.type == "meta" for t in (*module.parameters(False), *module.buffers(False))):
                raise ValueError(f"{prefix} is not resident; load the model eagerly to save it")
            ratio = next((r for p, r in ratios.items() if prefix.startswith(p)), 0)
            yield from stored_tensors(prefix, module, ratio=ratio)

    return _write(model.cfg, Path(directory), tensors(), shard_bytes, token_map=token_map)


def write_random_checkpoint(
    cfg: ModelConfig, directory: str | Path, *, seed: int = 0, shard_bytes: int = 1 << 30
) -> Path:
    """Seeded random weights for ``cfg`` in the released layout, written shard by shard (peak memory about
    one shard plus the largest tensor): matrices N(0, 0.02²) quantised as stored, routed experts as random
    FP4 codes with unit scales, norms 1, biases and sinks 0, Engram tables random FP8 rows; the Engram token
    map, where one is needed, the placeholder (`placeholder_token_map`), stored beside them.

    Raises:
        ValueError: routed experts too narrow for FP4 (`check_fp4_experts`); nothing is written then. Nothing
            else is refused here: what the cache formats need (``head_dim`` a multiple of 32 for packed
            caches) is checked when a model is run, with the caches it runs with.
    """
    check_fp4_experts(cfg)
    token_map = placeholder_token_map(cfg)
    # the model is built (on meta) only for its tensors' names and shapes; they depend on neither the cache
    # format (fp32 caches take any head_dim) nor the Engram token map
    meta = Transformer(cfg, meta=True, exact=True, token_map=token_map)
    ratios = {f"layers.{b.info.layer_id}.": b.info.compress_ratio for b in meta.layers}
    gen = torch.Generator().manual_seed(seed)
    byte_gen = np.random.default_rng(seed)  # random FP4 codes: the bulk of the bytes, fast

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for prefix, module in meta.named_modules():
            ratio = next((r for p, r in ratios.items() if prefix.startswith(p)), 0)
            dot = f"{prefix}." if prefix else ""
            if isinstance(module, Linear) and _FP4.search(prefix):
                o, i = module.out_features, module.in_features
                codes = torch.frombuffer(bytearray(byte_gen.bytes(o * i // 2)), dtype=torch.uint8)
                yield f"{dot}weight", codes.view(o, i // 2).view(torch.float4_e2m1fn_x2)
                yield (
                    f"{dot}scale",
                    torch.full((o, i // 32), 127 - 5, dtype=torch.uint8).view(torch.float8_e8m0fnu),
                )
            elif isinstance(module, Linear):
                module.set_weight(
                    torch.randn(module.out_features, module.in_features, generator=gen) * _INIT_STD
                )
                yield from stored_tensors(prefix, module, ratio=ratio)
                module.weight = torch.nn.Parameter(module.weight.to("meta"), requires_grad=False)
            elif isinstance(module, Fp8Embedding):
                rows = torch.randint(0, 0x7E, (module.rows, module.dim), generator=gen, dtype=torch.uint8)
                rows |= torch.randint(0, 2, rows.shape, generator=gen, dtype=torch.uint8) << 7
                yield f"{dot}weight", rows.view(torch.float8_e4m3fn)
                yield (
                    f"{dot}scale",
                    torch.full((module.rows, module.dim // 32), 127, dtype=torch.uint8).view(
                        torch.float8_e8m0fnu
                    ),
                )
            else:
                for name, p in module.named_parameters(recurse=False):
                    full = f"{dot}{name}"
                    if p.dim() >= 2 and name not in ("q_weight", "k_weight"):
                        value = torch.randn(p.shape, generator=gen) * (
                            1.0 if name == "weight" and prefix == "embed" else _INIT_STD
                        )
                    elif name.endswith(("bias", "attn_sink", "hc_attn_base", "hc_ffn_base")):
                        value = torch.zeros(p.shape)
                    else:
                        value = torch.ones(p.shape)
                    yield full, value.to(torch.float32 if _F32.search(full) else torch.bfloat16)

    return _write(cfg, Path(directory), tensors(), shard_bytes, token_map=token_map)


def check_fp4_experts(cfg: ModelConfig) -> None:
    """The release stores routed experts as FP4 with one scale per `FP4_BLOCK` (32) inputs (v41-spec §10): their
    inputs, ``hidden_size`` (w1, w3) and ``moe_intermediate_size`` (w2), must be whole blocks.

    Raises:
        ValueError: naming the field and its value.
    """
    for name in ("hidden_size", "moe_intermediate_size"):
        value = getattr(cfg, name)
        if cfg.n_routed_experts and value % FP4_BLOCK:
            raise ValueError(
                f"{name} {value} is not a multiple of {FP4_BLOCK}: the released format's FP4 routed experts "
                f"take whole blocks of {FP4_BLOCK} inputs"
            )


def _write(
    cfg: ModelConfig,
    out: Path,
    tensors: Iterator[tuple[str, torch.Tensor]],
    shard_bytes: int,
    *,
    token_map: torch.Tensor | None,
) -> Path:
    """Shards of at most ``shard_bytes`` (a larger tensor gets its own), the index, ``config.json`` and, when
    given, the Engram ``token_map``. safetensors' ``save_file`` writes a private temporary file (mode 0600)
    and renames it; each such file gets the mode ``open`` would have given it (0666 less the umask)."""
    out.mkdir(parents=True, exist_ok=True)
    mode = 0o666 & ~_umask()
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > shard_bytes:
            save_file(groups[-1], str(out / f"part-{len(groups):05d}"))  # renamed once the count is known
            groups[-1] = {name: None for name in groups[-1]}  # keep the names, drop the tensors
            groups.append({})
            size = 0
        groups[-1][name] = tensor.contiguous()
        size += nbytes
    save_file(groups[-1], str(out / f"part-{len(groups):05d}"))
    weight_map = {}
    for i, group in enumerate(groups, start=1):
        shard = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        (out / f"part-{i:05d}").replace(out / shard)
        (out / shard).chmod(mode)
        weight_map.update(dict.fromkeys(group, shard))
    index = {"metadata": {"writer": "kvdiet"}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = cfg.to_json_dict()
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
        "scale_fmt": "ue8m0",
        "expert_dtype": "fp4",
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    if token_map is not None:
        save_token_map(out, token_map).chmod(mode)
    else:  # a map left by an earlier write into this folder is not these weights'
        (out / TOKEN_MAP_FILE).unlink(missing_ok=True)
    return out


def _umask() -> int:
    """The process's file-mode creation mask: Linux's ``Umask:`` line of ``/proc/self/status`` (a read; no other
    thread's file can be created under a changed mask), else set and restore (POSIX has no call that only reads
    it)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
