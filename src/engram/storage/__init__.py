"""engram.storage."""
