"""Settings for the whole suite, made before any test module imports TensorFlow."""

import os

# Unset, TF decides by the CPU whether to run with oneDNN (on a CPU without AVX-512 it did not);
# without it TF's CPU allocator keeps no statistics (`recorder/tf_memory.py`), which the TF memory
# tests read. The test of the path without oneDNN sets 0 in its own child process.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
