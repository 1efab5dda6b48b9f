"""Admission: who may talk to this peer and how much of its time a remote may take (policy, guard)."""
