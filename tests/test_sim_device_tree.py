"""DeviceTree: the simulator's device pool — evictions by hand, the binary-search lookup, and the same blocks held
as a per-block LRU that frees a chain last block first (the engine's BlockPool order), on random chains."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kvdiet.sim.device_tree import DeviceTree


def _ten(first: int, end: int) -> list[int]:
    return [10] * (end - first)


def test_the_least_recently_used_leaf_goes_first_and_its_parent_inherits_its_time() -> None:
    d = DeviceTree(50)
    d.use([1, 2, 3], 3, _ten)
    d.use([4, 5], 2, _ten)
    d.use([1, 2], 2, _ten)  # a shorter prefix of the first chain: 2 is used, 3 is not
    d.use([6], 1, _ten)  # 60 > 50: the oldest leaf is 3 (used first); 2 is not a leaf while 3 is held
    assert 3 not in d and d.match([1, 2, 3], 3) == 2 and len(d) == 5
    d.use([7], 1, _ten)  # leaves now 2 (used third), 5 (second), 6, so 5 goes
    assert 5 not in d and 4 in d
    d.use([8], 1, _ten)  # 4 became a leaf with its child's time (second): the oldest
    assert 4 not in d and {1, 2, 6, 7, 8} == {b for b in range(1, 9) if b in d}
    assert d.nbytes == 50 and d.counters.evictions == 3


def test_match_is_the_held_prefix() -> None:
    d = DeviceTree(10**6)
    ids = list(range(100, 120))
    d.use(ids, 13, _ten)
    assert [d.match(ids, n) for n in (0, 5, 13, 20)] == [0, 5, 13, 13]
    assert d.match([999, 1000], 2) == 0  # ids are chained: another first id is another chain


def test_a_block_larger_than_the_budget_ends_the_chain() -> None:
    d = DeviceTree(25)
    d.use([1, 2, 3], 3, lambda a, b: [30 if i == 1 else 10 for i in range(a, b)])
    assert (1 in d, 2 in d, 3 in d) == (True, False, False) and d.nbytes == 10


class _ListLru:
    """The reference: one LRU over blocks; using ``ids[:end]`` adds the missing ones (evicting from the front,
    never the chain being used) and then moves the chain to the back, last block first."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.items = capacity, OrderedDict()

    def use(self, ids: list[int], end: int) -> None:
        for b in reversed(ids[:end]):
            if b in self.items:
                self.items.move_to_end(b)
        for b in ids[:end]:
            if b not in self.items:
                while len(self.items) * 10 + 10 > self.capacity:
                    victim = next(k for k in self.items if k not in ids[:end])
                    del self.items[victim]
                self.items[b] = 10
        for b in reversed(ids[:end]):
            self.items.move_to_end(b)


def _chains(rng: random.Random, n: int) -> list[list[int]]:
    """Chained ids that branch: each new chain keeps a prefix of an earlier one (a shared system prompt, a
    sub-agent forking off its session) and continues with ids of its own."""
    chains, fresh = [], iter(range(1, 10**6))
    for _ in range(n):
        keep = rng.choice(chains)[: rng.randint(0, 12)] if chains and rng.random() < 0.7 else []
        chains.append(keep + [next(fresh) for _ in range(rng.randint(1, 25))])
    return chains


@pytest.mark.parametrize("seed", range(12))
def test_the_same_blocks_as_a_per_block_lru_freeing_chains_tail_first(seed: int) -> None:
    rng = random.Random(seed)
    chains = _chains(rng, 10)
    every = {b for c in chains for b in c}
    tree, ref = DeviceTree(400), _ListLru(400)
    for step in range(400):
        chain = rng.choice(chains)
        end = rng.randint(1, len(chain))
        tree.use(chain, end, _ten)
        ref.use(chain, end)
        assert {b for b in every if b in tree} == set(ref.items), step
        assert tree.nbytes == 10 * len(ref.items) == 10 * len(tree)
