"""Horovod + TensorFlow integration: ``Recorder`` and ``@profile`` (``patch_horovod`` for dPRO-style
scripts that write ``hvd.Recorder`` and ``@hvd.profile``; ``record_horovod_timeline`` before
``hvd.init()`` to record Horovod's timeline too)."""

from qsync_callback.integrations.horovod_tf.fusion import record_horovod_timeline
from qsync_callback.integrations.horovod_tf.recorder import Recorder, patch_horovod, profile

__all__ = ["Recorder", "patch_horovod", "profile", "record_horovod_timeline"]
