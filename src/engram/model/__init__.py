"""engram.model."""
