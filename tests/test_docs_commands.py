"""Every ```bash block of README.md and docs/*.md runs as written.

The rule, in full:

- A block is a fenced code block whose info string is ``bash``, ``sh`` or ``shell``. Other
  fences (plain ```, ```python, ```text) are not commands and are not run.
- Markers are HTML comments on the lines right above the opening fence (blank lines between
  are allowed; they are invisible in rendered Markdown):
  ``<!-- no-test: REASON -->`` -- not run here (GPU- or cluster-only, or it runs this test
  suite); the case is reported as skipped with REASON.
  ``<!-- test-env: NAME=VALUE NAME2=VALUE2 -->`` -- environment for that block only, for tiny
  sizes (``DEMO_ITERS=4``).
- A line that runs the test suite itself (``make test``, ``pytest``) is never run here: it
  would start this test again. The rest of its block runs (the README's first block: ``make
  demo`` runs, ``make test`` does not); a block of nothing else is skipped.
- Each block is one test case, run by ``bash -eo pipefail`` with a 120 s limit, in document
  order (README.md, then docs/*.md by name), in one shared workspace: a temporary folder with
  the repository's top-level entries linked in, as a fresh clone after ``make setup`` has them
  (so the ``demo_data`` that the README's ``make demo`` builds serves the blocks after it, and
  outputs such as ``runs/`` and ``profiles/`` stay out of the repository). ``PATH`` has the
  running interpreter's folder (the venv's ``bin``) first, so ``python`` and ``torchrun`` are the
  venv's.

Switch: the commands run by default (``RUN_BY_DEFAULT``); ``MEGATRON_2BW_DOCS_TEST=0`` turns them
off, ``=1`` on. The extraction tests at the end always run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

RUN_BY_DEFAULT = True
ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 120
LANGS = ("bash", "sh", "shell")
SUITE = re.compile(r"(^|[\s;&|(])(make\s+test\b|pytest\b|python\s+-m\s+pytest\b)")
MARKER = re.compile(r"^\s*<!--\s*(no-test|test-env)\s*:\s*(.*?)\s*-->\s*$")
LOOKS_LIKE_MARKER = re.compile(r"^\s*<!--\s*(no-test|test-\w+)")  # a comment line, not prose quoting one
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^`\s]*)")
# The workspace does not link these: outputs of the commands, what must not be shared, and what a
# fresh clone does not have (``demo_data`` is built by the README's first command).
NOT_LINKED = {".git", ".pytest_cache", "runs", "profiles", "checkpoints", "build", "demo_data"}
BASE_ENV = {"OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1"}


@dataclass
class DocBlock:
    file: str  # relative to the repository
    line: int  # 1-based line of the opening fence
    code: str
    skip: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


def _markers(lines: list[str], fence_index: int, where: str) -> tuple[str | None, dict[str, str]]:
    """The no-test reason and test-env of the comment lines right above ``lines[fence_index]``."""
    skip, env, i = None, {}, fence_index - 1
    while i >= 0 and (not lines[i].strip() or MARKER.match(lines[i])):
        m = MARKER.match(lines[i])
        if m and m.group(1) == "no-test":
            if not m.group(2):
                raise ValueError(f"{where}: <!-- no-test: REASON --> needs a reason")
            skip = m.group(2)
        elif m:
            for pair in m.group(2).split():
                name, eq, value = pair.partition("=")
                if not eq or not re.fullmatch(r"[A-Za-z_]\w*", name):
                    raise ValueError(f"{where}: test-env takes NAME=VALUE pairs, got {pair!r}")
                env[name] = value
        i -= 1
    return skip, env


def extract_blocks(text: str, file: str) -> list[DocBlock]:
    """The shell blocks of one Markdown text, with their markers (see the module docstring)."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if LOOKS_LIKE_MARKER.search(lines[i]) and not MARKER.match(lines[i]):
                raise ValueError(f"{file}:{i + 1}: malformed marker {lines[i].strip()!r}")
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3).lower()
        start, body, i = i, [], i + 1
        while i < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[i]):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1
        if lang in LANGS:
            skip, env = _markers(lines, start, f"{file}:{start + 1}")
            kept = [line for line in body if not SUITE.search(line)]  # a suite line would start this test again
            code = "\n".join(kept if "".join(kept).strip() else body) + "\n"
            if skip is None and not "".join(kept).strip():
                skip = "runs the test suite (this test included): mark it <!-- no-test: ... -->"
            blocks.append(DocBlock(file, start + 1, code, skip, env))
    return blocks


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def all_blocks() -> list[DocBlock]:
    out = []
    for path in doc_files():
        out += extract_blocks(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    return out


def enabled() -> bool:
    flag = os.environ.get("MEGATRON_2BW_DOCS_TEST")
    return RUN_BY_DEFAULT if flag is None else flag == "1"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    ws = tmp_path_factory.mktemp("docs_workspace")
    for entry in ROOT.iterdir():
        if entry.name not in NOT_LINKED and not entry.name.endswith(".egg-info"):
            (ws / entry.name).symlink_to(entry)
    return ws


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), including those in sessions of their own (torchrun's workers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _kill_tree(pid: int) -> None:
    for p in [pid, *_descendants(pid)]:  # collected before any dies, so orphans are not missed
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_block(block: DocBlock, cwd: Path, timeout: float = TIMEOUT_S) -> tuple[int | None, str]:
    """(exit status or None on timeout, combined output); on timeout every process it started dies."""
    env = dict(os.environ, **BASE_ENV, **block.env)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    proc = subprocess.Popen(["bash", "-eo", "pipefail", "-c", block.code], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a process we could not see still holds the pipe
            proc.stdout.close()
            out = ""
        return None, out


def _params():
    marks = [] if enabled() else [pytest.mark.skip(reason="docs commands are off (MEGATRON_2BW_DOCS_TEST=0)")]
    for b in all_blocks():
        extra = [pytest.mark.skip(reason=f"no-test: {b.skip}")] if b.skip else []
        yield pytest.param(b, id=b.id, marks=marks + extra)


@pytest.mark.parametrize("block", list(_params()))
def test_doc_block_runs(block: DocBlock, workspace: Path):
    code, out = run_block(block, workspace)
    status = f"timed out after {TIMEOUT_S} s" if code is None else f"exit status {code}"
    assert code == 0, f"{block.id}: {status}\n--- block ---\n{block.code}--- last output ---\n{out[-3000:]}"


# --------------------------------------------------------------------------- the extraction itself
SAMPLE = """# Title

```bash
echo one
```

<!-- no-test: needs 8 GPUs -->
```bash
srun -N2 python x.py
```

<!-- test-env: DEMO_ITERS=4 DEMO_SEQ=16 -->

```sh
make demo
```

```python
print("not a command")
```

```
plain fence, not run
```

- a list item:
  ```bash
  echo indented
  ```

```bash
make test
```
"""


def test_extraction_rule():
    blocks = extract_blocks(SAMPLE, "X.md")
    assert [(b.line, b.code, b.skip, b.env) for b in blocks] == [
        (3, "echo one\n", None, {}),
        (8, "srun -N2 python x.py\n", "needs 8 GPUs", {}),
        (14, "make demo\n", None, {"DEMO_ITERS": "4", "DEMO_SEQ": "16"}),
        (27, "echo indented\n", None, {}),
        (31, "make test\n", blocks[-1].skip, {}),
    ]
    assert blocks[-1].skip.startswith("runs the test suite")


def test_suite_lines_are_dropped_from_a_mixed_block():
    (block,) = extract_blocks("<!-- test-env: DEMO_ITERS=4 -->\n```bash\nmake demo\nmake test\n```\n", "R.md")
    assert (block.code, block.skip, block.env) == ("make demo\n", None, {"DEMO_ITERS": "4"})


@pytest.mark.parametrize("bad", ["<!-- no-test -->\n```bash\nx\n```\n", "<!-- no-test:  -->\n```bash\nx\n```\n",
                                 "<!-- test-env: 4 -->\n```bash\nx\n```\n", "<!-- test-timeout: 5 -->\n"])
def test_malformed_markers_are_errors(bad):
    with pytest.raises(ValueError):
        extract_blocks(bad, "X.md")


def test_prose_may_quote_a_marker():
    text = "Mark it `<!-- no-test: reason -->` above the fence.\n\n```bash\necho hi\n```\n"
    assert [(b.line, b.code, b.skip) for b in extract_blocks(text, "X.md")] == [(3, "echo hi\n", None)]


def test_the_docs_parse_and_a_block_runs_in_the_workspace(workspace: Path):
    blocks = all_blocks()  # raises on a malformed marker in README.md or docs/*.md
    assert {b.file for b in blocks} <= {str(p.relative_to(ROOT)) for p in doc_files()}
    code, out = run_block(DocBlock("X.md", 1, 'python -c "import sys; print(sys.prefix)"\ntest -e pretrain_gpt.py\n'),
                          workspace)
    assert code == 0 and out.strip() == sys.prefix
    code, _ = run_block(DocBlock("X.md", 1, "false\necho after\n"), workspace)
    assert code == 1
    # On timeout everything dies, also a child in its own session that holds the output pipe.
    spawn = ("python -c \"import subprocess; p = subprocess.Popen(['sleep', '60'], start_new_session=True); "
             "print(p.pid, flush=True); p.wait()\"\n")
    t0 = time.monotonic()
    code, out = run_block(DocBlock("X.md", 1, spawn), workspace, timeout=3)
    assert code is None and time.monotonic() - t0 < 12
    pid = int(out.split()[0])
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
