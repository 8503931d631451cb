"""The tests' one comparison of a result with its reference, and of an error
with the words its message must hold (``assert_error_names``).

Two rules, chosen by how the tolerance is given:

* ``tol``: the largest difference relative to the reference's largest
  magnitude, ``max |actual - expected| <= tol * max(max |expected|, floor)``,
  both taken in float64. Entries near zero are judged on the tensor's scale,
  where an elementwise relative rule would fail them on roundoff. 0 asks for
  equality.
* ``rtol`` and ``atol``: torch.testing.assert_close's elementwise rule
  ``|actual - expected| <= atol + rtol * |expected|``, with ``actual``
  converted to ``expected``'s dtype; both 0 ask for equality.

The files that call these keep their tolerances, and why each is what it is.
"""

from typing import Callable, Iterable, Optional

import pytest
import torch
from torch.distributed.tensor import DTensor

__all__ = ["assert_close", "assert_error_names", "mismatch"]


def mismatch(actual, expected, what, tol=None, *, floor=1e-30, rtol=None, atol=None, equal_nan=False) -> Optional[str]:
    """None when ``actual`` matches ``expected``, else a message naming ``what`` and how far apart they are.

    Give either ``tol`` (with ``floor``, the smallest magnitude a reference is
    judged against; the default only keeps an all-zero reference from dividing
    by zero) or both ``rtol`` and ``atol`` (see the module's docstring). A
    DTensor is compared unsharded: ``full_tensor()`` is a collective, so every
    rank of its mesh must call this. With ``equal_nan``, NaNs must sit at the
    same places and are otherwise left out; without it any NaN is a mismatch.
    """
    if (tol is None) == (rtol is None) or (rtol is None) != (atol is None):
        raise TypeError(f"{what}: give either tol, or rtol and atol")
    if isinstance(actual, DTensor):
        actual = actual.full_tensor()
    if isinstance(expected, DTensor):
        expected = expected.full_tensor()
    if tol is None:
        try:
            torch.testing.assert_close(actual.to(expected.dtype), expected, rtol=rtol, atol=atol, equal_nan=equal_nan)
        except AssertionError as e:
            return f"{what}: {e}"
        return None
    if actual.shape != expected.shape:
        return f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if expected.numel() == 0:
        return None
    a, e = actual.detach().double(), expected.detach().double()
    if equal_nan:
        if not torch.equal(a.isnan(), e.isnan()):
            return f"{what}: NaNs at different places: {actual} vs {expected}"
        a, e = a.nan_to_num(0.0), e.nan_to_num(0.0)
    error = ((a - e).abs().max() / e.abs().max().clamp_min(floor)).item()
    if error <= tol:  # False for a NaN error
        return None
    return f"{what}: max error {error:.3e} relative to the reference's largest magnitude exceeds {tol:g}"


def assert_close(actual, expected, what, tol=None, **kwargs) -> None:
    """:func:`mismatch` as an assertion."""
    problem = mismatch(actual, expected, what, tol, **kwargs)
    assert problem is None, problem


def assert_error_names(call: Callable[[], object], fragments: Iterable[str], error: type = RuntimeError,
                       what: str = "error") -> str:
    """``call()`` must raise ``error`` whose message holds every one of ``fragments``
    (the op, the argument, the values); returns the message."""
    with pytest.raises(error) as info:
        call()
    return assert_message_names(str(info.value), fragments, what)


def assert_message_names(message: str, fragments: Iterable[str], what: str = "error") -> str:
    """``message`` must hold every one of ``fragments``; returns it."""
    missing = [fragment for fragment in fragments if fragment not in message]
    assert not missing, f"{missing} not in {what}: {message}"
    return message
