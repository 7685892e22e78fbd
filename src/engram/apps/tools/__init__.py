"""Tools the CLI runs that are neither training nor studies: `bench` (`engram bench`: every benchmark
under benchmarks/, one table), `run_layer` (`engram run-layer`: one V4.1 Engram layer from a
checkpoint on given text) and `quantise_check` (`engram quantise-check`: a trained model's held-out
loss and accuracy with its tables in each row format).
"""
