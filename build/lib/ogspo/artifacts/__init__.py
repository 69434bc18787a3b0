"""Torch-free file formats: one reader and one writer per format, each owning its schema version.

Nothing here imports torch (a test imports every module with torch made unimportable): the offline
solvers, the report and any analysis can read and write every artifact without the engine.
"""
