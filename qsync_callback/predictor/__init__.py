"""Data-flow graph, replay, memory liveness and per-op statistics over normalized traces."""
