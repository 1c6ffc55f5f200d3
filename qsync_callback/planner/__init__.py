"""Planners: search over Plans with the predictor as the judge (precision allocation)."""
