"""Every entry point a user runs (``tools/``, ``pretrain_*.py``, ``benchmarks/``) prints its ``--help``.

argparse formats help strings with ``%``: one stray ``%`` in a help text turns ``--help`` into a
traceback. All scripts run in one subprocess (imports shared), each as ``__main__`` from its folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_DRIVER = r'''
import contextlib, io, os, runpy, sys
failed = []
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(path, run_name="__main__")
        code = "no exit"
    except SystemExit as e:
        code = e.code
    except BaseException as e:  # noqa: BLE001 - report every script, not the first
        code = f"{type(e).__name__}: {e}"
    finally:
        sys.path.pop(0)
    if code not in (0, None) or "usage:" not in out.getvalue():
        failed.append(f"{path}: {code}")
print("\n".join(failed))
sys.exit(1 if failed else 0)
'''


def _entry_points() -> list[str]:
    paths = sorted(ROOT.glob("tools/*.py")) + sorted(ROOT.glob("pretrain_*.py")) + sorted(ROOT.glob("benchmarks/*.py"))
    return [str(p.relative_to(ROOT)) for p in paths if 'if __name__ == "__main__"' in p.read_text()]


def test_every_entry_point_prints_its_help():
    scripts = _entry_points()
    assert "tools/plan.py" in scripts and "pretrain_gpt.py" in scripts and len(scripts) >= 20
    res = subprocess.run([sys.executable, "-c", _DRIVER, *scripts], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
