"""What the examples that check themselves share: their report, and Lightning kept quiet.

An example's ``run`` returns a dict with ``"checks"`` (name -> passed) and
whatever the tests read; :func:`report` prints the checks, writes the dict as
JSON when asked (the tests in ``tests/test_integrations.py`` read it) and
gives the exit status.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def report(out: dict[str, Any], json_path: Path | None, header: str) -> int:
    """Print ``header`` and each check; write ``out`` to ``json_path``; 0 when every check passed, else 1."""
    print(header)
    for name, ok in out["checks"].items():
        print(f"[{'ok' if ok else 'FAIL'}] {name}")
    if json_path is not None:
        json_path.write_text(json.dumps(out))
    return 0 if all(out["checks"].values()) else 1


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Lightning's info logs and the warnings these small CPU runs raise, left out."""
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*LeafSpec.*is deprecated.*")  # Lightning 2.6 on torch 2.14
        yield
