"""Write a few MB of real English text that every machine with Python already has.

The text is the docstrings of the standard library (module, class and function docstrings,
found with ``ast``) and its long prose string literals (``pydoc_data`` holds the language
reference), filtered to English prose paragraphs: one document per module (long ones cut at
~8 KB), one ``{"text": ...}`` JSON object per line. No download is needed and files are
visited in sorted order, so the same Python gives the same corpus byte for byte. CPython 3.11
yields about 1.9 MB in all; ``--max-mb`` only caps it.

    python tools/build_demo_corpus.py --output data/corpus.jsonl --max-mb 4
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import sys
import sysconfig
from collections import deque
from typing import Iterator

from megatron_2bw.cli import OneLineParser, run_cli
from megatron_2bw.errors import ConfigError
from megatron_2bw.export.outputs import check_files

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings", "lib2to3"}
MIN_CHARS = 40
LONG_LITERAL = 200
DOC_CHARS = 8000


def stdlib_sources(root: str) -> Iterator[str]:
    """``.py`` files under ``root`` in sorted order, skipping tests and installed packages."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith(("test_", ".")))
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("test_"):
                yield os.path.join(dirpath, name)


def _is_prose(text: str, min_ratio: float = 0.75) -> bool:
    """Mostly letters and spaces, nearly all ASCII: drops tables, escapes and non-English text."""
    if len(text) < MIN_CHARS or sum(not c.isascii() for c in text) > 0.02 * len(text):
        return False
    letters = sum(c.isalpha() or c == " " for c in text)
    return letters / len(text) > min_ratio


def clean_docstring(doc: str) -> str:
    """Reflow prose paragraphs onto one line each; drop doctests and code blocks.

    An indented paragraph is usually code, so it is kept only when it reads as a sentence.
    """
    paragraphs = []
    for block in re.split(r"\n\s*\n", doc):
        lines = block.split("\n")
        if any(line.lstrip().startswith((">>>", "...")) for line in lines):
            continue
        para = re.sub(r"\s+", " ", block).strip()
        indented = lines[0].startswith((" ", "\t"))
        if _is_prose(para, 0.85 if indented else 0.75) and (not indented or para.endswith(".")):
            paragraphs.append(para)
    return "\n".join(paragraphs)


def module_document(path: str) -> str:
    """One module's docstrings and long prose string constants, in source order."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, ValueError, UnicodeDecodeError, OSError):
        return ""
    docs = (clean_docstring(inspect.cleandoc(n.value)) for n in _prose_literals(tree))
    return "\n".join(d for d in docs if d)


def _prose_literals(tree: ast.AST) -> list[ast.Constant]:
    """The docstrings (module, class, function) and the other string constants of at least LONG_LITERAL
    characters (pydoc_data/topics.py is the language reference), in source order (ties in ``ast.walk``'s order).
    One breadth-first walk by hand, ``ast.walk``'s order without its generators (which cost more than the parse):
    a definition is met before the docstring it holds."""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docstrings: set[int] = set()
    found, queue = [], deque([tree])
    while queue:
        node = queue.popleft()
        if isinstance(node, ast.Constant):
            if isinstance(node.value, str) and (id(node) in docstrings or len(node.value) >= LONG_LITERAL):
                found.append(node)
            continue
        if isinstance(node, kinds) and node.body and isinstance(node.body[0], ast.Expr):
            docstrings.add(id(node.body[0].value))
        for name in node._fields:
            value = getattr(node, name, None)
            if isinstance(value, list):
                queue.extend(v for v in value if isinstance(v, ast.AST))
            elif isinstance(value, ast.AST):
                queue.append(value)
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


def split_document(text: str, max_chars: int = DOC_CHARS) -> list[str]:
    """Cut a module's text at paragraph boundaries into documents of about ``max_chars``.

    A few modules (pydoc_data's language reference) are hundreds of KB; as single documents
    they would make the document-level train/valid/test split lopsided.
    """
    docs: list[str] = []
    current: list[str] = []
    size = 0
    for para in text.split("\n") if text else []:
        if current and size + len(para) > max_chars:
            docs.append("\n".join(current))
            current, size = [], 0
        current.append(para)
        size += len(para) + 1
    if current:
        docs.append("\n".join(current))
    return docs


def build_corpus(output: str, max_mb: float, root: str | None = None) -> tuple[int, int]:
    """Write documents until the next one would pass ``max_mb``; return (documents, bytes)."""
    root = root or sysconfig.get_paths()["stdlib"]
    limit = int(max_mb * 1_000_000)
    ndocs = nbytes = 0
    tmp = f"{output}.tmp.{os.getpid()}"  # written under a temporary name, renamed when complete
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            for text in (t for path in stdlib_sources(root) for t in split_document(module_document(path))):
                line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
                size = len(line.encode("utf-8"))
                if nbytes + size > limit:
                    break
                out.write(line)
                ndocs += 1
                nbytes += size
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return ndocs, nbytes


def is_own_corpus(path: str, root: str | None = None) -> bool:
    """Whether ``path`` is an earlier output of this tool: its first line is the first document it writes (a
    corpus of the user's own is never taken for one)."""
    root = root or sysconfig.get_paths()["stdlib"]
    docs = (t for p in stdlib_sources(root) for t in split_document(module_document(p)))
    first = json.dumps({"text": next(docs, "")}, ensure_ascii=False)
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().rstrip("\n") == first
    except (OSError, UnicodeDecodeError):
        return False


def run(argv: list[str]) -> str:
    """Build the corpus from the command line; return the line saying what was written."""
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="JSONL file to write")
    parser.add_argument("--max-mb", type=float, default=4.0, help="stop before the corpus passes this size (MB)")
    parser.add_argument("--overwrite", action="store_true", help="replace an --output that this tool did not write")
    args = parser.parse_args(argv)
    if args.max_mb <= 0:
        raise ConfigError(f"--max-mb must be positive, got {args.max_mb}")
    check_files([args.output], overwrite=args.overwrite, flag="--output", is_own=lambda: is_own_corpus(args.output),
                tool="build_demo_corpus.py")
    try:
        ndocs, nbytes = build_corpus(args.output, args.max_mb)
    except OSError as e:
        raise ConfigError(f"cannot write --output {args.output}: {e.strerror or e}") from None
    return f"wrote {ndocs} documents, {nbytes / 1e6:.2f} MB to {args.output}"


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
