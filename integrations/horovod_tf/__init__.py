"""Horovod + TensorFlow integration: ``Recorder`` and ``@profile`` (``patch_horovod`` for dPRO-style
scripts that write ``hvd.Recorder`` and ``@hvd.profile``)."""

from qsync_callback.integrations.horovod_tf.recorder import Recorder, patch_horovod, profile

__all__ = ["Recorder", "patch_horovod", "profile"]
