"""What people see of a swarm: the snapshot model, the terminal view, the web page, metrics and plots."""
