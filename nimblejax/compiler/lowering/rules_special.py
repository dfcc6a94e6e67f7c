"""Special functions (digamma, igamma, igammac, betainc, bessel_i0e/i1e) and mulhi."""
from __future__ import annotations
