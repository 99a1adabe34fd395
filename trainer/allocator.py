"""glibc's allocator, set to keep the memory a CPU round frees for the next step.

By default glibc serves each allocation of 128 KB or more (a threshold it raises as large blocks are freed) with
its own `mmap` and gives it back on free, and returns free memory at the top of its heap once it exceeds twice
that threshold. A decoding step allocates and frees tens of such tensors (a 64-row step's logits are 12.6 MB), so
each step faulted its pages in afresh: on 2 cores keeping them made a SmolLM2-135M round's sampling 1.05-1.24x
as fast (docs/bench/speed.md, "Sampling on the CPU"). Serving blocks below 32 MB from the heap and trimming it only
past 2 GB lets them be reused. Torch's CUDA allocator caches on its own; elsewhere (macOS, musl) this does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import platform

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt's parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest on 64-bit systems
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int


_kept = False  # keep_freed_memory took effect: the heap holds what rounds free until give_back_freed_memory


def keep_freed_memory() -> bool:
    """Sets glibc's mmap and trim thresholds for this process; whether it did (False off glibc)."""
    global _kept
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the process's own symbols, glibc's among them
    _kept = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not _kept:
        log.warning("allocator: glibc refused the mmap and trim thresholds; each CPU step will fault its memory in afresh")
    return _kept


def give_back_freed_memory() -> bool:
    """Returns the heap's free pages to the system (glibc's `malloc_trim`) where `keep_freed_memory` holds them;
    whether it did. Kept, what sampling freed (its KV cache; the many rows of an evaluation) stays resident in pieces
    the training step cannot all reuse, and the process grows past what it holds: a Gemma 3 270M node's trained rounds
    rose from 9.5 to 11.7 GB in 40 rounds, past its plan's 10.6 (docs/bench/step-size-80-2cpu, gemma-adapt seed 0);
    given back before every step, the same model's rounds stayed at 6.9-10.4 GB over 80 (gemma-fixed seed 0). Giving
    back costs the next step the faults of its pages: 294,000 more on SmolLM2-135M, 0.78 s of a 10.8 s step
    (docs/bench/heap-step-smollm2-135m-2cpu.json). So a node gives back after each evaluation, and before each step
    only once it went past its plan (node/pressure.py)."""
    if not _kept:
        return False
    return bool(ctypes.CDLL(None).malloc_trim(0))
