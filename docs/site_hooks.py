"""MkDocs hooks for ``mkdocs.yml``: build the site from the repository's own Markdown files.

The pages link to each other and to files outside ``docs/`` (``../README.md``,
``../benchmarks/results/...``, ``../examples/...``) with paths relative to the repository, as
GitHub shows them. So the site's source is the repository's tree, reduced to what the site
shows: each of those files is linked (not copied) into a temporary folder, laid out as in the
repository, which becomes ``docs_dir``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOT_VARIABLE = "FUNCTOPK_SITE_ROOT"  # another tree to build from (tests/test_docs.py breaks a link in a copy)
# what the site shows, as paths relative to the repository (a folder brings all its files)
SOURCES = ("README.md", "tests/README.md", "docs", "benchmarks/results", "examples")
SKIP_SUFFIXES = (".py",)  # docs/gen_api.py and this file are not pages (examples/*.py are linked to)

_staged: list[str] = []


def stage(root: Path, dest: Path) -> None:
    """Link each file of ``SOURCES`` under ``root`` into ``dest`` at the same relative path."""
    for source in SOURCES:
        path = root / source
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for file in files:
            rel = file.relative_to(root)
            if rel.parts[0] == "docs" and file.suffix in SKIP_SUFFIXES:
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(file, target)


def on_config(config):
    dest = Path(tempfile.mkdtemp(prefix="functopk-site-src-"))
    _staged.append(str(dest))
    stage(Path(os.environ.get(ROOT_VARIABLE, ROOT)), dest)
    config["docs_dir"] = str(dest)
    return config


def on_post_build(config):
    while _staged:
        shutil.rmtree(_staged.pop(), ignore_errors=True)


def on_build_error(error):
    on_post_build(None)
