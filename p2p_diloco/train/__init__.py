"""The inner learner's pieces: the byte-level GPT, the corpus and its deterministic shards."""
