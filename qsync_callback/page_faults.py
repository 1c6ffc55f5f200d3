"""Minor page faults of this process: the fresh pages it touched, as the kernel counts them.

On a CPU, glibc's malloc hands large blocks back to the system when they are freed and takes fresh,
zeroed pages when they are asked for again; each page's first touch is a minor fault, which the
step pays for. How many a step takes depends on the allocator's thresholds, which glibc moves with
the sizes freed before: two processes of one configuration, or one configuration run right after
another, can differ by thousands a step (the recorder's figures and the turns' say so)."""

from __future__ import annotations

try:
    import resource
except ImportError:  # not on Windows
    resource = None


def minor_page_faults() -> int:
    """Minor page faults of this process so far (0 where the platform does not count them)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0
