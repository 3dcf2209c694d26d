"""The driver's side of many ranks: starting worker processes, joining the group, running steps, failing loudly."""
