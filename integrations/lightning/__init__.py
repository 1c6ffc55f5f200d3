"""PyTorch Lightning integration: ``QSyncCallback``."""

from qsync_callback.integrations.lightning.callback import QSyncCallback

__all__ = ["QSyncCallback"]
