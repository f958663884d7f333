"""``python -m sparkgpu.cli``: the same command line as the ``sparkgpu`` console script."""

from __future__ import annotations

import sys

from sparkgpu.cli import main

sys.exit(main())
