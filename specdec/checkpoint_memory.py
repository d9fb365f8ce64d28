"""Keep a loaded model's resident memory to its weights: no second copy in mapped checkpoint pages.

transformers memory-maps ``*.safetensors`` and leaves CPU parameters as views of the map, so every page a load
reads stays resident while one tensor still views the file (for a pre-packed float32 target, close to a second
copy of its weights). Dropping is ``madvise(MADV_DONTNEED)`` on the private file mapping, only for pages of
tensors discarded or already copied out (a page written in place would revert). No-op off Linux and for
tensor-parallel shards.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from collections.abc import Iterable

import torch

MADV_DONTNEED = 4  # <sys/mman.h>, Linux
CHECKPOINT_SUFFIXES = (".safetensors",)


def checkpoint_ranges() -> list[tuple[int, int]]:
    """[start, end) addresses of this process's mappings of checkpoint files; [] without /proc."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].strip().endswith(CHECKPOINT_SUFFIXES):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((start, end))
    except OSError:
        return []
    return ranges


def _mapping_of(tensor: torch.Tensor, ranges) -> tuple[int, int] | None:
    """The mapped checkpoint range ``tensor``'s bytes start in, or None (not a mapped CPU tensor)."""
    if type(tensor).__name__ == "DTensor" or tensor.device.type != "cpu" or tensor.numel() == 0 or tensor.is_mkldnn:
        return None
    start = tensor.data_ptr()
    return next(((lo, hi) for lo, hi in ranges if lo <= start < hi), None)


def _whole_pages(tensor: torch.Tensor, ranges) -> tuple[int, int] | None:
    """[start, end) of the whole pages that lie inside ``tensor``'s bytes in a mapped checkpoint (a
    page it shares with a neighbouring tensor is left alone), or None."""
    mapping = _mapping_of(tensor, ranges)
    if mapping is None:
        return None
    page = mmap.PAGESIZE
    start = tensor.data_ptr()
    end = min(mapping[1], start + tensor.numel() * tensor.element_size())
    first, last = -(-start // page) * page, end - end % page
    return (first, last) if first < last else None


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def drop_checkpoint_pages(tensors: Iterable[torch.Tensor], ranges=None) -> int:
    """Release the resident pages of ``tensors`` that lie in a mapped checkpoint; returns bytes advised.
    The tensors stay valid (their pages are re-read from the file if used again)."""
    ranges = checkpoint_ranges() if ranges is None else ranges
    if not ranges:
        return 0
    libc, advised = _libc(), 0
    for tensor in tensors:
        span = _whole_pages(tensor, ranges)
        if span is not None and libc.madvise(ctypes.c_void_p(span[0]), ctypes.c_size_t(span[1] - span[0]),
                                             MADV_DONTNEED) == 0:
            advised += span[1] - span[0]
    return advised


def own_weights(model: torch.nn.Module) -> int:
    """Copy every CPU parameter and buffer of ``model`` that still views a mapped checkpoint into
    process memory, then drop the resident pages of the mappings it viewed; returns the bytes copied.

    Tied parameters (one Parameter object in several modules) are copied once and stay tied."""
    ranges = checkpoint_ranges()
    if not ranges:
        return 0
    copied, viewed = 0, set()
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            mapping = _mapping_of(tensor, ranges)
            if mapping is not None:
                viewed.add(mapping)
                old = tensor.data
                tensor.data = old.clone()
                copied += old.numel() * old.element_size()
    # The mappings this model viewed: also the pages read through modules already replaced (pre-packed
    # or quantized linears), which a stale view may keep mapped until the garbage collector runs.
    _drop_ranges(viewed)
    return copied


def _drop_ranges(ranges) -> None:
    libc = _libc()
    for start, end in ranges:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)
