"""The error that says the engine cannot go on: its device, a rank or its state is gone.

It lives in the worker layer, where such failures surface (a lost rank, a device error inside the model run), so
the executor raises it without importing the engine; the engine (``AsyncEngine``) catches it, ends every request
and dies, and fault injection (``engine/faults.py``) raises it to test that path.
"""
from __future__ import annotations


class FatalEngineError(RuntimeError):
    """The engine cannot go on (its device or state is gone): every request ends and the model goes not ready."""
