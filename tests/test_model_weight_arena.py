"""`pack_weights`: a model's parameters moved into one arena in decode-read order, with the same values."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch import nn

from kvdiet.config import load_config
from kvdiet.model.build import load_model
from kvdiet.model.transformer import Transformer
from kvdiet.model.weight_arena import READ_ORDER, pack_weights

TOKENS = [5, 9, 11, 40]


def _logits(model: Transformer) -> torch.Tensor:
    """A 40-token prefill's last logits, then one decode step per token of `TOKENS`, two requests a step."""
    states = [model.new_state() for _ in range(2)]
    rows = [model.prefill(state, torch.arange(2, 42) + i) for i, state in enumerate(states)]
    steps = [model.decode(states, [t, t + 1]) for t in TOKENS]
    return torch.cat([torch.stack(rows), *steps])


def test_a_packed_model_gives_the_same_logits_bit_for_bit() -> None:
    cfg = load_config("v4.1-micro")
    plain, packed = Transformer.from_config(cfg, seed=3), Transformer.from_config(cfg, seed=3)
    before = {name: p.detach().clone() for name, p in packed.named_parameters()}
    arena = pack_weights(packed)
    assert arena is not None and arena.count == len(before) - 1  # all but the token embedding
    for name, p in packed.named_parameters():
        assert torch.equal(p, before[name]) and p.dtype == before[name].dtype, name
    assert torch.equal(_logits(packed), _logits(plain))


def test_each_layer_lies_back_to_back_in_read_order_then_the_head() -> None:
    model = Transformer.from_config(load_config("v4.1-micro"), seed=0)
    embed = model.embed.weight.data_ptr()
    arena = pack_weights(model)
    assert arena is not None
    # each parameter a storage of its own bytes (it pickles alone), those bytes back to back below
    moved = [p for n, p in model.named_parameters() if n != "embed.weight"]
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in moved)
    assert model.embed.weight.data_ptr() == embed  # a step reads one row of it: left where it was
    order = []
    for layer in model.layers:
        named = list(layer.named_parameters())
        ranks = [
            next((i for i, pre in enumerate(READ_ORDER) if n.startswith(pre)), len(READ_ORDER))
            for n, _ in named
        ]
        order += [p for _, (_, p) in sorted(zip(ranks, named, strict=True), key=lambda rp: rp[0])]
    order += [model.norm.weight, model.head.weight]
    first = order[0].data_ptr()
    assert first % (2 << 20) == 0  # on a huge-page boundary
    end = first
    for p in order:  # each starts at the next 64-byte boundary after the one before
        assert p.data_ptr() == end, p.shape
        end += -(-p.numel() * p.element_size() // 64) * 64
    assert end - first == arena.nbytes
    # the attention's query projection comes before its output projection, the FFN after both
    layer = model.layers[0]
    assert layer.hc_attn_fn.data_ptr() < layer.attn.wq_a.weight.data_ptr() < layer.attn.wo_b.weight.data_ptr()
    assert layer.attn.wo_b.weight.data_ptr() < layer.hc_ffn_fn.data_ptr() < layer.ffn.gate.weight.data_ptr()


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 4), nn.Linear(4, 8)])
        self.tied = nn.Linear(8, 8, bias=False)
        self.other = nn.Linear(8, 8, bias=False)
        self.other.weight = self.tied.weight  # one Parameter in two places
        self.transposed = nn.Parameter(torch.randn(8, 4).t())  # not contiguous
        self.part = nn.Parameter(torch.randn(16)[:8])  # a view of a larger storage
        self.twin_a = nn.Parameter(torch.randn(8))
        self.twin_b = nn.Parameter(self.twin_a.data)  # two Parameters on one storage
        self.lazy = nn.Parameter(torch.empty(4, 4, device="meta"))


def test_tied_meta_strided_and_partial_storage_parameters_stay_where_they_are() -> None:
    toy = _Toy()
    stay = {
        name: p.data_ptr() for name, p in toy.named_parameters() if not name.startswith(("layers.", "tied"))
    }
    values = {name: p.detach().clone() for name, p in toy.named_parameters() if p.device.type == "cpu"}
    arena = pack_weights(toy)
    assert arena is not None and arena.count == 5  # the layers' 4 and the tied weight (named once)
    for name, ptr in stay.items():
        assert dict(toy.named_parameters())[name].data_ptr() == ptr, name
    assert toy.other.weight is toy.tied.weight  # still tied, now in the arena
    for name, p in toy.named_parameters():
        if name in values:
            assert torch.equal(p, values[name]), name
    x = torch.randn(3, 8)
    assert torch.equal(toy.other(x), toy.tied(x))


class _Shares(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)])
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = nn.Parameter(self.embed.weight.data)  # tied to the (unmoved) embedding
        self.register_buffer("w_t", self.layers[0].weight.data.t())  # a buffer over a layer's weight


def test_a_weight_shared_with_the_embedding_or_a_buffer_stays_shared() -> None:
    """Only the moving parameters' storages were counted: a head tied to the embedding and a layer weight a
    buffer views were moved, their ties silently cut (and their old storage kept: twice the memory)."""
    toy = _Shares()
    arena = pack_weights(toy)
    assert arena is not None and arena.count == 1  # layers[1] alone
    toy.embed.weight.data[0, 0] = 123.0
    toy.layers[0].weight.data[1, 2] = 7.0
    assert toy.head.weight[0, 0] == 123.0 and toy.w_t[2, 1] == 7.0


def test_packing_leaves_the_resident_memory_as_it_was() -> None:
    """The old storages under glibc's mmap threshold went back to the heap, not the system: v4.1-mini's resident
    set grew 111 MiB by packing; the heap's free pages are now returned."""
    import ctypes
    import re

    def resident_mib() -> int:
        return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) // 1024

    model, _ = load_model("v4.1-mini", seed=0, pack=False)
    ctypes.CDLL(None).malloc_trim(0)
    before = resident_mib()
    assert pack_weights(model) is not None
    assert resident_mib() - before < 32


def test_nothing_to_move_is_none() -> None:
    assert pack_weights(nn.Module()) is None
    lazy = nn.Linear(4, 4, device="meta")
    assert pack_weights(lazy) is None


def test_load_model_packs_a_cpu_model() -> None:
    model, _ = load_model("v4.1-micro", seed=0)
    moved = [p for n, p in model.named_parameters() if n != "embed.weight"]
    ends = [p.data_ptr() + p.numel() * p.element_size() for p in moved]
    sizes = sum(-(-p.numel() * p.element_size() // 64) * 64 for p in moved)
    assert max(ends) - min(p.data_ptr() for p in moved) <= sizes  # one arena, back to back


def test_a_packed_module_pickles_as_its_own_weights() -> None:
    """A packed parameter's storage is its own bytes over the arena: pickling one module (as multiprocessing or a
    cache would) writes its weights, not the whole arena's once per parameter, and it loads with the same values."""
    model = Transformer.from_config(load_config("v4.1-micro"), seed=0)
    assert pack_weights(model) is not None
    attn = model.layers[1].attn
    own = sum(p.numel() * p.element_size() for p in attn.parameters()) + sum(
        b.numel() * b.element_size() for b in attn.buffers()
    )
    data = pickle.dumps(attn)
    assert len(data) < 2 * own + (1 << 20)
    loaded = pickle.loads(data)
    for (name, p), (_, q) in zip(attn.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(p, q), name
