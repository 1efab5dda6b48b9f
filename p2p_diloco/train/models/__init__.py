"""The model a run trains: the built-in GPT or a Hugging Face causal LM behind one interface, and its export."""
