"""engram.apps."""
