"""Decode-time methods: the one method registry, the state features, OGSPO's ONNX stop policy and
pre-drafting routing. Builds on the engine, the drafter and the artifacts."""
