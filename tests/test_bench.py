"""omni-bench on the CPU with the tiny preset: the JSON holds every metric the issue names, the forced
lengths are kept, the times are consistent with each other; progress goes to stderr; bad presets are
one-line errors."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from omni_cli.bench import app


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_tiny_bench_json_has_every_metric_at_the_forced_lengths():
    result = invoke("--preset", "tiny", "--text-tokens", "6", "--codes", "150", "--runs", "1", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    ours, meta = data["omni_cli"], data["meta"]
    assert data["transformers"] is None and meta["device"] == "cpu" and meta["codes"] == 150
    assert (ours["text_tokens"], ours["codes"], ours["audio_s"]) == (6, 150, 3.0)  # forced: 50 codes a second
    for key in ("time_to_first_text_ms", "time_to_first_audio_ms", "thinker_ms_per_token", "talker_ms_per_step",
                "talker_gap_us", "vocoder_ms_per_chunk", "vocoder_s_per_audio_s", "real_time_factor"):
        assert ours[key] is not None and ours[key] >= 0, key
    assert ours["time_to_first_token_ms"] <= ours["time_to_first_text_ms"] < ours["time_to_first_audio_ms"]
    assert ours["time_to_first_audio_ms"] < 1000 * ours["total_s"]
    assert abs(ours["real_time_factor"] - ours["total_s"] / ours["audio_s"]) < 1e-9
    # chunks of 12, 24, 48 codes and a 66-code tail: the largest before the last is 48
    assert ours["vocoder_chunk_codes"] == 48 and ours["peak_gib"] is None  # no GPU: no GPU memory
    # Each phase says it ended, on stderr.
    assert "engine ready" in result.stderr and "warm-up run" in result.stderr and "run 1:" in result.stderr


def test_unknown_preset_is_one_error_line():
    result = invoke("--preset", "qwen9", "--device", "cpu")
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == ["error: unknown preset 'qwen9'; choose one of qwen2.5-omni-7b, qwen2.5-omni-3b, tiny"]


def test_schedules_run_side_by_side_and_take_effect():
    result = invoke("--preset", "tiny", "--text-tokens", "4", "--codes", "250", "--runs", "1", "--device", "cpu",
                    "--schedules", "--json")
    assert result.exit_code == 0, result.output
    table = json.loads(result.stdout)
    assert list(table) == ["chunk48", "chunk96", "chunk192"]
    # 250 codes: chunks of 12, 24, 48, then the steady size each schedule asked for (192: not reached)
    assert [row["vocoder_chunk_codes"] for row in table.values()] == [48, 96, 96]
    assert all(row["codes"] == 250 and row["audio_s"] == 5.0 for row in table.values())
