"""Giving freed host memory back to the operating system.

glibc's malloc serves tensors below its mmap threshold from the heap, and that threshold rises
with every large block freed (up to 32 MiB), so after a step most activations, logits and
gradients live in the heap. Freed heap memory stays resident until ``malloc_trim``: on the
~125M llama of ``bench/train_step`` at tp=2 that is ~400 MiB per rank carried from one step
into the next, on top of the live tensors. ``release_free_host_memory()`` trims every arena
(pages of free chunks are returned with ``MADV_DONTNEED``; the chunks stay in the free lists,
so later allocations reuse the addresses and only fault the pages back in)."""

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim`` or None (musl, macOS: no such call, nothing to do)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_host_memory() -> bool:
    """Return the free pages of the C heap to the OS; True when glibc released any."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
