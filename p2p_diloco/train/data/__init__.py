"""Training data: the byte corpus, prepared token datasets, and resolving what a run's spec names."""
