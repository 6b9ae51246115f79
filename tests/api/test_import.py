"""The API process never loads torch or worker code (imports go api -> jobs only)."""

from __future__ import annotations

import subprocess
import sys


def test_api_main_does_not_import_torch_or_worker() -> None:
    code = (
        "import sys\n"
        "import api.main, jobs.intake, jobs.queue, jobs.repository\n"
        "api.main.create_app()\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'worker', 'kernels', 'transformers'))\n"
        "print(loaded)\n"
        "sys.exit(1 if loaded else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, f"api loaded {result.stdout.strip()} {result.stderr[-2000:]}"
