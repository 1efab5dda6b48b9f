"""In-process swarms on a simulated clock, and their baselines."""
