"""The row formats' vocabulary, at the bottom of the package beside `engram.config` and `engram.kernels`.

`fp8`: V4.1's FP8 e4m3 rows with one ue8m0 scale per 32 values: block size, dtypes, bytes per row,
the (values, scales) and row-id checks, the ue8m0 rule. It imports torch alone, so both the kernels
(`engram.kernels`) and the storage layer above them (`engram.storage`: quantiser, gathers, row files)
speak it without importing each other. Design: docs/storage.md.
"""
