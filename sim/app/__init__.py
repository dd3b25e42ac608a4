"""The application layer: the commands, and what they need beyond the simulator (safe outputs)."""
