"""Storage: the FP8 row format, its quantiser and the row gathers.

Design: docs/storage.md.
"""
