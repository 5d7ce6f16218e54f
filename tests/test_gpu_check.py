"""bench/gpu_check.sh --dry-run installs rung offline into a fresh venv that already has
torch (no index, no deps, no build isolation), leaves torch alone, and prints its plan."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_SKIP = shutil.ignore_patterns(".venv", ".git", "__pycache__", "out", "*.egg-info", "build")


def _fresh_venv(path: Path) -> Path:
    """A venv without pip whose packages are this interpreter's (torch included) - but
    not rung: .pth files in a directory added by a .pth line are never run."""
    venv.EnvBuilder(with_pip=False).create(path)
    parents = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    site = Path(sysconfig.get_path("purelib", vars={"base": str(path)}))
    (site / "parent_env.pth").write_text("\n".join(parents) + "\n")
    return path / "bin" / "python"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_check")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_SKIP, symlinks=True)
    python = _fresh_venv(tmp / "venv")
    assert subprocess.run([python, "-c", "import rung"], capture_output=True).returncode != 0
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(python), "HOME": str(tmp),
           # NOTE: pip would otherwise try to replace a rung it sees on the parent path
           "PIP_IGNORE_INSTALLED": "1", "LIMIT_SCALE": "5"}   # a busy 2-core CI box
    proc = subprocess.run(["bash", "bench/gpu_check.sh", str(tmp / "out"), "--dry-run"],
                          cwd=src, env=env, capture_output=True, text=True, timeout=240)
    return proc, python, src, tmp / "out"


def test_dry_run_prints_plan_and_installs(dry_run):
    proc, _, _, out = dry_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "stage plan" in proc.stdout
    for stage in ("versions", "install", "kernels", "graph-tests", "capture", "live-switch",
                  "host-syncs", "latency"):
        assert f"\n  {stage}" in proc.stdout, stage
    limits = sum(s["limit_s"] for s in json.loads((out / "gpu_check.json").read_text())["stages"])
    assert limits <= 8 * 60
    assert "flash-attn is not installed: FLASH_ATTN tests skip" in proc.stdout
    assert "untouched" in proc.stdout
    verdicts = {s["stage"]: s["verdict"] for s in
                json.loads((out / "gpu_check.json").read_text())["stages"]}
    assert verdicts == {"versions": "PASS", "install": "PASS", "kernels": "SKIPPED",
                        "graph-tests": "SKIPPED", "capture": "SKIPPED",
                        "live-switch": "SKIPPED", "host-syncs": "SKIPPED",
                        "latency": "SKIPPED"}


def _fresh_setuptools_builds_editables(python: Path) -> bool:
    """setuptools >= 70.1 builds an editable wheel without the `wheel` package."""
    code = "import setuptools; print(setuptools.__version__)"
    got = subprocess.run([python, "-c", code], capture_output=True, text=True)
    major, minor = (int(x) for x in got.stdout.split(".")[:2])
    return (major, minor) >= (70, 1)


def test_rung_imports_from_the_install(dry_run):
    proc, python, src, out = dry_run
    assert "--no-index --no-deps" in (src / "bench" / "gpu_check.sh").read_text()
    shim = (out / "pythonpath").read_text().strip()
    if _fresh_setuptools_builds_editables(python):
        assert shim == "", (out / "install.log").read_text()   # pip itself installed it
    env = {"PYTHONPATH": shim} if shim else {}
    got = subprocess.run([python, "-c", "import rung.runtime.engine as e; print(e.__file__)"],
                         capture_output=True, text=True, cwd="/", env=env)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip().startswith(str(src if not shim else shim)), got.stdout


def test_the_summary_reports_host_syncs(tmp_path):
    (tmp_path / "stages.tsv").write_text("host-syncs\t0\t12\t20\n")
    (tmp_path / "host_syncs.json").write_text(json.dumps(
        {"sampled": {"conversions_per_step": [3, 1], "cuda_syncs_per_step": [2, 0],
                     "by_kind": {}}}))
    proc = subprocess.run([sys.executable, "bench/gpu_check_report.py", "summary",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "host syncs per step" in proc.stdout
    assert "sampled" in proc.stdout.split("host syncs per step")[1]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["host_syncs"]["sampled"]["cuda_syncs_per_step"] == [2, 0]


def test_the_install_fallback_shim_links_every_package():
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    line = next(ln for ln in script.splitlines() if ln.strip().startswith("for p in "))
    linked = set(line.split(" in ", 1)[1].split(";")[0].split())
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert packages <= linked, packages - linked


def test_tests_that_never_touched_the_gpu_are_not_counted_as_gpu_passes(tmp_path):
    (tmp_path / "stages.tsv").write_text("graph-tests\t0\t50\t95\nkernels\t0\t40\t90\n")
    (tmp_path / "graph-tests.log").write_text("cmd\n3 passed in 9.0s\n")
    (tmp_path / "graph-tests.devices.json").write_text(json.dumps(
        {"gpu": ["tests/a.py::t1", "tests/a.py::t2"], "cpu_only": ["tests/b.py::t3"]}))
    (tmp_path / "kernels.devices.json").write_text(json.dumps(
        {"gpu": [], "cpu_only": ["tests/k.py::t"]}))
    proc = subprocess.run([sys.executable, "bench/gpu_check_report.py", "summary",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    stages = {s["stage"]: s for s in
              json.loads((tmp_path / "gpu_check.json").read_text())["stages"]}
    assert stages["graph-tests"]["gpu_passed"] == 2
    assert stages["graph-tests"]["cpu_only_passed"] == ["tests/b.py::t3"]
    assert "2 on the GPU, 1 CPU-only" in proc.stdout
    assert stages["kernels"]["verdict"] == "NO GPU TEST" and proc.returncode == 1


def test_the_suite_lists_which_passing_tests_touched_the_device(tmp_path):
    report = tmp_path / "devices.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/test_cuda_path.py::test_compiled_cpu_graphs_are_refused_on_cuda"],
        cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "RUNG_DEVICE_TEST_REPORT": str(report)})
    assert proc.returncode == 0, proc.stdout
    test = "tests/test_cuda_path.py::test_compiled_cpu_graphs_are_refused_on_cuda"
    assert json.loads(report.read_text()) == {"gpu": [], "cpu_only": [test]}
