"""Dissemination: gossip of signed outer updates, equivocation evidence, and lost-update repair."""
