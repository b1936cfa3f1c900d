"""The weights flags of ``kvdiet generate`` and ``serve`` (``--weights``, ``--numerics``, ``--expert-cache-size``;
``fidelity`` and ``golden`` take ``--numerics`` too) and what they resolve to: the model's config and the expert
cache's bytes. Torch-free (the command line builds its parsers from it)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvdiet.config import NUMERICS, model_config_path
from kvdiet.units import parse_bytes, parse_flag

__all__ = ["add_numerics_arg", "add_weights_args", "expert_cache_bytes", "resolve_model"]


def add_weights_args(parser: argparse.ArgumentParser) -> None:
    """``--weights``, ``--numerics`` and ``--expert-cache-size`` (generate, serve)."""
    parser.add_argument(
        "--weights",
        help="checkpoint instead of random weights: a folder with config.json and safetensors (one file, or "
        "shards with model.safetensors.index.json; DeepSeek's released layout) or one .safetensors file",
    )
    add_numerics_arg(parser)
    parser.add_argument(
        "--expert-cache-size",
        help="routed-expert bytes to keep in memory with --weights, e.g. 20GB; experts are read from the "
        "checkpoint on first use (default: all of them when they fit, else 80%% of the memory left)",
    )


def resolve_model(args: argparse.Namespace) -> None:
    """``args.model`` from ``--weights``' config.json when not given, else ``v4.1-mini`` (in place).

    Raises:
        ValueError: ``--weights`` names nothing that exists, or (without ``--model``) has no config.json.
    """
    if args.weights is not None and not Path(args.weights).exists():
        raise ValueError(f"--weights {args.weights}: no such file or folder")
    if args.model is None:
        found = model_config_path(args.weights)
        if args.weights is not None and found is None:
            raise ValueError(f"--weights {args.weights} has no config.json beside it; give --model")
        args.model = str(found) if found is not None else "v4.1-mini"


def expert_cache_bytes(args: argparse.Namespace) -> int | None:
    """``--expert-cache-size`` in bytes (None: automatic)."""
    if args.expert_cache_size is None:
        return None
    if args.weights is None:
        raise ValueError("--expert-cache-size goes with --weights (random weights keep every expert)")
    return parse_flag("--expert-cache-size", parse_bytes, args.expert_cache_size)


def add_numerics_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--numerics`` (generate, serve, fidelity, golden): how FP8/FP4-stored weights compute."""
    parser.add_argument(
        "--numerics",
        choices=NUMERICS,
        default="auto",
        help="fp8: FP8 activations before every FP8/FP4 linear, as DeepSeek's reference runs the release; "
        "bf16: weights dequantised on load, plain fp32 matmuls; auto (default): fp8 when the checkpoint's "
        "quantization_config says fp8 (random weights are always bf16)",
    )
