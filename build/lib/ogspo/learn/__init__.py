"""Torch training: the OGSPO policy head, the same-trace rounds, the router, and ONNX export."""
