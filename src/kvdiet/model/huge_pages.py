"""Host memory on transparent huge pages: `huge_page_zeros`, for the tensors a decode step streams through (the
packed weights of `kvdiet.model.weight_arena`, the paged device pool's pages on the CPU).

A decode step reads its weights and the packed KV it selects cold from DRAM. In 4 KiB pages a 1M-token step's
few hundred MB take some 10⁵ page walks, and the hardware prefetchers stop at each 4 KiB page's end; on 2 MiB
pages one TLB entry covers 512 of them. torch's allocator leaves the page size to the kernel, which (with
``/sys/kernel/mm/transparent_hugepage/enabled`` at ``madvise``, a common default) gives huge pages only to a
mapping that asks. Here each tensor is one private anonymous mapping, advised ``MADV_HUGEPAGE`` before it is
first touched, its start on a 2 MiB boundary. Measured on v4.1-mini (``benchmarks/bench_layout.py``, 2 cores, the
same model on torch's allocations in the same process): the packed weights 0.70–0.85 ms of an 18–20 ms step at 4K
and 0.74–1.05 ms of 25–26 ms at 1M; the pool's pages a further 0.2–0.3 ms at 1M (nothing at 4K).

The kernel may still serve 4 KiB pages (transparent huge pages off, or no free 2 MiB page): the tensor is the
same, only slower to read.
"""

from __future__ import annotations

import contextlib
import math
import mmap

import torch

__all__ = ["HUGE_PAGE", "huge_page_mapping", "huge_page_zeros"]

HUGE_PAGE = 2 << 20  # bytes: a transparent huge page on x86-64 and arm64 (4 KiB base pages)


def huge_page_mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """A zero-filled private anonymous mapping holding ``nbytes`` bytes from offset ``start`` on (returned with it),
    ``start`` on a 2 MiB boundary and the whole 2 MiB runs from there advised ``MADV_HUGEPAGE`` (module docstring);
    under 2 MiB, a plain mapping from offset 0 (page-aligned). Tensors over it (``torch.frombuffer``) keep it alive.

    Raises:
        ValueError: ``nbytes`` < 1.
    """
    if nbytes < 1:
        raise ValueError(f"a mapping holds at least one byte, got {nbytes}")
    if nbytes < HUGE_PAGE:
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), 0
    # private: a shared anonymous mapping is shmem, whose huge pages another setting (shmem_enabled) governs;
    # one huge page more than asked, so the bytes can start on a huge-page boundary wherever the mapping lies
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    # no madvise (not Linux) or no transparent huge pages in the kernel: the mapping as it is
    with contextlib.suppress(AttributeError, OSError):
        mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    return mapping, start


def huge_page_zeros(
    shape: tuple[int, ...] | list[int], dtype: torch.dtype, *, touch: bool = True
) -> torch.Tensor:
    """A zero-filled contiguous CPU tensor of ``shape`` and ``dtype`` whose whole 2 MiB runs lie on huge pages
    (module docstring): its own mapping, the tensor starting on a 2 MiB boundary; the tail past the last whole
    2 MiB stays on 4 KiB pages, so no more memory is committed than the tensor holds. A tensor under 2 MiB is a
    plain ``torch.zeros`` (no huge page to gain, and a mapping each would add up). ``touch``: write every page
    now, so the memory is committed here and a later first read takes no page fault (as ``torch.zeros`` commits
    it); False leaves pages to be faulted in as they are first written (a caller that writes every byte at once,
    as `kvdiet.model.weight_arena` does).

    The mapping lives as long as any view of the tensor. Where ``madvise`` is not available (not Linux) the
    mapping is used as it is.

    Raises:
        ValueError: a negative dimension.
    """
    if any(d < 0 for d in shape):
        raise ValueError(f"a tensor shape has no negative dimension, got {tuple(shape)}")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE:
        return torch.zeros(tuple(shape), dtype=dtype, device="cpu")
    mapping, start = huge_page_mapping(nbytes)
    out = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=start)
    if touch:
        out.zero_()  # the mapping's pages are zeros already: this only commits them
    return out.view(dtype).view(tuple(shape))
