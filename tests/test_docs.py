"""Documentation checks: every public name documented, API reference current, links valid."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import functopk as ft

ROOT = Path(__file__).resolve().parent.parent


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_name_has_a_docstring():
    _, missing = load_generator().render()
    assert missing == [], f"public names without a docstring: {missing}"


def test_api_reference_is_current():
    text, _ = load_generator().render()
    assert (ROOT / "docs" / "api.md").read_text() == text, "docs/api.md is stale: run `python docs/gen_api.py`"


def test_all_lists_only_existing_names_without_duplicates():
    assert len(ft.__all__) == len(set(ft.__all__))
    for name in ft.__all__:
        assert hasattr(ft, name), name


def test_relative_links_resolve():
    broken = []
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", md.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (md.parent / target).exists():
                broken.append(f"{md.relative_to(ROOT)} -> {target}")
    assert broken == [], broken
