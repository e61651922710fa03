"""S2D in the lab: training data, SoFT training, threshold tuning, reports."""
