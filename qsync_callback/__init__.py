"""qsync-callback: record a few steps of a real training run, predict step time and peak memory,
and plan precision, fusion and activation memory.

``QSyncCallback`` (PyTorch Lightning) is imported lazily so that the core needs only numpy and
networkx.
"""

__version__ = "0.1.0"

__all__ = ["QSyncCallback", "__version__"]


def __getattr__(name: str):
    if name == "QSyncCallback":
        from qsync_callback.integrations.lightning import QSyncCallback

        return QSyncCallback
    raise AttributeError(f"module 'qsync_callback' has no attribute {name!r}")
