"""`rung warmup` and `rung generate` from the command line, on CPU."""

import json

import pytest

from rung.cli.main import main


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3", "tiny-gemma4"])
def test_warmup_prints_a_table_and_writes_json(preset, tmp_path, capsys):
    out = tmp_path / "graphs.json"
    assert main(["warmup", "--model", preset, "--capture-sizes", "1,2,4",
                 "--max-model-len", "64", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "PIECEWISE" in printed and "FULL" in printed and "capture_ms" in printed
    report = json.loads(out.read_text())
    graphs = report["graphs"]
    assert {(g["mode"], g["num_tokens_padded"]) for g in graphs} == {
        (m, s) for m in ("PIECEWISE", "FULL") for s in (1, 2, 4)}
    assert all(g["seconds"] > 0 and g["nbytes"] > 0 for g in graphs)
    assert report["capture_sizes"] == [1, 2, 4]


def test_warmup_lists_the_drafter_graphs(capsys):
    assert main(["warmup", "--model", "tiny-gemma4", "--speculative-model", "tiny-gemma4-mtp",
                 "--num-speculative-tokens", "1", "--max-num-seqs", "4",
                 "--max-model-len", "64"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert sorted(int(r[2]) for r in rows if r and r[0] == "DRAFT_FULL") == [1, 2, 4]
    assert any(r and r[0] == "FULL" for r in rows)


def test_warmup_default_ladder_captures_max_num_seqs(capsys):
    assert main(["warmup", "--model", "tiny-llama", "--max-num-seqs", "12", "--mode",
                 "full_decode_only", "--max-model-len", "32"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith("FULL")]
    assert sorted(int(r[1]) for r in rows) == [1, 2, 4, 8, 12]


def test_warmup_refuses_enforce_eager(capsys):
    assert main(["warmup", "--model", "tiny-llama", "--enforce-eager"]) == 2
    assert "drop --enforce-eager" in capsys.readouterr().err


def test_generate_prints_text_and_throughput(capsys):
    assert main(["generate", "--model", "tiny-llama", "--enforce-eager", "hello",
                 "--max-tokens", "5", "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    assert "(5 tokens, length)" in out and "tokens/s" in out


def test_warmup_says_when_every_capture_size_is_above_the_limit(capsys, caplog):
    # max_num_seqs=1 with k=2: the largest batch is 3 tokens; sizes 11 and 13 round to 12, 15
    assert main(["warmup", "--model", "tiny-llama", "--capture-sizes", "11,13",
                 "--max-num-seqs", "1", "--max-model-len", "32", "--speculative-method",
                 "ngram", "--num-speculative-tokens", "2"]) == 0
    assert "[12, 15]" in caplog.text and "3 tokens" in caplog.text
    assert "NO graph is captured" in caplog.text
    out = capsys.readouterr().out
    assert "0 graphs" in out and "no graph captured" in out


def test_stats_count_captured_graphs():
    from rung.runtime import LLM

    spec = {"method": "ngram", "num_speculative_tokens": 2}
    none = LLM("tiny-llama", max_num_seqs=1, max_model_len=32, speculative_config=spec,
               compilation_config={"cudagraph_capture_sizes": [11, 13]})
    assert none.engine.stats()["graphs_captured"] == 0
    some = LLM("tiny-llama", max_num_seqs=1, max_model_len=32, speculative_config=spec,
               compilation_config={"cudagraph_capture_sizes": [3, 13]})
    assert some.engine.stats()["graphs_captured"] > 0
