"""The inner learner: its steps, the round loop and its exchange; models, data, hardware and state by job."""
