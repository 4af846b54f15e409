"""Documentation checks: every public name documented, API reference current, links valid."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

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


def test_every_public_function_and_class_has_a_signature_and_an_example():
    """Namespaces included (``ft.tree.add``, ``ft.optim.TraceState``, ...); type aliases and modules excepted."""
    text, _ = load_generator().render()
    sections = re.split(r"^### ", text, flags=re.M)[1:]
    lacking = []
    for section in sections:
        heading = section.splitlines()[0]
        if heading.endswith("(function)") or heading.endswith("(class)"):
            if "(" not in heading.split("`")[1] or "**Example**" not in section:
                lacking.append(heading.split("`")[1].split("(")[0])
    assert len(sections) > 100
    assert lacking == [], f"public functions or classes without a signature or an example: {lacking}"


def test_api_reference_is_current():
    text, _ = load_generator().render()
    assert (ROOT / "docs" / "api.md").read_text() == text, "docs/api.md is stale: run `python docs/gen_api.py`"


def test_all_lists_only_existing_names_without_duplicates():
    assert len(ft.__all__) == len(set(ft.__all__))
    for name in ft.__all__:
        assert hasattr(ft, name), name


def test_relative_links_resolve():
    broken = []
    for md in [ROOT / "README.md", ROOT / "tests" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", md.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (md.parent / target).exists():
                broken.append(f"{md.relative_to(ROOT)} -> {target}")
    assert broken == [], broken


def test_faq_examples_run():
    """Every python block of docs/faq.md runs, in order, in one namespace (the first asserts exactly k move)."""
    pytest.importorskip("torchvision")
    text = (ROOT / "docs" / "faq.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 4
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/faq.md", "exec"), namespace)
    assert namespace["changed"] == namespace["k"] == 1000


def test_sparse_training_examples_run():
    """docs/sparse_training.md's blocks run in order: k coordinates move per step, the accumulated step frees .grad,
    a skipped batch, a stream's lifetime, the sparse-state loop trains 20 coordinates with 16 bytes of state each,
    the adapter's state dict continues in a new optimizer and a dense one trains after it, grad_at trains between
    refreshes (the Trainer snippet, the last block: the test below)."""
    import torch

    text = (ROOT / "docs" / "sparse_training.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 8
    namespace: dict = {}
    for block in blocks[:6]:
        exec(compile(block, "docs/sparse_training.md", "exec"), namespace)
    assert namespace["moved"] == namespace["k"] == 20
    assert namespace["sparse"].indices.numel() == 20
    state, updates = namespace["state"], namespace["updates"]
    assert torch.equal(updates.indices, state.indices.long()) and updates.indices.numel() == 20
    assert int(state.count) == 12 and int(state.inner.count.min()) == 12 - 10  # joined at the last refresh, step 10
    tensors = [state.indices, *namespace["ft"].tree.leaves(state.inner)]
    assert sum(t.numel() * t.element_size() for t in tensors) == 16 * 20
    saved, again = namespace["saved"], namespace["again"].state_dict()
    assert int(again["state"]["count"]) == int(saved["state"]["count"]) == 3
    exec(compile(blocks[6], "docs/sparse_training.md", "exec"), namespace)  # grad_at between refreshes
    state, params = namespace["state"], namespace["params"]
    assert int(state.count) == 6 and int(state.inner.count.min()) == 6 - 3  # joined at the refresh of step 3
    before = dict(namespace["model"].named_parameters())  # the pure steps left the model's own tensors alone
    moved = sum(int((params[name] != before[name]).sum()) for name in before)
    assert 20 <= moved <= 40  # two coordinate sets of 20


@pytest.mark.integrations
def test_sparse_training_trainer_snippet_defines_its_class_and_subclass():
    """docs/sparse_training.md's last block (transformers' Trainer): the optimizer class and the Trainer subclass."""
    import torch

    import functopk as ft

    text = (ROOT / "docs" / "sparse_training.md").read_text()
    block = re.findall(r"```python\n(.*?)```", text, flags=re.S)[7]
    namespace: dict = {"torch": torch, "ft": ft}
    exec(compile(block, "docs/sparse_training.md", "exec"), namespace)
    assert issubclass(namespace["SparseAdamW"], torch.optim.AdamW)
    assert "_clip_grad_norm" in vars(namespace["SparseTrainer"])


def test_sparse_finetuning_recipe_runs():
    """docs/sparse_finetuning.md's recipe: a dense new head, the body sparse (two coordinate sets in 40 steps),
    batch-norm statistics frozen (its asserts), and the head trained."""
    text = (ROOT / "docs" / "sparse_finetuning.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    namespace: dict = {}
    exec(compile(block, "docs/sparse_finetuning.md", "exec"), namespace)
    assert 0 < namespace["changed"] <= 2 * namespace["sparse"].k
    assert namespace["sparse"].k == round(0.01 * sum(p.numel() for p in namespace["body"].parameters()))


def test_readme_example_moves_exactly_k_coordinates_every_step():
    """The README's example, run eagerly (the compile decorator is the one line left out: it is slow here)."""
    import torch

    pytest.importorskip("torchvision")
    text = (ROOT / "README.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert "@torch.compile(fullgraph=True)\n" in block
    namespace: dict = {}
    exec(compile(block.replace("@torch.compile(fullgraph=True)\n", ""), "README.md", "exec"), namespace)
    params, buffers, opt_state = namespace["params"], namespace["buffers"], namespace["opt_state"]
    g = torch.Generator().manual_seed(0)
    for _ in range(3):  # momentum runs before the selection: never more than k parameters move
        x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
        new_params, new_buffers, opt_state = namespace["step"](params, buffers, opt_state, x, y)
        assert sum(int((new_params[n] != params[n]).sum()) for n in params) == 1000
        assert not torch.equal(new_buffers["bn1.running_mean"], buffers["bn1.running_mean"])
        params, buffers = new_params, new_buffers


def test_readme_demo_table_is_the_committed_demo_output():
    """The README's results are what ``make demo`` wrote (benchmarks/results/demo/), not numbers typed by hand."""
    results = (ROOT / "benchmarks" / "results" / "demo" / "results.md").read_text()
    table = [line for line in results.splitlines() if line.startswith("|")]
    assert len(table) == 2 + 4  # header, separator, one row per method
    readme = (ROOT / "README.md").read_text()
    assert "\n".join(table) in readme
    assert "(benchmarks/results/demo/curves.png)" in readme
    header = results.splitlines()[0]
    assert "4 epochs, batch 64" in header and "k = 11,173 (0.100%)" in header  # the demo's defaults


def test_interop_differences_are_tested():
    """Every row of docs/interop.md's table of differences from torch.optim names tests that exist."""
    text = (ROOT / "docs" / "interop.md").read_text()
    table = text.split("### Where `from_torch` differs from `torch.optim`", 1)[1].split("\n\n| what |", 1)[1]
    rows = [line for line in table.split("\n\n", 1)[0].splitlines() if line.startswith("| ")][1:]
    assert len(rows) >= 10
    for row in rows:
        refs = re.findall(r"`(tests/[\w/]+\.py)::(test_\w+)`", row.rsplit("|", 2)[-2])
        assert refs, f"a row without a test: {row[:80]}"
        for path, name in refs:
            assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), f"{path}::{name} does not exist"


def test_license_is_the_full_apache_2_text_and_packaged():
    """pyproject.toml says Apache-2.0: LICENSE holds that licence's whole text and the build ships it."""
    text = (ROOT / "LICENSE").read_text()
    for part in ("Apache License\n                           Version 2.0, January 2004", "TERMS AND CONDITIONS FOR USE",
                 "9. Accepting Warranty or Additional Liability.", "END OF TERMS AND CONDITIONS",
                 "APPENDIX: How to apply the Apache License to your work."):  # fmt: skip
        assert part in text, part
    assert len(text.splitlines()) == 202
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'license = "Apache-2.0"' in pyproject and 'license-files = ["LICENSE"]' in pyproject


def test_changelog_records_this_version_and_the_kept_aliases():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in text and f"## [{ft.__version__}]" in text
    for name in ("ft.optimizer_from_torch", "ft.optimizer_class_from_torch", "ft.TorchOptimizer.from_torch",
                 "ft.TorchOptimizer.from_torch_class"):  # fmt: skip
        assert f"`{name}" in text, name


def build_site(site_dir, root=ROOT):
    """mkdocs.yml built in strict mode into ``site_dir`` from the pages under ``root``: the warnings, or None."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logger = logging.getLogger("mkdocs")
    logger.addHandler(handler)
    old = os.environ.get("FUNCTOPK_SITE_ROOT")
    os.environ["FUNCTOPK_SITE_ROOT"] = str(root)
    try:
        build(load_config(str(ROOT / "mkdocs.yml"), site_dir=str(site_dir), strict=True))
    except Abort:
        return warnings
    finally:
        logger.removeHandler(handler)
        if old is None:
            del os.environ["FUNCTOPK_SITE_ROOT"]
        else:
            os.environ["FUNCTOPK_SITE_ROOT"] = old
    assert warnings == []
    return None


def test_site_builds_without_a_warning(tmp_path):
    """The docs as a site (mkdocs.yml, strict, links and anchors validated), from the same files."""
    assert build_site(tmp_path / "site") is None
    assert (tmp_path / "site" / "docs" / "api" / "index.html").exists()
    assert (tmp_path / "site" / "tests" / "index.html").exists()  # tests/README.md
    assert (tmp_path / "site" / "benchmarks" / "results" / "demo" / "curves.png").exists()


def test_site_build_fails_on_a_broken_link_or_anchor(tmp_path):
    spec = importlib.util.spec_from_file_location("site_hooks", ROOT / "docs" / "site_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    for source in hooks.SOURCES:  # a copy of what the site is built from
        (tmp_path / "root" / source).parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if (ROOT / source).is_dir() else shutil.copy)(ROOT / source, tmp_path / "root" / source)
    (tmp_path / "root" / "docs" / "api.md").write_text("# API reference\n")  # the long page, not needed here
    faq = tmp_path / "root" / "docs" / "faq.md"
    faq.write_text(faq.read_text() + "\n[gone](missing.md) and [no anchor](topk.md#no-such-heading)\n")
    warnings = build_site(tmp_path / "site", root=tmp_path / "root")
    assert warnings is not None
    assert any("missing.md" in w for w in warnings) and any("no-such-heading" in w for w in warnings), warnings


def user_docs():
    """The pages a user reads (docs/api.md included: it is made from docstrings) and the examples' docstrings."""
    import ast

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    texts = {str(page.relative_to(ROOT)): page.read_text() for page in pages}
    for example in sorted((ROOT / "examples").glob("*.py")):
        texts[str(example.relative_to(ROOT))] = ast.get_docstring(ast.parse(example.read_text())) or ""
    return texts


def test_user_docs_cite_no_project_history():
    """No issue numbers ("issue" or "#" and a number) or "this session": a user cannot see them. Other projects'
    issues are links."""
    history = re.compile(r"\b[Ii]ssues? #?\d+|(?<![\w/.-])#\d+\b|\bsessions?\b|\bthis issue\b|\bthe issue\b")
    found = [f"{where}: {m.group(0)!r}" for where, text in user_docs().items() for m in history.finditer(text)]
    assert found == [], found


# Pages of docs/ that are records of measurements (dated runs); every other page describes the code as it is.
RECORD_PAGES = ("distributed-measurements.md",)
# What a user of the repository reads: the package, its docs, examples, benchmarks and their results, the tests.
USER_FILES = ("README.md", "CHANGELOG.md", "Makefile", "pyproject.toml", "mkdocs.yml", "functopk", "docs",
              "examples", "benchmarks", "tests", "requirements")  # fmt: skip
TEXT_SUFFIXES = {".py", ".md", ".c", ".sh", ".txt", ".toml", ".yml", ".cfg", ""}


def test_benchmarks_page_is_a_reference_with_records_apart():
    """docs/benchmarks.md holds one current table per claim; dated runs live in benchmarks/results/ beside their
    outputs. It stays short, and each of its sections links to where its runs are recorded."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert len(text.splitlines()) <= 320, "docs/benchmarks.md grows: move older runs to a record in benchmarks/results/"
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert len(sections) >= 8
    unlinked = [section.splitlines()[0] for section in sections if "](../benchmarks/results/" not in section]
    assert unlinked == [], f"sections that link to no result or record under benchmarks/results/: {unlinked}"


def test_guides_carry_no_dates():
    """Guides and reference pages describe the code, not when something was measured: ISO dates only in the pages
    that are records (RECORD_PAGES) and under benchmarks/results/."""
    date = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
    pages = [ROOT / "README.md", ROOT / "tests" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    records = {ROOT / "docs" / name for name in RECORD_PAGES}
    assert all(record.exists() for record in records)
    found = [
        f"{page.relative_to(ROOT)}:{number}: {line.strip()[:80]}"
        for page in pages
        if page not in records
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if date.search(line)
    ]
    assert found == [], found


def test_no_issue_numbers_in_the_repository():
    """The tracker's issue numbers mean nothing to a user: none in code, docs, benchmarks, results or tests."""
    history = re.compile(r"\b[Ii]ssues?[ -]#?\d+")
    files = []
    for name in USER_FILES:
        path = ROOT / name
        files += [path] if path.is_file() else [p for p in sorted(path.rglob("*")) if p.is_file()]
    files = [f for f in files if f.suffix in TEXT_SUFFIXES and "__pycache__" not in f.parts]
    assert len(files) > 100
    found = [
        f"{file.relative_to(ROOT)}: {m.group(0)!r}"
        for file in files
        for m in history.finditer(file.read_text(errors="replace"))
    ]
    assert found == [], found


def test_tests_readme_names_every_helper_module():
    """tests/README.md says what each helper module holds: every module under tests/ that is not a test file."""
    readme = (ROOT / "tests" / "README.md").read_text()
    helpers = [
        path.relative_to(ROOT)
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if not path.name.startswith("test_") and path.name != "__init__.py"
    ]
    assert len(helpers) >= 10
    missing = [str(path) for path in helpers if str(path) not in readme]
    assert missing == [], f"helper modules tests/README.md does not describe: {missing}"



def run_gpu_recipe(capture: bool) -> None:
    """docs/gpu.md's blocks in order (the capture only with ``capture``): every step advances the state's count."""
    text = (ROOT / "docs" / "gpu.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 3 and "torch.cuda.graph" in blocks[1]
    namespace: dict = {}
    steps = 0
    for i, block in enumerate(blocks):
        if i == 1 and not capture:
            continue
        exec(compile(block, "docs/gpu.md", "exec"), namespace)
        if i > 0:
            steps += len(namespace["batches"])
            assert int(namespace["opt_state"][1][0].count) == steps  # sgd's momentum count, in the graph's state too


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_gpu_recipe_runs_on_the_cpu_but_its_capture():
    """On the CPU: the step and its reduce-overhead form (inductor without a graph)."""
    if torch.cuda.is_available():
        pytest.skip("test_gpu_recipe_runs_whole runs it on this GPU")
    run_gpu_recipe(capture=False)


@pytest.mark.compile
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.usefixtures("fresh_dynamo")
def test_gpu_recipe_runs_whole():
    """On a GPU: captured by hand, replayed, then compiled with reduce-overhead, as written."""
    run_gpu_recipe(capture=True)
