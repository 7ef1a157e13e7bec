#!/usr/bin/env bash
# GPU checks in one call on a lent GPU machine (the device tool runs it from the repository root; $OUT
# comes back). Steps, in the order given (default: bench tests):
#   bench      the 7B benchmark beside transformers (JSON in $OUT/bench.json), at most 300 s
#   schedules  the vocoder schedules side by side (omni-bench --schedules; $OUT/schedules.json), 300 s
#   tests      tests/test_gpu.py (graphed = eager = transformers; sync_debug; --no-graphs captures none), 420 s
#   setup      install the wheels carried in .gpu_wheels/ (the machine has torch and transformers only)
#   qwen3      Qwen3-Omni-30B-A3B, plain graphs (the commands' default), the issue's unit ($OUT/qwen3-plain.json)
#   qwen25     Qwen2.5-Omni-7B compiled ($OUT/qwen25-compiled.json)
#   turns25    a 10-turn spoken conversation, 7B, plain graphs, kept vs whole ($OUT/turns-qwen25.json)
#   turns3     the same, Qwen3-Omni-30B-A3B ($OUT/turns-qwen3.json)
#   placecheck25  turns25 three times through scripts/turns_place_check.py (each placement's device ids checked
#              against the host's); each run's replies' checksums, the markers dropped
#   kept       tests/test_gpu.py's kept-context and lazy-graph tests only
#   rests      tests/test_gpu.py's prompt graphs (rests over a kept context, long prompts, Qwen2.5-Omni's)
#              and the audio encoder (no cuDNN attention, nothing read back)
#   encoders   one audio-encoder call on a 5 s clip at true size, both families, timed and profiled
#              (scripts/encoder_profile.py; $OUT/encoder-*.jsonl)
#   attend     the attention kernel over spans 256..8192 beside the library's ($OUT/attend-spans.jsonl)
#   pprof      where Qwen3-Omni's 2,500-token prefill goes: eager prefill, top kernels, one MoE block
#              (scripts/prefill_profile.py; $OUT/prefill-profile.json)
#   pprof60, pprofq, pprofq60   the same at 60 tokens, packed int4 at 2,500, packed int4 at 60
#              ($OUT/prefill-profile-STEP.json)
#   long3      Qwen3-Omni, a 2,500-token prompt, plain graphs ($OUT/qwen3-2500.json)
#   long25     Qwen2.5-Omni-7B, a 2,500-token prompt, plain graphs ($OUT/qwen25-2500.json)
#   moe        tests/test_gpu.py's prompt ops (runtime/prompt_ops.py) and the tests whose prompts take them
#   agraphs    tests/test_gpu.py's audio tower graphs (runtime/audio_graphs.py) and the encoder tests beside them
#   cgraphs    tests/test_gpu.py's code2wav chunk graphs (models/qwen3_omni/code2wav.py ChunkGraphs) and the tiny engines
#              beside them (both families: graphed = eager = transformers; Qwen3-Omni under sync debug)
#   dit        the 7B's vocoder alone (scripts/vocoder_bench.py --profile, 250 codes), the omni_cli copied to
#              .ab_before/ (an earlier commit, where one was put there) and this one ($OUT/vocoder-{before,now}.json)
#   rope       tests/test_gpu.py's rotary kernel against the library's (prints the share of values equal)
#   first      a true-size random 7B folder in /tmp/q7, then scripts/first_replies.py on it with the
#              warm-up as it was (text only) and as it is (with a clip) ($OUT/first-replies-*.txt)
#   vision     tests/test_gpu.py's vision tower in host memory until the first image (runtime/vision_place.py)
#   vbring     the true-size vision towers moved to the GPU as a first image moves them (scripts/vision_bring.py)
#   packed     tests/test_gpu.py's packed-weight tests (int4 and FP8 steps = transformers on the dequantized weights)
#   qmm        the packed prefill products beside bf16 (and an earlier quant_kernels.py, scripts/_qk_before.py,
#              where one was copied there), with a tile sweep ($OUT/quant-mm.jsonl)
#   qsweep     the packed decode kernels' blocks swept per use ($OUT/quant-sweep.json)
#   qkernels   the packed decode kernels beside bf16 ($OUT/quant-kernels.json)
#   q3 KIND    (q3int4, q3fp8, q3bf16, q25int4, q25fp8, q25bf16; q25-3b-int4: Qwen2.5-Omni-3B) omni-bench of a preset
#              packed or not, the unit
#              ($OUT/q-PRESET-KIND.json)
#   vdtype     Qwen2.5-Omni's token2wav in bfloat16 against float32 at true size (scripts/vocoder_dtype.py;
#              $OUT/vocoder-dtype.json)
#   room3      rt3's talk room only (omni-chat --talk --server over /v1/realtime against Qwen3-Omni)
#   rt25, rt3  the 7B / Qwen3-Omni served at true size (scripts/serve_preset.py): /v1/realtime timed by
#              scripts/realtime_latency.py ($OUT/realtime-*.json), then omni-chat --talk --server in the
#              file-backed room (measure_talk.py room; PortAudio from .gpu_libs/ if the machine lacks it; the
#              listener's inputs in $OUT/listener-*.flac/.json, for scripts/listener_record.py replay)
# SUFFIX=-x names long3's and q3*'s outputs apart (an A/B on one machine: OMNI_NO_KERNELS=1 SUFFIX=-nokernels);
# WITH="pkg.module.NAME=VALUE" runs their omni-bench with that constant changed (scripts/with_setting.py), e.g.
# WITH=omni_cli.models.qwen3_omni.code2wav.FIRST_CHUNK=4 SUFFIX=-first4.
# Each step has its own time limit so a call stays under the 600 s it may take; omni-bench prints a
# progress line per phase on stderr, so a step cut short still shows how far it got.
#   usage: bash scripts/gpu_check.sh [STEP ...]
set -u
out=${OUT:-/tmp/omni-gpu-check}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bench="python3 -m omni_cli.faces.bench --preset qwen2.5-omni-7b --runs 2 --json"
omni_bench="python3 -m omni_cli.faces.bench"
[ -n "${WITH:-}" ] && omni_bench="python3 scripts/with_setting.py $WITH -- omni_cli.faces.bench"
served() {  # served PRESET MAX_CODES TAG [DEVICE [ROOM_ONLY]]: serve it, time /v1/realtime and talk mode against it
  python3 scripts/serve_preset.py "$1" --port 8484 --max-codes "$2" --device "${4:-cuda}" > "$out/serve-$3.out" 2> "$out/serve-$3.err" &
  local pid=$!
  for _ in $(seq 400); do grep -q "omni-serve:" "$out/serve-$3.err" && break; kill -0 $pid 2>/dev/null || break; sleep 1; done
  [ -n "${5:-}" ] || timeout 150 python3 scripts/realtime_latency.py --url http://127.0.0.1:8484 --rounds 3 --silence-ms 500 \
    --max-tokens 64 > "$out/realtime-$3.json" 2> "$out/realtime-$3.err"
  PYTHONPATH=$PWD/.gpu_libs:$PWD LD_LIBRARY_PATH=$PWD/.gpu_libs TALK_FLAGS="--server http://127.0.0.1:8484" TALK_LOG="$out/talk-$3.log" \
    TALK_RECORD="$out/listener-$3" timeout 240 python3 scripts/measure_talk.py room > "$out/talk-$3.txt" 2>&1
  kill $pid; wait $pid 2>/dev/null
}
for step in "${@:-bench tests}"; do
  for s in $step; do
    case $s in
      bench) timeout 300 $bench --compare-hf > "$out/bench.json" 2> "$out/bench.err"
             echo "bench rc=$?"; grep '^\[omni-bench' "$out/bench.err" ;;
      schedules) timeout 300 $bench --schedules > "$out/schedules.json" 2> "$out/schedules.err"
             echo "schedules rc=$?"; grep '^\[omni-bench' "$out/schedules.err" ;;
      setup) python3 -m pip install -q --no-index --no-deps .gpu_wheels/*.whl 2>&1 | tail -2; echo "setup rc=$?" ;;
      qwen3) timeout 420 python3 -m omni_cli.faces.bench --preset qwen3-omni-30b-a3b --runs 3 --prompt-tokens 60 \
               --text-tokens 64 --frames 188 --json --no-compile > "$out/qwen3-plain.json" 2> "$out/qwen3-plain.err"
             echo "qwen3 rc=$?"; grep '^\[omni-bench' "$out/qwen3-plain.err" | tail -5 ;;
      qwen25) timeout 540 $bench --runs 3 > "$out/qwen25-compiled.json" 2> "$out/qwen25-compiled.err"
             echo "qwen25 rc=$?"; grep '^\[omni-bench' "$out/qwen25-compiled.err" | tail -5 ;;
      turns25) timeout 420 python3 -m omni_cli.faces.bench --preset qwen2.5-omni-7b --turns 10 --audio-seconds 5 \
               --text-tokens 64 --codes 250 --no-compile --json > "$out/turns-qwen25.json" 2> "$out/turns-qwen25.err"
             echo "turns25 rc=$?"; grep 'turn' "$out/turns-qwen25.err" | tail -22 ;;
      turns3) timeout 480 python3 -m omni_cli.faces.bench --preset qwen3-omni-30b-a3b --turns 10 --audio-seconds 5 \
               --text-tokens 64 --frames 63 --no-compile --json > "$out/turns-qwen3.json" 2> "$out/turns-qwen3.err"
             echo "turns3 rc=$?"; grep 'turn' "$out/turns-qwen3.err" | tail -22 ;;
      placecheck25) for r in 1 2 3; do timeout 175 python3 scripts/turns_place_check.py --preset qwen2.5-omni-7b --turns 10 \
               --audio-seconds 5 --text-tokens 64 --codes 250 --no-compile --json > "$out/turns-qwen25-pc$r.json" 2> "$out/turns-qwen25-pc$r.err"
               echo "placecheck25 run $r rc=$?"; grep -E 'Assertion|places for' "$out/turns-qwen25-pc$r.err" | head -3
               grep diag "$out/turns-qwen25-pc$r.err" | grep -vE 'places=([0-9]+) device count=\1 ' | head -5; done
             python3 -c "import json,sys; r=[json.load(open(f))['turns'] for f in sys.argv[1:]]; \
               print('replies alike across runs:', [[t['reply_crc32'] for t in x['kept']] for x in r]); \
               print('markers dropped:', [sum(t['markers_dropped'] for t in x['kept'] + x['whole']) for x in r])" \
               "$out"/turns-qwen25-pc[123].json 2>&1 | tail -2 ;;
      kept) timeout 420 python3 -m pytest tests/test_gpu.py -q -s -p no:cacheprovider -o addopts="" -k "kept or lazy or true_size" \
               2>&1 | grep -v DEBUG > "$out/test_gpu_kept.log"; tail -3 "$out/test_gpu_kept.log"; grep -E "kept vs|^E " "$out/test_gpu_kept.log" | head ;;
      rests) timeout 300 python3 -m pytest tests/test_gpu.py -q -s -p no:cacheprovider -o addopts="" \
               -k "suffix_graph or prompt_graph or long_prompt or replays_its_rests or kept_cache or without_cudnn or reads_nothing_back" 2>&1 | grep -v DEBUG > "$out/test_gpu_rests.log"
             tail -3 "$out/test_gpu_rests.log"; grep -E "vs eager|kept vs|^E " "$out/test_gpu_rests.log" | head ;;
      encoders) for p in qwen3-omni-30b-a3b qwen2.5-omni-7b; do
               timeout 150 python3 scripts/encoder_profile.py $p > "$out/encoder-$p.jsonl" 2> "$out/encoder-$p.err"
               echo "encoder $p rc=$?"; cut -c1-900 "$out/encoder-$p.jsonl"; done ;;
      attend) timeout 200 python3 scripts/attend_bench.py --spans > "$out/attend-spans.jsonl" 2> "$out/attend.err"
             echo "attend rc=$?"; cat "$out/attend-spans.jsonl"; tail -3 "$out/attend.err" ;;
      pprof) (cd scripts && timeout 300 python3 prefill_profile.py --tokens 2500) > "$out/prefill-profile.json" 2> "$out/prefill-profile.err"
             echo "pprof rc=$?"; cut -c1-3000 "$out/prefill-profile.json"; tail -3 "$out/prefill-profile.err" ;;
      pprof60|pprofq|pprofq60)  # bf16 at 60 tokens; int4 at 2,500; int4 at 60
             case $s in pprof60) a="--tokens 60" ;; pprofq) a="--tokens 2500 --quantize int4" ;; *) a="--tokens 60 --quantize int4" ;; esac
             (cd scripts && timeout 300 python3 prefill_profile.py $a) > "$out/prefill-profile-$s.json" 2> "$out/prefill-profile-$s.err"
             echo "$s rc=$?"; cut -c1-3000 "$out/prefill-profile-$s.json"; tail -3 "$out/prefill-profile-$s.err" ;;
      long3) timeout 420 $omni_bench --preset qwen3-omni-30b-a3b --runs 3 --prompt-tokens 2500 \
               --text-tokens 64 --frames 188 --json --no-compile > "$out/qwen3-2500${SUFFIX:-}.json" 2> "$out/qwen3-2500${SUFFIX:-}.err"
             echo "long3 rc=$?"; grep '^\[omni-bench' "$out/qwen3-2500${SUFFIX:-}.err" | tail -4
             python3 scripts/bench_fields.py "$out/qwen3-2500${SUFFIX:-}.json" ;;
      long25) timeout 420 python3 -m omni_cli.faces.bench --preset qwen2.5-omni-7b --runs 3 --prompt-tokens 2500 \
               --no-compile --json > "$out/qwen25-2500.json" 2> "$out/qwen25-2500.err"
             echo "long25 rc=$?"; grep '^\[omni-bench' "$out/qwen25-2500.err" | tail -4 ;;
      moe) timeout 400 python3 -m pytest tests/test_gpu.py -q -s -p no:cacheprovider -o addopts="" \
               -k "routed_experts or qwen3_loop_runs or qwen3_long_prompt or qwen3_tiny or packed or suffix_graph or replays_its_rests or prompt_graph" 2>&1 \
               | grep -v DEBUG > "$out/test_gpu_moe.log"; tail -3 "$out/test_gpu_moe.log"; grep -E "^E " "$out/test_gpu_moe.log" | head ;;
      agraphs) timeout 240 python3 -m pytest tests/test_gpu.py -q -s -p no:cacheprovider -o addopts="" -k "audio_tower or audio_encoder" 2>&1 \
               | grep -v DEBUG > "$out/test_gpu_agraphs.log"; grep -E "vs library|passed|failed|^E " "$out/test_gpu_agraphs.log" | head -12 ;;
      cgraphs) timeout 240 python3 -m pytest tests/test_gpu.py -q -s -p no:cacheprovider -o addopts="" -k "chunk_graphs or qwen3_loop_runs_under_sync or (qwen3_tiny_graphed and plain) or test_tiny_graphed_equals" 2>&1 \
               | grep -v DEBUG > "$out/test_gpu_cgraphs.log"; grep -E "passed|failed|^E " "$out/test_gpu_cgraphs.log" | head -12 ;;
      dit) for side in before now; do
             if [ $side = before ]; then [ -d .ab_before/omni_cli ] || continue; path=$PWD/.ab_before; else path=$PWD; fi
             PYTHONPATH=$path timeout 200 python3 scripts/vocoder_bench.py --codes 250 --runs 3 --profile \
               --json "$out/vocoder-$side.json" > "$out/vocoder-$side.txt" 2>&1
             echo "dit $side rc=$?"; grep -E '"(first_chunk_ms|steady_chunk_ms|utterance_ms|kernels|device_ms)"' "$out/vocoder-$side.txt"
           done ;;
      rope) timeout 120 python3 -m pytest tests/test_gpu.py -q -s -p no:cacheprovider -o addopts="" -k rope_kernel 2>&1 \
               | grep -E "rope vs|passed|failed|^E " | head -8 ;;
      first) timeout 100 python3 scripts/make_random_checkpoint.py /tmp/q7 --preset qwen2.5-omni-7b --device cuda --force \
               > /dev/null 2>&1; echo "folder rc=$?"
             for w in text clip; do [ $w = text ] && a=--text-warm-up || a=""
               timeout 90 python3 scripts/first_replies.py /tmp/q7 $a 2>&1 | grep -E "#[12]:|Error" > "$out/first-replies-$w.txt"
               echo "first_replies ($w warm-up)"; cat "$out/first-replies-$w.txt"; done ;;
      vision) timeout 300 python3 -m pytest tests/test_gpu.py -q -s -p no:cacheprovider -o addopts="" -k vision_tower 2>&1 \
               | grep -v DEBUG > "$out/test_gpu_vision.log"; tail -3 "$out/test_gpu_vision.log"; grep -E "^E " "$out/test_gpu_vision.log" | head ;;
      vbring) for p in qwen2.5-omni-7b qwen3-omni-30b-a3b; do timeout 120 python3 scripts/vision_bring.py --preset $p; done \
               > "$out/vision-bring.jsonl" 2> "$out/vision-bring.err"; cat "$out/vision-bring.jsonl"; tail -2 "$out/vision-bring.err" ;;
      packed) timeout 300 python3 -m pytest tests/test_gpu.py -q -s -p no:cacheprovider -o addopts="" -k packed 2>&1 \
               | grep -v DEBUG > "$out/test_gpu_packed.log"; tail -3 "$out/test_gpu_packed.log"; grep -E "^E " "$out/test_gpu_packed.log" | head ;;
      qmm) timeout 300 python3 scripts/quant_mm_check.py sweep > "$out/quant-mm.jsonl" 2> "$out/quant-mm.err"
             echo "qmm rc=$?"; cat "$out/quant-mm.jsonl"; tail -3 "$out/quant-mm.err" ;;
      qsweep) timeout 420 python3 scripts/quant_gpu.py sweep > "$out/quant-sweep.json" 2> "$out/quant-sweep.err"
             echo "qsweep rc=$?"; grep '^{' "$out/quant-sweep.err" | cut -c1-600; grep -v '^{' "$out/quant-sweep.err" | tail -3 ;;
      qkernels) timeout 300 python3 scripts/quant_gpu.py kernels > "$out/quant-kernels.json" 2> "$out/quant-kernels.err"
             echo "qkernels rc=$?"; cut -c1-500 "$out/quant-kernels.err" | tail -8 ;;
      q3int4|q3fp8|q3bf16|q25int4|q25fp8|q25bf16|q25-3b-int4)
             case $s in q3*) p=qwen3-omni-30b-a3b; unit="--frames 188" ;; q25-3b*) p=qwen2.5-omni-3b; unit="--codes 250" ;;
               *) p=qwen2.5-omni-7b; unit="--codes 250" ;; esac
             q=${s#q3}; q=${q#q25}; q=${q#-3b-}; [ "$q" = bf16 ] && qflag="" || qflag="--quantize $q"
             timeout 400 $omni_bench --preset $p --runs 2 --prompt-tokens 60 --text-tokens 64 $unit \
               --json --no-compile $qflag > "$out/q-$p-$q${SUFFIX:-}.json" 2> "$out/q-$p-$q${SUFFIX:-}.err"
             echo "$s rc=$?"; grep '^\[omni-bench' "$out/q-$p-$q${SUFFIX:-}.err" | tail -4
             python3 scripts/bench_fields.py "$out/q-$p-$q${SUFFIX:-}.json" ;;
      vdtype) timeout 200 python3 scripts/vocoder_dtype.py --codes 250 > "$out/vocoder-dtype.json" 2> "$out/vocoder-dtype.err"
             echo "vdtype rc=$?"; cat "$out/vocoder-dtype.json"; tail -2 "$out/vocoder-dtype.err" ;;
      rt25) served qwen2.5-omni-7b 250 qwen25 ;;
      rt3) served qwen3-omni-30b-a3b 63 qwen3 ;;
      room3) served qwen3-omni-30b-a3b 63 qwen3 cuda room ;;  # rt3's talk room only
      rttiny) served tiny 250 tiny cpu ;;  # the same on the built-in tiny model, on the CPU (a check of the step)
      tests) timeout 420 python3 -m pytest tests/test_gpu.py -q -s -p no:cacheprovider -o addopts="" 2>&1 | grep -v DEBUG > "$out/test_gpu.log"
             tail -3 "$out/test_gpu.log"; grep -E "codes: ref|text eq|talker step|^E " "$out/test_gpu.log" | head -20 ;;
      *) echo "unknown step $s"; exit 2 ;;
    esac
  done
done
