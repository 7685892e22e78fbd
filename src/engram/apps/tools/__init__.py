"""Tools the CLI runs that are neither training nor studies: `bench` (`engram bench`: every benchmark
under benchmarks/, one table) and `run_layer` (`engram run-layer`: one V4.1 Engram layer from a
checkpoint on given text).
"""
