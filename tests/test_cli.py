"""The ``fxremat`` command line: end to end in subprocesses (run once, in a module fixture),
bad arguments in process."""

from __future__ import annotations

import io
import json
import logging
import os
import pathlib
import subprocess
import sys
import types

import pytest
import torch

import fxremat
from fxremat import cli

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent
PNG_HEADER = b"\x89PNG\r\n\x1a\n"
HAS_MATPLOTLIB = __import__("importlib").util.find_spec("matplotlib") is not None


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _runs(out: pathlib.Path) -> dict[str, list[str]]:
    return {
        "plan": ["plan", "cli_models:small_unet", "--input", "2x3x32x32", "--budget", "0.5",
                 "--cost-model", "flops", "--code", str(out / "code.py"), "--json", str(out / "plan.json")],
        "tradeoff": ["tradeoff", "cli_models:small_unet", "--input", "8x3x128x128", "--points", "5", "--fake",
                     "--plot", str(out / "curve.png"), "--csv", str(out / "curve.csv")],
        "bad": ["plan", "cli_models:small_unet", "--input", "2x3xfoo", "--budget", "0.5"],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli")
    results = {}
    for name, argv in _runs(out).items():
        proc = subprocess.run([sys.executable, "-m", "fxremat.cli", *argv], cwd=TESTS, env=_env(),
                              capture_output=True, text=True, timeout=240)
        results[name] = types.SimpleNamespace(rc=proc.returncode, stdout=proc.stdout, stderr=proc.stderr)
    return out, results


def test_plan_prints_table_and_writes_code_and_json(runs):
    out, results = runs
    r = results["plan"]
    assert r.rc == 0, r.stderr
    for needle in ("strategy=", "baseline peak", "predicted peak", "predicted overhead", "solve time", "kept values"):
        assert needle in r.stdout
    code = (out / "code.py").read_text()
    compile(code, "code.py", "exec")  # the emitted code is valid Python
    assert "fxremat_runtime_recompute" in code and "# seg_0: recomputed during the backward" in code
    plan = fxremat.load_plan(out / "plan.json")
    assert plan.summary() in r.stdout
    assert plan.cost_model == "flops" and plan.graph_key and plan.nodes


def test_fake_tradeoff_writes_png_and_csv(runs):
    out, results = runs
    r = results["tradeoff"]
    if not HAS_MATPLOTLIB:
        assert r.rc == 2 and "matplotlib" in r.stderr and len(r.stderr.strip().splitlines()) == 1
        return
    assert r.rc == 0, r.stderr
    assert (out / "curve.png").read_bytes()[:8] == PNG_HEADER
    rows = (out / "curve.csv").read_text().strip().splitlines()
    assert rows[0].startswith("budget_bytes,predicted_peak_bytes,predicted_overhead")
    peaks = [int(row.split(",")[1]) for row in rows[1:]]
    overheads = [float(row.split(",")[2]) for row in rows[1:]]
    assert len(peaks) >= 2 and overheads[0] == 0.0
    assert peaks == sorted(peaks, reverse=True) and overheads == sorted(overheads)
    assert "predicted peak" in r.stdout and "cost model flops" in r.stdout and "none" in r.stdout


def test_bad_argument_in_subprocess_is_one_line_exit_2(runs):
    _, results = runs
    r = results["bad"]
    assert r.rc == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "'2x3xfoo'" in lines[0] and "Traceback" not in r.stderr


# --------------------------------------------------------------------------------------------
# In process: bad arguments, torchvision models, progress
# --------------------------------------------------------------------------------------------

@pytest.fixture
def in_tests(monkeypatch):
    monkeypatch.chdir(TESTS)
    monkeypatch.setattr(sys, "path", list(sys.path))


MODEL = ["cli_models:small_unet", "--input", "2x3x16x16"]
BAD = {
    "no subcommand": ([], "COMMAND"),
    "unknown subcommand": (["frob"], "frob"),
    "missing input": (["plan", "cli_models:small_unet", "--budget", "0.5"], "--input"),
    "bad budget": (["plan", *MODEL, "--budget", "lots"], "'lots'"),
    "fraction above 1": (["plan", *MODEL, "--budget", "1.5"], "1.5"),
    "bad dtype": (["plan", "cli_models:small_unet", "--input", "2x3:float8", "--budget", "0.5"], "float8"),
    "bad strategy": (["plan", *MODEL, "--budget", "0.5", "--strategy", "greedy"], "greedy"),
    "one point": (["tradeoff", *MODEL, "--points", "1"], "--points"),
    "model without colon": (["plan", "cli_models", "--input", "2x3", "--budget", "0.5"], "package.module:Callable"),
    "missing module": (["plan", "no_such_module:f", "--input", "2x3", "--budget", "0.5"], "no_such_module"),
    "missing callable": (["plan", "cli_models:nothing", "--input", "2x3", "--budget", "0.5"], "'nothing'"),
    "not a module": (["plan", "cli_models:not_a_module", "--input", "2x3", "--budget", "0.5"], "not a torch.nn.Module"),
    "measured on fake": (["plan", *MODEL, "--budget", "0.5", "--fake", "--cost-model", "measured"], "--fake"),
    "infeasible budget": (["plan", *MODEL, "--budget", "1kB", "--fake"], "--budget min"),
    "ambiguous budget": (["plan", *MODEL, "--budget", "800M"], "'800MiB'"),
    "budget without unit": (["plan", *MODEL, "--budget", "2e9"], "'2e9B'"),
    "3-d input to a 4-d model": (["plan", "cli_models:small_unet", "--input", "2x3x32", "--budget", "0.5"],
                                 "cannot run on --input 2x3x32:float32"),
    "int64 input to a float model": (["plan", "cli_models:small_unet", "--input", "2x3x32x32:int64", "--budget",
                                      "0.5"], "--input 2x3x32x32:int64"),
    "json into a missing folder": (["plan", *MODEL, "--budget", "0.5", "--json", "no_such_dir/plan.json"],
                                   "does not exist"),
    "plot into a missing folder": (["tradeoff", *MODEL, "--csv", "no_such_dir/c.csv"], "--csv no_such_dir"),
}


@pytest.mark.parametrize("argv,needle", BAD.values(), ids=list(BAD))
def test_bad_arguments_exit_2_with_one_line(argv, needle, in_tests, capsys):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("fxremat") and "error:" in lines[0] and needle in lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda_is_a_bad_argument(in_tests, capsys):
    assert cli.main(["plan", *MODEL, "--budget", "0.5", "--device", "cuda"]) == 2
    assert "--device cpu" in capsys.readouterr().err


def test_missing_torchvision_is_a_bad_argument(in_tests, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torchvision", None)
    assert cli.main(["plan", "torchvision:resnet50", "--input", "2x3x32x32", "--budget", "0.5"]) == 2
    assert "pip install torchvision" in capsys.readouterr().err


def _fake_torchvision():
    import cli_models

    def builder(name):
        if name != "unet":
            raise ValueError(f"Unknown model {name}")
        return cli_models.small_unet

    models = types.SimpleNamespace(get_model_builder=builder, get_model=lambda name, weights: builder(name)())
    return types.SimpleNamespace(models=models)


def test_torchvision_models_by_name(in_tests, monkeypatch, capsys, tmp_path):
    sys.path.insert(0, str(TESTS))
    monkeypatch.setitem(sys.modules, "torchvision", _fake_torchvision())
    argv = ["plan", "torchvision:unet", "--input", "2x3x32x32", "--budget", "min", "--fake", "--quiet",
            "--json", str(tmp_path / "plan.json")]
    assert cli.main(argv) == 0
    assert "memory-centric" in capsys.readouterr().out
    assert json.loads((tmp_path / "plan.json").read_text())["format"] == "fxremat-plan/1"
    assert cli.main(["plan", "torchvision:nonet", "--input", "2x3x32x32", "--budget", "min"]) == 2
    assert "list_models" in capsys.readouterr().err


def test_fake_planning(in_tests, capsys, tmp_path):
    argv = ["plan", "cli_models:small_unet", "--input", "8x3x128x128", "--budget", "min", "--fake",
            "--code", str(tmp_path / "code.py"), "--explain"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "(cpu, fake)" in out and "cost model=flops" in out and "memory-centric" in out
    assert "values recomputed in the backward" in out  # --explain
    assert "fxremat_runtime_recompute" in (tmp_path / "code.py").read_text()


def test_input_specs():
    assert cli.input_spec("2x3x96x96") == ((2, 3, 96, 96), torch.float32)
    assert cli.input_spec("4x128:int64") == ((4, 128), torch.int64)
    assert cli.budget_arg("0.5").fraction == 0.5
    assert cli.budget_arg("2e9B").bytes == 2 * 10**9
    assert cli.budget_arg("50%").fraction == 0.5 and cli.budget_arg("1").fraction == 1.0
    assert cli.budget_arg("800MiB").bytes == 800 * 2**20
    assert cli.budget_arg("min").minimum


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_only_on_a_terminal_and_not_quiet(monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.setattr(cli._Progress, "DELAY_S", 0.0)
    for quiet, expect in ((False, True), (True, False)):
        term = _Terminal()
        monkeypatch.setattr(sys, "stderr", term)
        with cli._Progress(2, quiet=quiet) as progress:
            progress.stage("profiling")
            progress.advance()
        assert ("profiling" in term.getvalue()) is expect


def test_no_progress_bar_without_tqdm(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with cli._Progress(2, quiet=False) as progress:
        progress.stage("profiling")
        progress.advance()
    assert progress.bar is None and term.getvalue() == ""


def test_bench_measures_plain_and_compiled(in_tests, capsys):
    argv = ["bench", "cli_models:small_unet", "--input", "1x3x16x16", "--budget", "min", "--cost-model", "flops",
            "--steps", "1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "measured peak" in out and "plain" in out and "compiled" in out and "step time" in out


def test_bench_autotunes_by_default(in_tests, capsys):
    argv = ["bench", "cli_models:small_unet", "--input", "2x3x32x32", "--budget", "0.7", "--cost-model", "flops",
            "--steps", "1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    listed = [line for line in out.splitlines() if "overhead predicted" in line]
    assert "autotune" in out and len(listed) >= 2 and sum(line.lstrip().startswith("*") for line in listed) == 1
    assert cli.main(argv + ["--autotune", "0"]) == 0
    assert "autotune" not in capsys.readouterr().out


def test_output_folders_are_checked_before_any_work(in_tests, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_build", lambda args: pytest.fail("built the model before checking --code"))
    assert cli.main(["plan", *MODEL, "--budget", "0.5", "--code", "missing_dir/code.py"]) == 2
    assert "missing_dir" in capsys.readouterr().err


def test_bench_bar_shows_the_library_stages_and_the_steps(in_tests, monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.setattr(cli._Progress, "DELAY_S", 0.0)
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    argv = ["bench", "cli_models:small_unet", "--input", "1x3x16x16", "--budget", "min", "--cost-model", "flops",
            "--steps", "1"]
    assert cli.main(argv) == 0
    shown = term.getvalue()
    for stage in ("tracing", "profiling", "solving", "emitting", "plain step 2/2", "compiled step 2/2"):
        assert stage in shown, stage
    assert not logging.getLogger("fxremat").handlers  # the bar's handler is gone afterwards


def test_stage_shows_its_running_time(monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.setattr(cli._Progress, "DELAY_S", 0.0)
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with cli._Progress(2, quiet=False) as progress:
        progress.stage("profiling 12 nodes")
        progress._since -= 5  # as if the stage had run for five seconds
        progress._describe(refresh=True)
    assert "profiling 12 nodes 5s" in term.getvalue()


def test_plan_bar_shows_the_library_stages(in_tests, monkeypatch, tmp_path):
    """``fxremat plan`` runs the library's pipeline (fxremat.api.planned): its stages reach the bar."""
    pytest.importorskip("tqdm")
    monkeypatch.setattr(cli._Progress, "DELAY_S", 0.0)
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    code = tmp_path / "code.py"
    assert cli.main(["plan", *MODEL, "--budget", "min", "--code", str(code)]) == 0
    for stage in ("tracing", "profiling", "solving", "emitting"):
        assert stage in term.getvalue(), stage
    assert "fxremat_runtime_recompute(seg_" in code.read_text()
