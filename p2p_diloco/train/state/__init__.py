"""What survives a restart: checkpoints, the journal of signed updates, and the folder that holds them."""
