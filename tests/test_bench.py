"""omni-bench on the CPU with the tiny preset: the JSON holds every metric the issue names, the forced
lengths are kept, the times agree with a clock outside the benchmark; progress goes to stderr; each
metric is the median of the measured runs; every usage error (typer's own included) is one line with
exit code 2; a device that is not here is the loader's one-line error; without --preset a CPU gets the
tiny preset and a full-size preset on a CPU is refused; transformers' config warnings stay off stderr.
The Qwen3-Omni presets: the tiny checkpoint beside transformers' generate at forced lengths (frames), and
the true-size config of Qwen3-Omni-30B-A3B (every field set; 35.26 B parameters, counted on the meta device).

Most tests call the program's entry point (`bench_app`) in-process with few tokens and codes; the one
that checks stderr as a whole runs it in a subprocess (transformers' logging writes to the stderr it
found at import, which capsys does not see).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import run_omni_say
from omni_cli.faces.bench import DEFAULT_PRESET, FAMILIES, PRESETS, _median, _pick_preset, bench_app, family_of
from omni_cli.models import qwen2_5_omni, qwen3_omni
from omni_cli.models.qwen3_omni.presets import build_config, count_parameters


def bench(capsys, *args):
    """omni-bench ARGS through its entry point, in this process: (exit code, stdout, stderr)."""
    try:
        bench_app([str(a) for a in args])
        code = 0
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_tiny_bench_json_has_every_metric_at_the_forced_lengths(capsys):
    t = time.perf_counter()
    code, out, err = bench(capsys, "--preset", "tiny", "--text-tokens", "6", "--codes", "150", "--runs", "2",
                           "--device", "cpu", "--json")
    elapsed = time.perf_counter() - t
    assert code == 0, err
    data = json.loads(out)
    ours, meta = data["omni_cli"], data["meta"]
    assert data["transformers"] is None and meta["device"] == "cpu" and meta["codes"] == 150
    assert (ours["text_tokens"], ours["codes"], ours["audio_s"]) == (6, 150, 3.0)  # forced: 50 codes a second
    for key in ("time_to_first_text_ms", "time_to_first_audio_ms", "thinker_ms_per_token", "talker_ms_per_step",
                "talker_gap_us", "vocoder_ms_per_chunk", "vocoder_s_per_audio_s", "real_time_factor"):
        assert ours[key] is not None and ours[key] >= 0, key
    assert ours["time_to_first_token_ms"] <= ours["time_to_first_text_ms"] < ours["time_to_first_audio_ms"]
    assert ours["time_to_first_audio_ms"] < 1000 * ours["total_s"]
    # The real-time factor is a reply's wall time over its audio (3 s, from the forced 150 codes): measured
    # against the clock here, a reply lasts longer than its first audio and less than the whole program
    # (which also built the model and ran a warm-up reply and a second reply).
    reply_s = ours["real_time_factor"] * 3.0
    assert ours["time_to_first_audio_ms"] / 1000 < reply_s < elapsed / 2
    # chunks of 12, 24, 48 codes and a 66-code tail: the largest before the last is 48
    assert ours["vocoder_chunk_codes"] == 48 and ours["peak_gib"] is None  # no GPU: no GPU memory
    assert ours["compiled"] is False and ours["setup_phases_s"] is None  # a CPU compiles and captures nothing
    # Each phase says it ended, on stderr; the two measured runs' times are printed there to 0.01 s, and
    # their median (two runs: the mean) is the reported total.
    assert "engine ready" in err and "warm-up run" in err
    walls = [float(s) for s in re.findall(r"\] run \d: ([0-9.]+) s", err)]
    assert len(walls) == 2
    assert abs(ours["total_s"] - sum(walls) / 2) <= 0.006


@pytest.mark.unit
def test_median_is_a_median():
    assert _median([3.0, 1.0, 2.0]) == 2.0
    assert _median([1.0, 3.0]) == 2.0  # not the slower of two runs
    assert _median([4.0, 1.0, 3.0, 2.0]) == 2.5  # an even count: the mean of the middle two
    assert _median([5, 9, 5, 1]) == 5 and isinstance(_median([5, 9, 5, 1]), int)  # equal middles stay as they are
    assert _median([None, 7.0, None]) == 7.0  # a metric a run lacks is left out
    assert _median([None, None]) is None and _median([]) is None


@pytest.mark.parametrize("args", [["--bogus"], ["--codes", "abc"], ["--codes", "0"], ["--runs", "-1"],
                                  ["--runs"], ["surplus"]])
@pytest.mark.cli
def test_usage_errors_are_one_line_with_exit_code_2(capsys, args):
    code, out, err = bench(capsys, "--preset", "tiny", "--device", "cpu", *args)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert args[0] in lines[0]  # it names what was wrong


@pytest.mark.cli
def test_unknown_preset_is_one_error_line(capsys):
    code, out, err = bench(capsys, "--preset", "qwen9", "--device", "cpu")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == ["error: unknown preset 'qwen9'; choose one of "
                                         "qwen2.5-omni-7b, qwen2.5-omni-3b, qwen3-omni-30b-a3b, tiny, tiny-qwen3"]


def _absent_devices():
    names = ["cuda:99", "npu:7"]  # on no machine these tests run on
    if not torch.cuda.is_available():
        names.append("cuda")  # the case: --device cuda without CUDA
    return names


@pytest.mark.parametrize("name", _absent_devices())
@pytest.mark.cli
def test_a_device_that_is_not_here_is_the_loaders_one_line_error(capsys, name):
    from omni_cli.errors import UsageError
    from omni_cli.loader import pick_device

    with pytest.raises(UsageError) as expected:  # what omni-say says for the same --device
        pick_device(name)
    code, out, err = bench(capsys, "--preset", "tiny", "--device", name)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [f"error: {expected.value}"]


@pytest.mark.parametrize("preset", ["qwen2.5-omni-7b", "qwen2.5-omni-3b", "qwen3-omni-30b-a3b"])
@pytest.mark.cli
def test_a_full_size_preset_on_the_cpu_is_refused_naming_the_tiny_one(capsys, preset):
    t = time.perf_counter()
    code, out, err = bench(capsys, "--preset", preset, "--device", "cpu")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and preset in lines[0] and "--preset tiny" in lines[0]
    assert time.perf_counter() - t < 5  # refused before anything is built


@pytest.mark.unit
def test_default_preset_follows_the_device(capsys):
    assert _pick_preset(None, torch.device("cuda")) == DEFAULT_PRESET == "qwen2.5-omni-7b"
    assert capsys.readouterr().err == ""
    assert _pick_preset(None, torch.device("cpu")) == "tiny"
    assert capsys.readouterr().err.count("\n") == 1  # said in one line
    assert _pick_preset("qwen2.5-omni-3b", torch.device("cuda")) == "qwen2.5-omni-3b"


@pytest.mark.e2e
def test_no_preset_on_the_cpu_runs_tiny_says_so_once_and_nothing_else():
    """The program as a user runs it: no --preset on the CPU is the tiny preset, with one note; stderr
    holds that note and the progress lines only (no transformers config warnings); stdout is the JSON."""
    result = run_omni_say("--device", "cpu", "--text-tokens", "2", "--codes", "20", "--runs", "1", "--json",
                          module="omni_cli.faces.bench", timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["meta"]["preset"] == "tiny"
    lines = result.stderr.splitlines()
    assert lines[0] == "note: no accelerator here, so the tiny preset (the full-size presets need a GPU)"
    others = [line for line in lines[1:] if not line.startswith("[omni-bench ")]
    assert others == []
    assert any("built tiny on cpu" in line for line in lines)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: bare omni-bench builds the 7B preset")
def test_bare_omni_bench_without_an_accelerator_is_the_tiny_preset(capsys, monkeypatch):
    import omni_cli.loader

    if omni_cli.loader.pick_device("auto").type != "cpu":
        pytest.skip("this machine has an accelerator")
    code, out, err = bench(capsys, "--text-tokens", "2", "--codes", "20", "--runs", "1", "--json")
    assert code == 0, err
    assert json.loads(out)["meta"]["preset"] == "tiny"
    assert err.count("note: no accelerator here, so the tiny preset") == 1


def test_schedules_run_side_by_side_and_take_effect(capsys):
    code, out, err = bench(capsys, "--preset", "tiny", "--text-tokens", "4", "--codes", "250", "--runs", "1",
                           "--device", "cpu", "--schedules", "--json")
    assert code == 0, err
    table = json.loads(out)
    assert list(table) == ["chunk48", "chunk96", "chunk192"]
    # 250 codes: chunks of 12, 24, 48, then the steady size each schedule asked for (192: not reached)
    assert [row["vocoder_chunk_codes"] for row in table.values()] == [48, 96, 96]
    assert all(row["codes"] == 250 and row["audio_s"] == 5.0 for row in table.values())


def test_streams_alternate_the_two_modes_on_one_engine(capsys, monkeypatch):
    """--streams: one reply of each mode in turn, each with the engine's talker stream switched as named
    (on a CPU both modes run the same code: the switch is recorded, not timed)."""
    from omni_cli.runtime import turn as turn_mod

    modes = []
    original_turn = turn_mod.Turn.__init__

    def note_mode(self, engine, req):
        modes.append(engine.overlap)
        original_turn(self, engine, req)

    monkeypatch.setattr(turn_mod.Turn, "__init__", note_mode)
    code, out, err = bench(capsys, "--preset", "tiny", "--text-tokens", "4", "--codes", "50", "--runs", "2",
                           "--device", "cpu", "--streams", "--json")
    assert code == 0, err
    table = json.loads(out)
    assert list(table) == ["one stream", "two streams"]
    assert modes == [False, True] * 3  # a warm-up reply of each, then two runs, alternating
    assert all(row["codes"] == 50 and row["audio_s"] == 1.0 for row in table.values())


def test_tiny_qwen3_bench_beside_transformers_at_the_forced_lengths(capsys, monkeypatch):
    """Qwen3-Omni's units are 16-id frames (12.5 a second; code2wav gives 1920 * F - 555 samples): both sides
    make exactly the asked text tokens and frames, and the reference's stage times are filled in. The
    reference runs only once the last run's capture ahead is done (on CUDA a capture holds the default
    generator, which the reference draws from)."""
    from omni_cli.models.qwen3_omni import presets as qwen3_presets
    from omni_cli.runtime import engine as engine_mod
    from omni_cli.runtime import turn as turn_mod

    order: list[str] = []
    for owner, name in ((turn_mod.Turn, "__init__"), (engine_mod.Engine, "settle"), (qwen3_presets, "reference")):
        def noted(*args, __original=getattr(owner, name), __name=name, **kwargs):
            order.append(__name)
            return __original(*args, **kwargs)
        monkeypatch.setattr(owner, name, noted)
    code, out, err = bench(capsys, "--preset", "tiny-qwen3", "--prompt-tokens", "12", "--text-tokens", "4",
                           "--frames", "6", "--runs", "1", "--device", "cpu", "--compare-hf", "--json")
    assert code == 0, err
    data = json.loads(out)
    meta, ours, ref = data["meta"], data["omni_cli"], data["transformers"]
    assert (meta["preset"], meta["family"], meta["unit"], meta["codes"]) == ("tiny-qwen3", "qwen3-omni", "frames", 6)
    assert meta["dtype"] == "torch.float32" and meta["steps_per_second"] == 12.5
    audio_s = (1920 * 6 - 555) / 24000
    for side in (ours, ref):
        assert (side["text_tokens"], side["codes"]) == (4, 6)
        assert side["audio_s"] == pytest.approx(audio_s)
        for key in ("time_to_first_audio_ms", "thinker_ms_per_token", "talker_ms_per_step", "real_time_factor"):
            assert side[key] is not None and side[key] > 0, key
    assert ours["time_to_first_text_ms"] < ours["time_to_first_audio_ms"]
    assert ref["time_to_first_text_ms"] is None  # nothing streams: the first audio is the whole call
    assert ref["time_to_first_audio_ms"] == pytest.approx(1000 * ref["total_s"])
    assert 0 < ref["code_predictor_ms_per_frame"] < ref["talker_ms_per_step"]
    assert "transformers generate: " in err and "4 text tokens, 6 frames" in err
    last_turn = len(order) - 1 - order[::-1].index("__init__")
    assert order[-1] == "reference" and "settle" in order[last_turn:], order


def test_tiny_qwen3_table_names_frames(capsys):
    code, out, err = bench(capsys, "--preset", "tiny-qwen3", "--prompt-tokens", "10", "--text-tokens", "2",
                           "--frames", "3", "--runs", "1", "--device", "cpu")
    assert code == 0, err
    assert "talker + code predictor ms/frame" in out and "frames 3" in err


@pytest.mark.parametrize("args", [["--schedules"], ["--variants"], ["--prompt-tokens", "8"]])
@pytest.mark.cli
def test_qwen3_refuses_what_it_lacks_in_one_line(capsys, args):
    code, out, err = bench(capsys, "--preset", "tiny-qwen3", "--device", "cpu", *args)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and args[0] in lines[0]


def test_qwen3_30b_config_is_the_real_model():
    """The true-size config, built only (no weights): the real checkpoint's sizes and ids, not transformers'
    defaults, and 35.26 B parameters in all, counted on the meta device."""
    config = build_config("qwen3-omni-30b-a3b")
    text, talker = config.thinker_config.text_config, config.talker_config
    t = talker.text_config
    assert (text.num_hidden_layers, text.hidden_size, text.num_attention_heads, text.num_key_value_heads,
            text.head_dim, text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size,
            text.vocab_size) == (48, 2048, 32, 4, 128, 128, 8, 768, 152064)
    assert (t.num_hidden_layers, t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.num_experts,
            t.num_experts_per_tok, t.moe_intermediate_size, t.shared_expert_intermediate_size,
            t.vocab_size) == (20, 1024, 16, 2, 128, 6, 384, 768, 3072)
    assert talker.accept_hidden_layer == 24 and talker.num_code_groups == 16
    assert (talker.codec_pad_id, talker.codec_bos_id, talker.codec_eos_token_id, talker.codec_nothink_id,
            talker.codec_think_bos_id, talker.codec_think_eos_id) == (2148, 2149, 2150, 2155, 2156, 2157)
    assert talker.speaker_id == {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
    p = talker.code_predictor_config
    assert (p.num_hidden_layers, p.hidden_size, p.num_code_groups, p.vocab_size) == (5, 1024, 16, 2048)
    audio, vision = config.thinker_config.audio_config, config.thinker_config.vision_config
    assert (audio.d_model, audio.encoder_layers, audio.output_dim) == (1280, 32, 2048)
    assert (vision.depth, vision.hidden_size, vision.out_hidden_size) == (27, 1152, 2048)
    assert config.code2wav_config.upsample_rates == [8, 5, 4, 3] and config.code2wav_config.decoder_dim == 1536
    total = count_parameters(config)
    assert abs(total - 35.26e9) < 0.01e9, total
    assert PRESETS["qwen3-omni-30b-a3b"]["parameters"] == 35.26e9  # what build_model checks it against


@pytest.mark.e2e
def test_each_family_gives_the_bench_the_same_names_and_its_own_presets():
    """bench.py knows no family: each presets module has the same interface, its steps a second are its
    package's, and every preset name maps to the family that owns it; importing it all needs no torch."""
    interface = ("PRESETS", "FAMILY", "TITLE", "UNIT", "CODES_PER_SECOND", "DEFAULT_VOICE", "TALKER_SAMPLING",
                 "PROMPT_FRAME", "GRAPHS", "READY_NOTE", "VARIANTS", "SCHEDULES", "LABELS", "build_config",
                 "build_model", "text_eos_ids", "prompt", "steps", "reference")
    for fam, package in zip(FAMILIES, (qwen2_5_omni, qwen3_omni)):
        assert all(hasattr(fam, name) for name in interface), fam.__name__
        assert fam.CODES_PER_SECOND == package.CODES_PER_SECOND and fam.TITLE == package.TITLE
        assert all(family_of(name) is fam for name in fam.PRESETS)
    assert sorted(PRESETS) == sorted(n for fam in FAMILIES for n in fam.PRESETS)
    code = "import sys, omni_cli.faces.bench; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3"])
def test_bench_turns_times_a_spoken_conversation_kept_and_whole(capsys, preset):
    """`--turns`: each turn's prompt holds the conversation so far; kept, a turn prefills only what the last
    prompt lacks (its reply and the new spoken turn) and encodes only its own clip; whole, everything."""
    code, out, err = bench(capsys, "--preset", preset, "--turns", 3, "--audio-seconds", 1, "--text-tokens", 4,
                           "--codes", 12, "--json")
    assert code == 0, err
    result = json.loads(out)
    kept, whole = result["turns"]["kept"], result["turns"]["whole"]
    assert [t["prompt_tokens"] for t in kept] == [t["prompt_tokens"] for t in whole]
    prompts = [t["prompt_tokens"] for t in kept]
    assert prompts[0] < prompts[1] < prompts[2]
    assert [t["prefill_tokens"] for t in whole] == prompts
    assert [t["prefill_tokens"] for t in kept[1:]] == [b - a for a, b in zip(prompts, prompts[1:])]
    # The talker keeps its rows of the kept positions too (kept mode only); more each turn.
    assert all(t["talker_kept_rows"] == 0 for t in whole)
    assert kept[0]["talker_kept_rows"] < kept[1]["talker_kept_rows"] < kept[2]["talker_kept_rows"]
    assert all(t["text_tokens"] == 4 and t["codes"] == 12 and t["audio_encoder_ms"] > 0 for t in kept + whole)
    # The replies' checksums: kept and whole reply alike, turn by turn (greedy, float32), and differ between turns.
    assert [t["reply_crc32"] for t in kept] == [t["reply_crc32"] for t in whole]
    assert len({t["reply_crc32"] for t in kept}) == 3 and all(t["markers_dropped"] == 0 for t in kept + whole)
    assert result["meta"]["turns"] == 3 and result["meta"]["audio_seconds"] == 1


def test_bench_turns_keeps_a_replys_media_markers_out_of_the_next_prompt():
    """A reply's text ids go into the next prompt without the thinker's media marker ids (what an
    assistant's text history does), which would make a clip's place without a clip."""
    from transformers import AutoConfig

    from omni_cli.faces.bench_turns import media_ids

    for name, audio in (("tiny-qwen2.5-omni", 771), ("tiny-qwen3-omni", 800)):
        config = AutoConfig.from_pretrained(Path(__file__).parent.parent / "assets" / name)
        markers = media_ids(type("Model", (), {"config": config}))
        assert audio in markers and 780 in markers and len(markers) >= 7, (name, markers)
        assert not markers & {config.thinker_config.user_token_id}


def test_the_speaker_start_is_the_speakers_own_rule():
    """`speaker_start_ms`: a first block under the speaker's 0.2 s floor (Qwen3-Omni's chunk of two frames,
    0.137 s) waits for the second; one of four frames (0.297 s) plays at once; the 7B's 40 ms first block
    and 0.48 s second, 0.28 s apart, wait for a third (the gaps grow with the blocks: 0.56 s asked for)."""
    from omni_cli.faces.bench import _TimedSink

    def wait(blocks, began=0.0):
        sink = _TimedSink()
        sink.start(24000)
        sink.began = began
        for t, n in blocks:
            sink.times.append(t)
            sink.starts.append(sink.samples)
            sink.samples += n
        return sink.speaker_wait_ms()

    assert wait([(0.095, 3285), (0.125, 7680)]) == pytest.approx(30.0)
    assert wait([(0.112, 7125), (0.140, 15360)]) == 0.0
    assert wait([(0.300, 960), (0.580, 11520), (0.900, 23040)]) == pytest.approx(600.0)
    assert wait([(0.300, 960)]) == 0.0  # only the reply's end starts it: its one block
    assert _TimedSink().speaker_wait_ms() is None
