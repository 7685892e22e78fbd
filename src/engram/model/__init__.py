"""Model: tables, the Engram module, the small LM and the sparse optimizers (single device).

Design: docs/model.md.
"""
