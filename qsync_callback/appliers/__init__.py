"""Appliers: each carries out one kind of a Plan's decisions on a live model and returns an undo
(`qsync_callback.tuning_loop.Applier`)."""
