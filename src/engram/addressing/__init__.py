"""engram.addressing."""
