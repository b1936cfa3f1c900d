"""Engram hashing (v41-spec §8.3a; DeepSeek's reference ``engram.py``): token ids -> compressed ids -> the rows
of every Engram layer's table that a position reads. No parameters.

- `compressed_token_map`: token id -> compressed id, from the tokenizer's vocabulary (normalised text).
- `EngramHasher`: compressed ids -> per position ``(max_ngram − 1) · n_heads`` row ids into the layer's table
  (disjoint prime-sized buckets, multiplicative XOR hash). The only per-request state is the last
  ``max_ngram − 1`` compressed ids (the *history*), carried across prefill chunks, decode steps and replay;
  it is not KV.

Image ("dead") tokens are not modelled here: every id is treated as text. The tables and the gate that read
these rows are `kvdiet.model.engram`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from kvdiet.config import ModelConfig
from kvdiet.formats import native
from kvdiet.tokenizer import Tokenizer

__all__ = ["EngramHasher", "check_token_map", "compressed_token_map"]

_MULTIPLIER_SEED = 10007  # per-layer seed factor of the hash multipliers


# --- compressed token map ---------------------------------------------------------------------------


def compressed_token_map(tokenizer: Tokenizer) -> tuple[torch.Tensor, int]:
    """Map every token id to its compressed id (v41-spec §8.3a, "Compressed token map").

    Ids 0..V−1 are decoded one at a time (special tokens kept, no clean-up). Text containing U+FFFD (a partial
    UTF-8 byte token) is keyed by the raw vocabulary string; other text by its normalisation (NFKC, NFD, strip
    accents, lowercase, every run of space/tab/CR/LF -> one space, a text that is exactly one space is kept,
    strip), falling back to the decoded text when that is empty. Keys get compressed ids in order of first
    appearance. The normaliser is Hugging Face ``tokenizers.normalizers``, as in DeepSeek's Engram code.

    The result is cached per tokenizer file for the life of the process (about 1 s to build for DeepSeek's
    129,280 ids, giving 99,092 compressed ids).

    Returns:
        (int64 tensor [vocab_size] of compressed ids (a fresh copy), number of compressed ids).
    Raises:
        TokenizerUnavailableError: ``tokenizers`` is not installed.
    """
    table, count = _cached_token_map(_TokenizerFile(str(tokenizer.path.resolve()), tokenizer))
    return table.clone(), count


@dataclass(frozen=True, slots=True)
class _TokenizerFile:
    """Cache key: the tokenizer file; the loaded tokenizer rides along without taking part in the key."""

    path: str
    tokenizer: Tokenizer = field(compare=False, hash=False)


@functools.lru_cache(maxsize=4)
def _cached_token_map(source: _TokenizerFile) -> tuple[torch.Tensor, int]:
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"  # protects a single-space text from Strip
    normalizer = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )
    tokenizer = source.tokenizer
    keys: dict[str, int] = {}
    table: list[int] = []
    for token_id, text in enumerate(tokenizer.decode_all_single_raw()):
        partial_utf8 = "\ufffd" in text
        key = tokenizer.token_string(token_id) if partial_utf8 else normalizer.normalize_str(text) or text
        table.append(keys.setdefault(key, len(keys)))
    return torch.tensor(table, dtype=torch.int64), len(keys)


# --- hashing ----------------------------------------------------------------------------------------


class EngramHasher:
    """Row ids of every Engram layer's table from compressed token ids (v41-spec §8.3a). No parameters.

    Built from config fields ``engram_layer_ids``, ``engram_num_embeddings``, ``engram_max_ngram_size`` (N),
    ``engram_vocab_size``, ``engram_n_heads``, ``engram_pad_token_id``, ``engram_compressed_vocab_size``.

    Bucket layout: for each Engram layer in order, for n = 2..N, for each head, the smallest prime above the
    previous one (each (layer, n) run restarts from ``engram_vocab_size − 1``) not used anywhere before. A
    layer's row offsets are the running sums of its primes (n-major, head-minor); their total must equal
    ``engram_num_embeddings`` of that layer. Multipliers: ``default_rng(10007 · layer_id).integers(0, B, N)``
    with B = max(1, (2^63 − 1) // compressed_vocab // 2), each made odd (2v + 1).

    Chunked use (identical row ids to one shot, for any split)::

        history = hasher.initial_history()                     # [N−1] pad ids
        for chunk in chunks:                                   # raw token ids
            ids = hasher.with_history(hasher.compress(chunk), history)
            rows = hasher.row_ids(layer_id, ids)               # [len(chunk), n_cols]
            history = hasher.next_history(ids)

    Args:
        cfg: the model config.
        token_map: int64 [vocab_size] token id -> compressed id (from `compressed_token_map`). When None, the
            identity map is used, which is only valid when ``engram_compressed_vocab_size == vocab_size``.
    Raises:
        ValueError: an Engram field is missing; a layer's prime total differs from ``engram_num_embeddings``
            (both numbers named); no token map while the compressed vocab differs from ``vocab_size``; a token
            map with the wrong length or number of compressed ids.
    """

    def __init__(self, cfg: ModelConfig, token_map: torch.Tensor | None = None) -> None:
        fields = (
            "engram_layer_ids",
            "engram_num_embeddings",
            "engram_max_ngram_size",
            "engram_vocab_size",
            "engram_n_heads",
            "engram_pad_token_id",
            "engram_compressed_vocab_size",
        )
        missing = [f for f in fields if getattr(cfg, f) is None]
        if missing:
            raise ValueError(f"config {cfg.name!r} has no Engram: missing {', '.join(missing)}")
        assert cfg.engram_layer_ids is not None and cfg.engram_num_embeddings is not None
        assert cfg.engram_max_ngram_size is not None and cfg.engram_n_heads is not None
        assert cfg.engram_vocab_size is not None and cfg.engram_compressed_vocab_size is not None
        assert cfg.engram_pad_token_id is not None
        if len(cfg.engram_num_embeddings) != len(cfg.engram_layer_ids):
            raise ValueError(
                f"engram_num_embeddings has {len(cfg.engram_num_embeddings)} entries but engram_layer_ids "
                f"{list(cfg.engram_layer_ids)} has {len(cfg.engram_layer_ids)}"
            )
        if cfg.engram_max_ngram_size < 2:
            raise ValueError(f"engram_max_ngram_size must be >= 2, got {cfg.engram_max_ngram_size}")
        self.layer_ids: tuple[int, ...] = cfg.engram_layer_ids
        self.max_ngram: int = cfg.engram_max_ngram_size
        self.n_heads: int = cfg.engram_n_heads
        self.n_cols: int = (self.max_ngram - 1) * self.n_heads
        self.history_len: int = self.max_ngram - 1
        self.compressed_vocab_size: int = cfg.engram_compressed_vocab_size
        self.token_map = check_token_map(cfg, token_map)
        self.pad_id: int = int(self.token_map[cfg.engram_pad_token_id])

        primes = _bucket_primes(len(self.layer_ids), self.max_ngram, self.n_heads, cfg.engram_vocab_size)
        self._primes: dict[int, torch.Tensor] = {}
        self._offsets: dict[int, torch.Tensor] = {}
        self._multipliers: dict[int, torch.Tensor] = {}
        bound = max(1, (2**63 - 1) // self.compressed_vocab_size // 2)
        for k, layer_id in enumerate(self.layer_ids):
            layer_primes = torch.tensor(primes[k], dtype=torch.int64)  # [N−1, heads]
            total = int(layer_primes.sum())
            if total != cfg.engram_num_embeddings[k]:
                raise ValueError(
                    f"Engram layer {layer_id}: bucket primes total {total} rows but "
                    f"engram_num_embeddings[{k}] is {cfg.engram_num_embeddings[k]}"
                )
            flat = layer_primes.flatten()
            self._primes[layer_id] = layer_primes
            self._offsets[layer_id] = (torch.cumsum(flat, 0) - flat).view_as(layer_primes)
            draws = np.random.default_rng(_MULTIPLIER_SEED * layer_id).integers(
                0, bound, size=(self.max_ngram,), dtype=np.int64
            )
            self._multipliers[layer_id] = torch.from_numpy(draws * 2 + 1)

    def to(self, device: torch.device) -> EngramHasher:
        """Move the token map and every layer's primes, offsets and multipliers to ``device`` (in place);
        returns self."""
        self.token_map = self.token_map.to(device)
        for table in (self._primes, self._offsets, self._multipliers):
            for layer_id, t in table.items():
                table[layer_id] = t.to(device)
        return self

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every table by name (``token_map``, ``primes[l]``, ``offsets[l]``, ``multipliers[l]``), not copied."""
        named = {"token_map": self.token_map}
        for kind, table in (
            ("primes", self._primes),
            ("offsets", self._offsets),
            ("multipliers", self._multipliers),
        ):
            named |= {f"{kind}[{layer_id}]": t for layer_id, t in table.items()}
        return named

    def primes(self, layer_id: int) -> torch.Tensor:
        """Bucket sizes of a layer, int64 [N−1, n_heads] (row n−2 is the n-gram)."""
        return self._primes[self._check_layer(layer_id)].clone()

    def offsets(self, layer_id: int) -> torch.Tensor:
        """First row of each bucket of a layer, int64 [N−1, n_heads]."""
        return self._offsets[self._check_layer(layer_id)].clone()

    def multipliers(self, layer_id: int) -> torch.Tensor:
        """Odd hash multipliers of a layer, int64 [N] (entry s multiplies the id s tokens back)."""
        return self._multipliers[self._check_layer(layer_id)].clone()

    def num_rows(self, layer_id: int) -> int:
        """Rows in the layer's table (= its ``engram_num_embeddings`` entry)."""
        return int(self._primes[self._check_layer(layer_id)].sum())

    def compress(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids (int, any shape) -> compressed ids, int64, same shape.

        Raises:
            IndexError: an id outside [0, vocab_size).
        """
        return self.token_map[token_ids.long()]

    def initial_history(self) -> torch.Tensor:
        """History of a fresh request: N−1 compressed pad ids, int64 [N−1] (positions before 0 are pad)."""
        return torch.full((self.history_len,), self.pad_id, dtype=torch.int64, device=self.token_map.device)

    def with_history(self, compressed_ids: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        """``cat(history, compressed_ids)`` on the last axis: [..., T] -> [..., N−1+T] (history None = fresh).

        Raises:
            ValueError: a history of the wrong length.
        """
        if history is None:
            history = self.initial_history()
        if history.shape[-1] != self.history_len:
            raise ValueError(f"history must hold {self.history_len} ids, got shape {tuple(history.shape)}")
        history = history.to(torch.int64).expand(*compressed_ids.shape[:-1], self.history_len)
        return torch.cat([history, compressed_ids.to(torch.int64)], dim=-1)

    def next_history(self, ids_with_history: torch.Tensor) -> torch.Tensor:
        """The history to carry after a chunk: the last N−1 ids of ``ids_with_history``, int64 [..., N−1]."""
        return ids_with_history[..., ids_with_history.shape[-1] - self.history_len :].clone()

    def history_after(self, prefix_ids: torch.Tensor) -> torch.Tensor:
        """The history once token ids ``prefix_ids`` (int [n], a request's first n tokens) are processed.

        Engram history is a function of the tokens alone, so a replay or restore rebuilds it from the prompt.
        """
        tail = prefix_ids[max(0, prefix_ids.shape[-1] - self.history_len) :]
        return self.next_history(self.with_history(self.compress(tail)))

    def row_ids(self, layer_id: int, ids_with_history: torch.Tensor) -> torch.Tensor:
        """Table rows of every position of a chunk (v41-spec §8.3a, "Hash ids").

        For position t, ``tok[s]`` = compressed id s tokens back (s = 0..N−1, taken from the history at the
        start), ``prod[s] = tok[s] · mult[s]`` (int64, wrapping); folding ``prod[1..n−1]`` into ``prod[0]`` by
        XOR gives the n-gram hash; row = ``hash mod prime[n][head] + offset[n][head]``. On the CPU one compiled
        call (``engram_hashes``, ``formats/engram_kernels.cpp``) gives the same ids.

        Args:
            layer_id: a model layer in ``engram_layer_ids`` (the hash seeds use the layer id, not its index).
            ids_with_history: int64 [..., N−1+T]: the carried history then the chunk's compressed ids (see
                `with_history`).
        Returns:
            int64 [..., T, (N−1)·n_heads], column (n−2)·n_heads + head, each in its bucket
            [offset, offset + prime).
        Raises:
            ValueError: ``layer_id`` is not an Engram layer, or fewer than N−1 ids are given.
        """
        self._check_layer(layer_id)
        h = self.history_len
        total = ids_with_history.shape[-1]
        if total < h:
            raise ValueError(f"ids_with_history must start with {h} history ids, got only {total} ids")
        num_tokens = total - h
        ids = ids_with_history.to(torch.int64)
        mult = self._multipliers[layer_id]
        primes, offsets = self._primes[layer_id], self._offsets[layer_id]
        kernels = native.fp4_kernels()
        if kernels is not None and ids.is_cpu:  # one compiled call, the same ids
            rows = kernels.engram_hashes(ids.reshape(-1, total).contiguous(), mult, primes, offsets)
            if rows is not None:
                return rows.view(*ids.shape[:-1], num_tokens, self.n_cols)
        mix = ids[..., h : h + num_tokens] * mult[0]  # [..., T]
        columns = []
        for s in range(1, self.max_ngram):
            mix = mix ^ (ids[..., h - s : h - s + num_tokens] * mult[s])
            # torch's % on int64 takes the divisor's sign (like NumPy), so rows are never negative.
            columns.append(mix[..., None] % primes[s - 1] + offsets[s - 1])  # [..., T, heads]
        return torch.cat(columns, dim=-1)

    def _check_layer(self, layer_id: int) -> int:
        if layer_id not in self._primes:
            raise ValueError(
                f"layer {layer_id} is not an Engram layer (engram_layer_ids {list(self.layer_ids)})"
            )
        return layer_id


def check_token_map(cfg: ModelConfig, token_map: torch.Tensor | None) -> torch.Tensor:
    """``token_map`` as int64 [vocab_size] (None: the identity, where ``engram_compressed_vocab_size`` equals
    ``vocab_size``), checked against ``cfg``: an integer tensor of ``vocab_size`` ids whose compressed ids are
    ``[0, engram_compressed_vocab_size)``, the largest used.

    Raises:
        ValueError: None where the config needs a map; a float, bool or complex tensor (ids are integers);
            another shape; a negative id, or a largest id other than ``engram_compressed_vocab_size − 1``.
    """
    compressed = cfg.engram_compressed_vocab_size
    if token_map is None:
        if compressed != cfg.vocab_size:
            raise ValueError(
                f"config {cfg.name!r} needs a compressed token map (engram_compressed_vocab_size "
                f"{compressed} != vocab_size {cfg.vocab_size}); build one with "
                f"compressed_token_map(Tokenizer.deepseek())"
            )
        return torch.arange(cfg.vocab_size, dtype=torch.int64)
    if token_map.dtype.is_floating_point or token_map.dtype.is_complex or token_map.dtype == torch.bool:
        raise ValueError(f"token map has dtype {token_map.dtype}, expected integers (int64)")
    if token_map.ndim != 1 or token_map.numel() != cfg.vocab_size:
        raise ValueError(f"token map has shape {tuple(token_map.shape)}, expected ({cfg.vocab_size},)")
    token_map = token_map.to(torch.int64)
    if int(token_map.min()) < 0:
        raise ValueError(f"token map has a negative compressed id {int(token_map.min())}")
    count = int(token_map.max()) + 1
    if count != compressed:
        raise ValueError(
            f"token map has {count} compressed ids but engram_compressed_vocab_size is {compressed}"
        )
    return token_map


def _is_prime(n: int) -> bool:
    if n < 4:
        return n >= 2
    if n % 2 == 0 or n % 3 == 0:
        return False
    i = 5
    while i * i <= n:
        if n % i == 0 or n % (i + 2) == 0:
            return False
        i += 6
    return True


def _bucket_primes(num_layers: int, max_ngram: int, n_heads: int, vocab: int) -> list[list[list[int]]]:
    """primes[layer index][n − 2][head], never reused across layers, n-grams or heads."""
    used: set[int] = set()
    out: list[list[list[int]]] = []
    for _ in range(num_layers):
        layer: list[list[int]] = []
        for _n in range(2, max_ngram + 1):
            heads: list[int] = []
            candidate = vocab - 1
            for _h in range(n_heads):
                candidate += 1
                while not _is_prime(candidate) or candidate in used:
                    candidate += 1
                used.add(candidate)
                heads.append(candidate)
            layer.append(heads)
        out.append(layer)
    return out
