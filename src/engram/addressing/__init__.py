"""Addressing: tokenizer ids -> table rows (layout, compression, hashing, decode-time stream).

Design: docs/addressing.md.
"""
