"""Discovery: the run's spec and one signed, expiring record per live peer on the DHT, and reading them."""
