"""State sync: a joiner fetches a verified snapshot of (theta, V) from a donor; the donor serves it."""
