"""Checkpoint files: the schema, plain and sharded state, the runtime's saves."""
