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


def keep_freed_memory() -> bool:
    """Sets glibc's mmap and trim thresholds for this process; whether it did (False off glibc)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the process's own symbols, glibc's among them
    done = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not done:
        log.warning("allocator: glibc refused the mmap and trim thresholds; each CPU step will fault its memory in afresh")
    return done
