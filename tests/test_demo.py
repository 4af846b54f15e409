"""Smoke tests of the demo (examples/train_resnet.py) and the convergence benchmark that reuses it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
pytest.importorskip("torchvision")
pytest.importorskip("sklearn")

import train_resnet  # noqa: E402

TINY = ["--epochs", "1", "--train-size", "96", "--batch-size", "32", "--steps-per-epoch", "2", "--no-progress"]


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *args], capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip


@pytest.mark.slow
def test_demo_runs_and_writes_the_table_and_the_plot(tmp_path):
    out = tmp_path / "demo"
    proc = run("examples/train_resnet.py", *TINY, "--k", "1000", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("| method |")))
    rows = [line.split("|")[1:-1] for line in lines[header + 2 : header + 6]]
    assert [r[0].strip() for r in rows] == ["dense", "topk", "topk+ef", "dgc"]
    for r in rows:
        assert 0.0 <= float(r[1]) <= 100.0  # final test accuracy
    numel = 11_172_810  # resnet18 with the 1-channel 3x3 stem and 10 classes
    assert rows[0][4].strip() == "100%" and rows[0][6].strip() == "100.00%"
    # topk: k = 1000 coordinates per step, 8 bytes each (int32 index + fp32 value) vs 4 bytes per coordinate
    assert rows[1][4].strip() == f"{100 * 1000 / numel:.3g}%" and rows[1][5].strip() == "8.0 KB"
    assert rows[1][6].strip() == f"{8000 / (4 * numel):.2%}"
    png = out / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"wrote {png}" in proc.stdout
    results = json.loads((out / "results.json").read_text())["results"]
    assert [h["method"] for h in results] == ["dense", "topk", "topk+ef", "dgc"]
    assert all(h["steps"] == 2 and len(h["step_loss"]) == 2 and h["numel"] == numel for h in results)
    assert all(0 < h["first_step_s"] < h["wall_s"] for h in results)  # what --compile reports as compile time
    # every method starts from the same weights: the same test accuracy before the first step
    assert len({h["test_acc"][0] for h in results}) == 1
    # DGC's density warm-up sends more than k in its first steps
    assert results[3]["density"] > results[1]["density"]
    assert (out / "results.md").read_text().count("\n| ") == 2 + 4  # header, separator, a row per method


@pytest.mark.slow
def test_convergence_benchmark_reuses_the_demo(tmp_path):
    proc = run("benchmarks/convergence.py", *TINY, "--methods", "topk+ef", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "| topk+ef |" in proc.stdout and "k = 11,173 (0.100%)" in proc.stdout
    assert (tmp_path / "convergence.png").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--density", "2"], "--density: expected a number in (0, 1]"),
        (["--k", "0"], "--k: expected an integer >= 1"),
        (["--k", "10", "--density", "0.1"], "not allowed with argument"),
        (["--methods", "dense,sgd"], "--methods: expected a comma-separated subset"),
        (["--dataset", "mnist"], "invalid choice: 'mnist'"),
        (["--epochs", "two"], "--epochs: expected an integer >= 1, got 'two'"),
        (["--lr", "nan"], "--lr: expected a finite number > 0, got 'nan'"),
        (["--device", "gpu0"], "--device: not a torch device"),
        (["--k", "100000000"], "exceeds the model's"),
        (["--train-size", "10"], "--batch-size 64 exceeds the 10 training images"),
    ],
)
def test_bad_options_are_argparse_errors(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        train_resnet.main([*argv, "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cifar10_missing_is_a_clear_error_and_never_downloads(capsys, tmp_path, monkeypatch):
    def no_download(*args, **kwargs):
        raise AssertionError("a download was attempted")

    monkeypatch.setattr("torchvision.datasets.utils.download_url", no_download)
    with pytest.raises(SystemExit) as exc:
        train_resnet.main(["--dataset", "cifar10", "--data-dir", str(tmp_path), "--out", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "CIFAR-10 is not in" in err and "never downloads" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_quickstart_example_runs():
    proc = run("examples/quickstart.py", "--epochs", "1", "--k", "200")
    assert proc.returncode == 0, proc.stderr
    assert "dense sgd (momentum 0.9)" in proc.stdout and "top-200 + sgd (momentum 0.9)" in proc.stdout


def torchrun(*args: str, restarts: int = 0, nproc: int = 2, example: str = "ddp_topk.py"
             ) -> tuple[subprocess.CompletedProcess, str]:  # fmt: skip
    """An example (examples/ddp_topk.py) on ``nproc`` gloo ranks, one short epoch; the process and a report."""
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: torchrun's shared store keeps the keys of a failed attempt, and the
    # restarted ranks can read a dead peer's address from it and fail or hang (pytorch/pytorch#135712): one store
    # per attempt.
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
         "--max-restarts", str(restarts), os.path.join(ROOT, "examples", example),
         "--epochs", "1", "--timeout-s", "60", *(["--warmup-iters", "2"] if example == "ddp_topk.py" else []), *args],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    return proc, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"


@pytest.mark.slow
def test_ddp_example_runs_under_torchrun_and_resumes_bit_for_bit_after_a_crash(tmp_path):
    """The example checkpoints every 5 of its 22 steps; in the second run rank 1 dies after step 12, torchrun
    restarts both ranks, they resume from step 10 and must end with the very same parameters."""
    whole, report = torchrun("--checkpoint-dir", str(tmp_path / "whole"), "--checkpoint-every", "5")
    assert whole.returncode == 0, report
    assert "replicas identical: True" in whole.stdout and "kB handed over per rank" in whole.stdout, report
    assert "resumed" not in whole.stdout, report
    # one file per rank, the two newest checkpoints kept, and the marker naming the newest complete one
    assert sorted(os.listdir(tmp_path / "whole")) == [
        "latest", "step00000015-rank0.pt", "step00000015-rank1.pt", "step00000020-rank0.pt", "step00000020-rank1.pt"
    ]  # fmt: skip
    assert (tmp_path / "whole" / "latest").read_text() == "20"
    crashed, report = torchrun("--checkpoint-dir", str(tmp_path / "crashed"), "--checkpoint-every", "5",
                               "--crash-at-step", "12", restarts=1)  # fmt: skip
    assert crashed.returncode == 0, report
    assert "rank 1: crashing after step 12" in crashed.stdout, report
    assert "resumed from the checkpoint of step 10" in crashed.stdout, report
    digest = [line.split("parameters sha256 ")[1] for line in crashed.stdout.splitlines() if "sha256" in line]
    assert digest and f"parameters sha256 {digest[0]}" in whole.stdout, report + "\nuninterrupted:\n" + whole.stdout


@pytest.mark.slow
def test_fsdp_example_resumes_bit_for_bit_from_its_dcp_checkpoint_after_a_crash(tmp_path):
    """examples/fsdp_topk.py: DCP checkpoints every 5 of 22 steps; rank 1 dies after step 12 in the second run,
    both ranks restart from step 10 and end with the very same (unsharded) parameters as the first run."""
    whole, report = torchrun("--checkpoint-dir", str(tmp_path / "whole"), "--checkpoint-every", "5",
                             example="fsdp_topk.py")  # fmt: skip
    assert whole.returncode == 0, report
    assert "fsdp_topk, k = 500" in whole.stdout and "resumed" not in whole.stdout, report
    assert sorted(os.listdir(tmp_path / "whole")) == ["latest", "step00000015", "step00000020"], report
    crashed, report = torchrun("--checkpoint-dir", str(tmp_path / "crashed"), "--checkpoint-every", "5",
                               "--crash-at-step", "12", restarts=1, example="fsdp_topk.py")  # fmt: skip
    assert crashed.returncode == 0, report
    assert "rank 1: crashing after step 12" in crashed.stdout, report
    assert "resumed from the checkpoint of step 10" in crashed.stdout, report
    digest = [line.split("parameters sha256 ")[1] for line in crashed.stdout.splitlines() if "sha256" in line]
    assert digest and f"parameters sha256 {digest[0]}" in whole.stdout, report + "\nuninterrupted:\n" + whole.stdout


def test_documented_torchrun_commands_are_the_tested_form():
    """Every documented torchrun command of the DDP example uses --standalone (with torchrun's default static
    rendezvous the first restart failed in 4 of 5 tries), and the restart command also the variable and
    --max-restarts: the form that the kill-and-resume test above runs."""
    import inspect

    import ddp_topk
    import fsdp_topk

    tested = inspect.getsource(torchrun)
    assert '"--standalone"' in tested and '"--max-restarts"' in tested
    assert 'TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"' in tested
    with open(os.path.join(ROOT, "docs", "distributed.md")) as f:
        docs = f.read()
    for where, text in (("docs/distributed.md", docs), ("examples/ddp_topk.py", ddp_topk.__doc__ or ""),
                        ("examples/fsdp_topk.py", fsdp_topk.__doc__ or "")):  # fmt: skip
        commands = [line.strip() for line in text.splitlines() if "torchrun --" in line and "--nproc-per-node" in line]
        assert commands and all("torchrun --standalone " in c for c in commands), (where, commands)
        restarts = [c for c in commands if "--max-restarts" in c]
        assert restarts and all(c.startswith("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun") for c in restarts)


@pytest.mark.slow
def test_ddp_example_runs_on_a_single_rank(tmp_path):
    """One rank (as on one GPU with NCCL): nothing crosses a wire, and the report says so instead of dividing by 0."""
    proc, report = torchrun("--checkpoint-dir", str(tmp_path), nproc=1)
    assert proc.returncode == 0, report
    assert "1 ranks" in proc.stdout and "nothing on the wire with a single rank" in proc.stdout, report
    assert "replicas identical: True" in proc.stdout, report


def test_help_shows_every_default_once_and_no_none():
    text = train_resnet.build_parser().format_help()
    text = text[text.index("options:"):]  # the option list, not the usage line
    assert "(default: None)" not in text and "default 0.001" not in text
    for option, default in (("--epochs", "4"), ("--batch-size", "64"), ("--momentum", "0.9"), ("--seed", "0"),
                            ("--threads", "0"), ("--methods", "dense,topk,topk+ef,dgc"), ("--dataset", "digits")):
        block = text[text.index(option + " "):]
        assert f"(default: {default})" in " ".join(block.split("\n  --")[0].split()), option


def test_dgc_warmup_longer_than_the_run_is_a_warning_with_the_numbers():
    args = train_resnet.build_parser().parse_args(["--k", "1000", "--epochs", "1", "--batch-size", "64"])
    numel = 11_172_810
    warning = train_resnet.warmup_warning(1000, numel, 128, args)  # 2 steps, all inside the 1-epoch warm-up
    assert warning is not None and "outlasts the 2-step run" in warning and "1 epoch)" in warning
    args = train_resnet.build_parser().parse_args(["--k", "1000", "--epochs", "4", "--batch-size", "64"])
    assert train_resnet.warmup_warning(1000, numel, 1797, args) is None  # the demo's own setting: warm-up ends
    args = train_resnet.build_parser().parse_args(["--k", "1000", "--epochs", "1", "--methods", "topk"])
    assert train_resnet.warmup_warning(1000, numel, 128, args) is None  # no DGC, nothing to say
    assert train_resnet.plural(1, "epoch") == "epoch" and train_resnet.plural(2, "epoch") == "epochs"
