"""The first hour with rung, run as a user would: the `rung` command in a subprocess.

Each case asserts the exit status and the one line a user reads, and that no traceback
reaches stderr. Most cases share one subprocess (a driver calling the same `main()` the
`rung` script calls, once per command line) so the module stays fast; the real script runs
where the process itself matters (start-up output, --version, Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNG = [sys.executable, "-c", "import sys; from rung.cli.main import main; sys.exit(main())"]
FAST = ["--max-num-seqs", "2", "--max-model-len", "64", "--max-tokens", "2"]

# Runs each command line of argv[1] (JSON) through main() and prints one JSON record each.
_DRIVER = r"""
import contextlib, io, json, sys, traceback
from rung.cli.main import main
results = []
for case in json.loads(sys.argv[1]):
    if case.get("hide"):
        sys.modules[case["hide"]] = None          # as if the package were not installed
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(case["argv"])
        except SystemExit as e:                   # argparse's own usage errors
            rc = e.code
        except BaseException:
            traceback.print_exc()
            rc = "raised"
    if case.get("hide"):
        del sys.modules[case["hide"]]
    results.append({"rc": rc, "out": out.getvalue(), "err": err.getvalue()})
print(json.dumps(results))
"""


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, RUNG_DEBUG_PADDING="0", **extra)
    env.pop("RUNG_DEBUG", None)
    return env


def run_cases(cases: list[dict]) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(cases)],
                          capture_output=True, text=True, timeout=900, env=_env(),
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for case, result in zip(cases, results):
        assert "Traceback" not in result["err"], (case["argv"], result["err"])
        assert result["rc"] == case["rc"], (case["argv"], result)
        if "err" in case:
            assert re.search(case["err"], result["err"]), (case["argv"], result["err"])
        if case["rc"] not in (0, "raised"):
            assert result["err"].strip().splitlines()[-1].startswith(("error:", "rung ")), (
                case["argv"], result["err"])
        for gone in case.get("not_in_err", []):
            assert gone not in result["err"], (case["argv"], result["err"])
    return results


def _gen(*args: str) -> list[str]:
    return ["generate", "--enforce-eager", *FAST, *args]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """Model folders a user might point at: one fine (no tokenizer), three broken."""
    from rung.models.presets import PRESETS

    root = tmp_path_factory.mktemp("models")
    good = dict(PRESETS["tiny-llama"], max_position_embeddings=64)
    broken = {"ok": json.dumps(good), "missing": json.dumps(
        {k: v for k, v in good.items() if k != "hidden_size"}),
        "list": json.dumps([1, 2]), "badjson": "{not json"}
    paths = {}
    for name, text in broken.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(text)
        paths[name] = str(root / name)
    return paths


# --- 3, 4, 5, 6: bad input gets one line, before the expensive work ----------------------------
def test_bad_input_gets_one_line_each(folders, tmp_path):
    no_capture = ["Graphs live"]
    cases = [
        # 3: speculative flags
        {"argv": _gen("--num-speculative-tokens", "3"), "rc": 2,
         "err": r"--num-speculative-tokens 3 needs --speculative-method mtp or ngram"},
        {"argv": _gen("--speculative-method", "ngram", "--num-speculative-tokens", "0"),
         "rc": 2, "err": r"--speculative-method none for no speculation"},
        {"argv": _gen("--speculative-method", "ngram", "--num-speculative-tokens", "100"),
         "rc": 2, "err": r"num_speculative_tokens=100 must be an integer from 1 to 16"},
        {"argv": _gen("--speculative-method", "None", "hi"), "rc": 0},
        {"argv": _gen("--num-speculative-tokens", "0", "hi"), "rc": 0},
        {"argv": _gen("--speculative-model", "tiny-gemma4-mtp"), "rc": 2,
         "err": r"requires a Gemma 4 target; model 'tiny-llama' is 'llama'"},
        {"argv": _gen("--speculative-method", "mtp"), "rc": 2,
         "err": r"mtp needs --speculative-model"},
        # 4: one line instead of a traceback
        {"argv": _gen("--model", "tiny-gemma4-mtp"), "rc": 2,
         "err": r"'tiny-gemma4-mtp' is an MTP drafter, not a model to serve"},
        {"argv": _gen("--model", folders["missing"], "--load-format", "dummy",
                      "--prompt-token-ids", "1,2,3"), "rc": 2,
         "err": r"config\.json lacks the field 'hidden_size'"},
        {"argv": _gen("--model", folders["list"]), "rc": 2,
         "err": r"list/config\.json must hold a JSON object, got a list"},
        {"argv": _gen("--model", folders["badjson"]), "rc": 2,
         "err": r"badjson/config\.json is not valid JSON"},
        {"argv": _gen("--device", "tpu"), "rc": 2,
         "err": r"device 'tpu' is not one of auto, cpu, cuda, cuda:N"},
        {"argv": _gen("--device", "gpu"), "rc": 2, "err": r"device 'gpu' is not one of"},
        {"argv": ["generate", "--max-model-len", "-5"], "rc": 2,
         "err": r"--max-model-len -5 must be a positive integer"},
        {"argv": ["generate", "--max-model-len", "0"], "rc": 2,
         "err": r"--max-model-len 0 must be a positive integer"},
        {"argv": ["generate", "--seed", "abc"], "rc": 2,
         "err": r"argument --seed: invalid int value: 'abc'"},
        {"argv": ["warmup", "--json", "/nonexistent/dir/x.json"], "rc": 2,
         "err": r"--json /nonexistent/dir/x\.json: folder /nonexistent/dir does not exist",
         "not_in_err": no_capture},
        # 5: validated before the model is built and captured
        {"argv": ["generate", "--temperature", "-1", "hi"], "rc": 2,
         "err": r"SamplingParams\.temperature=-1\.0 is invalid: must be >= 0",
         "not_in_err": no_capture},
        {"argv": ["generate", "--max-model-len", "8", "a prompt far too long"], "rc": 2,
         "err": r"prompt 0 has 22 tokens, longer than max_model_len=8",
         "not_in_err": no_capture},
        # as the server's 400: a generation that cannot fit the context is refused, not run
        # for minutes and cut at the context
        {"argv": ["generate", "--max-model-len", "64", "--max-tokens", "100", "hi"], "rc": 2,
         "err": r"prompt 0: max_tokens=100 plus the \d+ prompt tokens is more than "
                r"max_model_len=64", "not_in_err": no_capture},
        {"argv": ["bench", "latency", "--baseline", "hf", "--batch-sizes", "1"],
         "hide": "transformers", "rc": 2,
         "err": r"--baseline hf needs transformers", "not_in_err": ["bench latency"]},
        # 6: a folder without tokenizer: token ids work, text says how
        {"argv": _gen("--model", folders["ok"], "--load-format", "dummy", "hi"), "rc": 2,
         "err": r"has no tokenizer\.json: pass prompts as token ids, e.g\. --prompt-token-ids"},
        {"argv": _gen("--model", folders["ok"], "--load-format", "dummy",
                      "--prompt-token-ids", "1,72,105"), "rc": 0},
    ]
    results = run_cases(cases)
    assert "[1, 72, 105] -> (2 tokens" in results[-1]["out"]


# --- 1: visible start-up ---------------------------------------------------------------------
def test_start_up_says_what_it_decided_and_shows_capture_progress():
    proc = subprocess.run(RUNG + ["generate", *FAST, "hi"], capture_output=True, text=True,
                          timeout=600, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert "Traceback" not in err
    assert "model tiny-llama (llama, random weights): float32 on cpu, max_model_len 64" in err
    assert re.search(r"attention backend \w+; KV cache: \d+ blocks of 16 tokens", err)
    assert "cudagraph mode FULL_AND_PIECEWISE, emulated graphs: 2 capture sizes [1, 2]" in err
    assert "Graphs live" in err and "/4" in err                 # a bar with its total
    assert re.search(r"captured 4 graphs in [\d.]+ s \(one-time tracing [\d.]+ s\), "
                     r"[\d.]+ MiB", err)
    assert "Processed prompts" in err                            # generate's bar
    assert "(2 tokens, length)" in proc.stdout
    _assert_log_lines_stand_alone(err)


def _assert_log_lines_stand_alone(err: str) -> None:
    """No log line glued onto a progress bar's (tqdm redraws a bar after '\\r')."""
    for segment in re.split(r"[\r\n]", err):
        if re.search(r"(INFO|WARNING) \d\d:\d\d:\d\d \[rung", segment):
            assert re.match(r"\s*(INFO|WARNING) ", segment), segment


def test_logging_level_silences_start_up():
    proc = subprocess.run(RUNG + _gen("hi"), capture_output=True, text=True, timeout=600,
                          env=_env(RUNG_LOGGING_LEVEL="WARNING"), cwd=ROOT)
    assert proc.returncode == 0 and "INFO" not in proc.stderr, proc.stderr


def test_version_and_help():
    version = subprocess.run(RUNG + ["--version"], capture_output=True, text=True,
                             timeout=120, cwd=ROOT)
    pyproject = (ROOT / "pyproject.toml").read_text()
    want = re.search(r'^version = "(.+)"', pyproject, re.M).group(1)
    assert version.returncode == 0 and version.stdout.strip() == f"rung {want}"
    from rung.cli.main import make_parser

    parser = make_parser()
    help_text = parser._subparsers._group_actions[0].choices["generate"].format_help()
    assert "--max-num-seqs MAX_NUM_SEQS" in help_text and "(default: 16)" in help_text
    assert "max_position_embeddings" in help_text           # what --max-model-len None means
    _assert_every_flag_has_help(parser, "rung")


def test_building_the_parser_imports_no_torch():
    """Every command builds the whole parser first: with torch (or numpy) imported there,
    `rung --help` and every start-up paid seconds for it."""
    code = ("import sys; from rung.cli.main import make_parser; make_parser(); "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def _assert_every_flag_has_help(parser, name: str) -> None:
    for action in parser._actions:
        assert action.help, f"{name} {action.option_strings or action.dest} has no help"
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                _assert_every_flag_has_help(sub, f"{name} {sub_name}")


def _interruptible() -> None:
    """The child takes Ctrl-C as a terminal would deliver it, even where the suite itself
    runs with SIGINT ignored (a shell's background job), which a child would inherit."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_start_up_exits_quietly_with_130():
    proc = subprocess.Popen(RUNG + ["generate", "--max-num-seqs", "8", "--ignore-eos",
                                    "--max-tokens", "2000", "hi"],
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=_env(), cwd=ROOT, preexec_fn=_interruptible)
    deadline = time.monotonic() + 300
    seen = ""
    while "cudagraph mode" not in seen and time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen += line
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=120)
    assert proc.returncode == 130, seen + rest
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest


def test_long_generation_shows_tokens_and_ctrl_c_prints_the_partial_text():
    proc = subprocess.Popen(RUNG + ["generate", "--enforce-eager", "--ignore-eos",
                                    "--max-tokens", "2000", "--prompt-token-ids", "1,2,3"],
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, env=_env(),
                            cwd=ROOT, preexec_fn=_interruptible)
    deadline = time.monotonic() + 300
    seen = ""
    # the bar moves while the one prompt is still 0/1: tokens and tok/s
    while time.monotonic() < deadline:
        chunk = os.read(proc.stderr.fileno(), 65536).decode(errors="replace")
        if not chunk:
            break
        seen += chunk
        counts = re.findall(r"0/1 \[[^\]]*output (\d+) tok, [\d.]+ tok/s", seen)
        if counts and int(counts[-1]) >= 20:
            break
    proc.send_signal(signal.SIGINT)
    out, rest = proc.communicate(timeout=120)
    out, rest = out.decode(), rest.decode()
    assert proc.returncode == 130, seen + rest
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest
    match = re.search(r"--- \[1, 2, 3\] -> \(interrupted after (\d+) tokens\)", out)
    assert match and int(match.group(1)) >= 20, out
    _assert_log_lines_stand_alone(seen + rest)


# --- 2 and 8: the ladder cap and the warmup table ----------------------------------------------
def test_warmup_table_tells_the_truth(tmp_path):
    out = tmp_path / "w.json"
    cases = [
        {"argv": ["warmup", "--max-num-seqs", "64", "--max-cudagraph-capture-size", "4",
                  "--mode", "piecewise", "--max-model-len", "32", "--json", str(out)],
         "rc": 0, "err": r"batches of up to 64 tokens .* exceed max_cudagraph_capture_size=4: "
                         r"graphs are captured up to 4 tokens, larger batches run eagerly"},
        {"argv": ["warmup", "--mode", "none", "--max-model-len", "32"], "rc": 0},
        {"argv": ["warmup", "--speculative-method", "ngram", "--capture-sizes", "1,2,8",
                  "--max-num-seqs", "4", "--max-model-len", "32", "--mode", "full_decode_only"],
         "rc": 0, "err": r"capture sizes \[1, 2, 8\] become \[4, 8\] \(multiples of 4\)"},
    ]
    capped, none, spec = run_cases(cases)
    rows = [line.split() for line in capped["out"].splitlines() if line.startswith("PIECE")]
    assert [(r[1], r[2], r[3]) for r in rows] == [("4", "-", "3-4"), ("2", "-", "2"),
                                                  ("1", "-", "1")]
    assert "one-time tracing" in capped["out"]
    report = json.loads(out.read_text())
    assert report["capture_sizes"] == [1, 2, 4] and report["trace_seconds"] > 0
    assert "no graph captured: every step will run eagerly (cudagraph mode NONE" in none["out"]
    assert "capture_ms" not in none["out"]
    assert [r.split()[1] for r in spec["out"].splitlines() if r.startswith("FULL")] == ["8", "4"]


def test_warmup_lists_drafter_graphs():
    results = run_cases([{"argv": [
        "warmup", "--model", "tiny-gemma4", "--speculative-model", "tiny-gemma4-mtp",
        "--num-speculative-tokens", "2", "--max-num-seqs", "2", "--max-model-len", "32",
        "--mode", "full_decode_only"], "rc": 0}])
    draft_rows = [r.split() for r in results[0]["out"].splitlines() if r.startswith("DRAFT")]
    assert sorted(r[1] for r in draft_rows) == ["1", "2"]
    assert "+ 2 draft graphs" in results[0]["out"]


# --- 9: the README works from a clone ----------------------------------------------------------
def test_readme_links_stay_inside_the_repo():
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#]+)", readme):
        path = (ROOT / target).resolve()
        assert path.is_relative_to(ROOT) and path.exists(), target
    assert "--index-url https://download.pytorch.org/whl/cpu" in readme
