"""`python -m nimblejax.bench` (console script `nimblejax-bench`)."""
from __future__ import annotations

import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    from nimblejax.bench.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
