"""`huge_page_zeros`: zeroed CPU tensors whose whole 2 MiB runs lie on transparent huge pages."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from kvdiet.formats.codec import CacheCodecs
from kvdiet.model.huge_pages import HUGE_PAGE, huge_page_zeros
from kvdiet.model.paged_pool import DevicePool


def _vm_flags_at(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (``hg``: advised MADV_HUGEPAGE)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.float8_e4m3fn])
def test_a_large_tensor_is_zeros_of_its_shape_on_a_huge_page_boundary(dtype: torch.dtype) -> None:
    shape = (3, HUGE_PAGE // 2 + 8)  # 1.5 whole huge pages' bytes and more for every dtype here
    t = huge_page_zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert t.data_ptr() % HUGE_PAGE == 0
    assert not t.view(torch.uint8).any()
    t.view(torch.uint8).fill_(7)  # writable over its whole length
    assert int(t.view(torch.uint8).sum()) == 7 * t.numel() * t.element_size()


def test_a_small_tensor_is_plain_zeros_and_a_bad_shape_is_refused() -> None:
    small = huge_page_zeros((4, 8), torch.float32)
    assert torch.equal(small, torch.zeros(4, 8))
    assert huge_page_zeros((0, 1 << 22), torch.float32).shape == (0, 1 << 22)
    with pytest.raises(ValueError, match=r"no negative dimension, got \(-1, 4\)"):
        huge_page_zeros((-1, 4), torch.float32)


def test_a_view_keeps_the_mapping_alive() -> None:
    view = huge_page_zeros((8 << 20,), torch.uint8)[1 << 20 : 2 << 20]
    gc.collect()
    view.fill_(3)
    assert int(view.sum()) == 3 << 20


@pytest.mark.skipif(
    not (Path("/proc/self/smaps").is_file() and Path("/sys/kernel/mm/transparent_hugepage").is_dir()),
    reason="a kernel without /proc smaps or transparent huge pages",
)
def test_whole_runs_are_advised_for_huge_pages_and_the_tail_is_not() -> None:
    """The kernel's advice flag (``hg`` in smaps' VmFlags), set whatever huge pages it has free: on the whole 2 MiB
    runs, not on the tail past them (a huge page there would commit memory the tensor does not hold)."""
    t = huge_page_zeros((16 * HUGE_PAGE + 4096,), torch.uint8)
    assert "hg" in _vm_flags_at(t.data_ptr())
    assert "hg" in _vm_flags_at(t.data_ptr() + 16 * HUGE_PAGE - 1)
    assert "hg" not in _vm_flags_at(t.data_ptr() + 16 * HUGE_PAGE)


def test_a_cpu_pool_lies_on_huge_pages_and_grows_with_its_contents() -> None:
    codecs = CacheCodecs.for_dims(512, 128)
    pool = DevicePool({0: 1, 1: 2}, codecs, num_blocks=4096, block_size=64)
    pages = pool.pages()
    big = [t for t in pages.values() if t.numel() * t.element_size() >= HUGE_PAGE]
    assert big and all(t.data_ptr() % HUGE_PAGE == 0 for t in big)
    assert all(not t.any() for t in pages.values())
    block = pool.allocate(1)[0]
    for t in pages.values():
        t[block].fill_(5)
    before = pool.read_block(block)
    pool.allocate(pool.blocks.num_free + 1)  # past the free blocks: the pool grows
    assert pool.num_blocks > 4096
    assert pool.read_block(block) == before
    assert all(not t[4096:].any() for t in pool.pages().values())
