"""Packaging invariants that other tools depend on."""
from __future__ import annotations


def test_our_kernels_package_does_not_look_like_hf_kernels():
    # transformers probes for Hugging Face's kernel-hub library under the same import name `kernels`;
    # if the probe says yes, transformers tries to use it and the oracle runs break.
    import kernels  # noqa: F401  (ours is importable ...)
    from transformers.utils.import_utils import is_kernels_available
    assert not is_kernels_available()  # (... but is not mistaken for the hub library)
