"""Settings for the whole suite, made before any test module imports TensorFlow."""

import os

# TF runs with oneDNN by itself only on CPUs with AVX-512 VNNI or BF16 or AMX; without it TF's CPU
# allocator keeps no statistics (`recorder/tf_memory.py`), which the TF memory tests read. The test
# of the path without oneDNN sets 0 in its own child process.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
