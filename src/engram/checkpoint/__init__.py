"""engram.checkpoint.v41."""
