"""ogspo: tree-based speculative decoding with stop decisions taken during drafting.

`ogspo.load(model=..., drafter=..., policy=...)` is the Python API (`ogspo.api`)."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `ogspo.load` is looked up lazily (PEP 562) so that importing a torch-free layer such as
    # `ogspo.artifacts` does not import torch through this package's __init__
    if name == "load":
        from ogspo.api import load

        return load
    raise AttributeError(f"module 'ogspo' has no attribute {name!r}")
