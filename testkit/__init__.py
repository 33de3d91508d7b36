"""Support code that the tests (tests/) and the benchmarks (bench/) share: tiny training artifacts, multi-process
training runs and their checks, the fault scenarios of a multi-node run, mtpipe's decoders called with a decode
section or keywords. Not part of mtpipe (nothing in mtpipe/ imports it), and neither a test nor a benchmark: tests/
and bench/ both import it, and never each other."""
