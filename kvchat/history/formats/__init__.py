"""History importers, one module per file format, each turning a parsed file into `Turn`s.

`kvchat.history.loading` reads the file once, detects its format and calls the importer; `common` holds what they
share (the `Turn`, the limits, refusals that name every format).
"""
