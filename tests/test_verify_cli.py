"""`rung verify`: the matrix, the verdict, --json and the exit code."""

import json

from rung.cli.main import main
from rung.runtime import LLM, SamplingParams
from rung.runtime.tools.verify import guard_kv
from rung.runtime.worker.input_batch import InputBatch

ARGS = ["verify", "--model", "tiny-llama", "--max-num-seqs", "2", "--max-model-len", "64",
        "--mode", "full"]


def test_verify_prints_a_matrix_and_passes(tmp_path, capsys):
    out = tmp_path / "verify.json"
    assert main([*ARGS, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "FULL replays" in printed and "PASS: all" in printed
    report = json.loads(out.read_text())
    assert report["verdict"] == "pass"
    cells = report["modes"][0]["cells"]
    assert {(c["size"], c["num_reqs"]) for c in cells if c["status"] == "pass"} == {
        (1, 1), (2, 1), (2, 2)}


def test_verify_exits_1_on_a_mismatch(monkeypatch, capsys):
    pad = InputBatch.pad

    def pad_rows_read_block_1(self, desc):      # a pad() that breaks the contract
        pad(self, desc)
        if desc.num_reqs == 0:                   # capture batches stay valid
            return
        self.seq_lens.np[desc.num_reqs:desc.num_reqs_padded] = 3
        self.block_tables[0].np[desc.num_reqs:desc.num_reqs_padded] = 1

    monkeypatch.setattr(InputBatch, "pad", pad_rows_read_block_1)
    assert main(ARGS) == 1
    printed = capsys.readouterr().out
    assert "FAIL:" in printed and "✗ FULL size 2, 1 requests" in printed


def test_verify_refuses_eager(capsys):
    assert main([*ARGS, "--enforce-eager"]) == 2
    assert "drop --enforce-eager" in capsys.readouterr().err


def test_verify_runs_at_the_ramps_max_model_len(capsys):
    # tiny-llama allows 2048 positions; the ramp of 2 requests needs 10 + 5 = 15
    assert main(["verify", "--model", "tiny-llama", "--max-num-seqs", "2", "--mode", "full"]
                ) == 0
    printed = capsys.readouterr().out
    assert "PASS: all" in printed and "max_model_len 16," in printed


def test_ramp_never_runs_a_request_out_of_positions():
    from rung.runtime import LLM
    from rung.runtime.tools.verify import drive, ramp, ramp_max_model_len

    num_reqs, k = 3, 2
    max_model_len = ramp_max_model_len(num_reqs, k, 16)
    llm = LLM("tiny-llama", enforce_eager=True, max_num_seqs=num_reqs,
              max_model_len=max_model_len,
              speculative_config={"method": "ngram", "num_speculative_tokens": k})
    steps = ramp(num_reqs)
    trace = drive(llm.engine, steps)
    prompts = {rid: len(p["prompt_token_ids"]) for arrivals in steps for rid, p in arrivals}
    longest = max(prompts[rid] + len(ids) for out in trace.tokens for rid, ids in out.items())
    assert longest + 1 + k <= max_model_len     # room for one more verify step


def test_guard_kv_passes_the_data_parallel_argument_through():
    engine = LLM("tiny-llama", enforce_eager=True, max_num_seqs=2, max_model_len=32).engine
    guard_kv(engine)
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=1))
    sched = engine.scheduler.schedule()
    block_ids = [engine.kv.block_ids(s.request.request_id) for s in sched.scheduled]
    # NOTE: an engine under data parallel passes num_tokens_across_dp third (None without)
    out = engine.runner.execute(sched, block_ids, None)
    assert len(out.sampled["r"]) == 1
