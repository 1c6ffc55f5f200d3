"""Capture and normalize traces (torch.profiler; the TF profiler and Horovod timeline)."""
