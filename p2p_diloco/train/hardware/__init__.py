"""What a learner unit runs on: the device, precision and micro-batching, and units of several processes."""
