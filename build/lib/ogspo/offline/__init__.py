"""Offline solvers on records and latency models: numpy, polars and SCIP (pyscipopt), no torch."""
