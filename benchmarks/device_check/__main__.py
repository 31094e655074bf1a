"""``python benchmarks/device_check [OPTIONS]``: the prepared device check (docs/device-check.md)."""

import sys
from pathlib import Path

# Run as a directory, Python puts this package's own directory first on the path: put the
# benchmarks directory there instead, where ``device_check`` and the benchmarks it uses
# (``minimal``, ``bench_matmul``, ``checkpoint_commit``) are found by their names.
_HERE = Path(__file__).resolve().parent
if sys.path and Path(sys.path[0] or ".").resolve() == _HERE:
    sys.path.pop(0)
sys.path.insert(0, str(_HERE.parent))

from device_check.cli import main  # noqa: E402

sys.exit(main())
