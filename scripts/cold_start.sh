#!/usr/bin/env bash
# Start-up on a lent GPU machine, measured the way a user meets it (the device tool runs this from the
# repository root; what lands in $OUT comes back). Steps, in the order given:
#   folder    write a true-size random Qwen2.5-Omni-7B folder ($DIR; scripts/make_random_checkpoint.py)
#   pack      omni-quantize $DIR $DIR-int4 --device cuda, then the steps after it use the packed folder
#   fresh     empty omni_cli's bytecode cache (stopping a writer still filling it) and Triton's kernel cache,
#             and drop the page cache if allowed, then omni-say -m $DIR ... --verbose (a first start: nothing compiled yet);
#             it loads the model in a background omni-serve (omni-say's default --keep-alive)
#   fresh-noahead  the same as fresh with OMNI_NO_COMPILE_AHEAD=1 (no workers compiling ahead of the imports)
#   fresh-noread   the same as fresh with OMNI_NO_READ_AHEAD=1 (a packed folder's files not read ahead)
#   again     the same command a second time (answered by that background server)
#   local     omni-say --keep-alive 0 twice: the model loaded in the command itself (first with the
#             background server still holding its copy, then after it is stopped)
#   stop      stop the background server (SIGTERM to the pid in its record)
#   compile   omni-say --compile twice: the compiler's first run, then the persistent cache's
#   serve     omni-serve -m $DIR --no-compile in the background (plain CUDA graphs only), then omni-say
#             three times through it (found on the default address twice, then named by --server), SIGTERM
#   serve-compiled  the same with omni-serve --compile (compiled before it serves)
#   serve-beside    omni-serve -m $DIR (its default: it compiles in the background): omni-say twice while
#             it compiles, then, once its /health says "compiled", three times, SIGTERM
#   audio     a 5 s clip against a text prompt of as many tokens, in one process (scripts/audio_vs_text.py)
# Each omni-say prints its start-up breakdown (--verbose) and is timed from outside with `date`.
#   usage: DIR=/tmp/qwen25-7b bash scripts/cold_start.sh folder fresh again serve audio
set -u
out=${OUT:-/tmp/omni-cold-start}
dir=${DIR:-/tmp/qwen2.5-omni-7b-random}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
say=(python3 -c "from omni_cli.entry_points import say; say()" -m "$dir" "Hello there, how are you today?" --max-codes 250 --max-text-tokens 32
     --seed 0 --verbose)

timed() {  # timed LABEL COMMAND...: run it, print the wall time and its last lines (all in $out/cold_start.log)
  local label=$1; shift
  local t0 t1
  t0=$(date +%s.%N)
  "$@" > /tmp/omni-step.log 2>&1
  local rc=$?
  t1=$(date +%s.%N)
  { echo "== $label: rc=$rc wall $(python3 -c "print(f'{$t1 - $t0:.2f}')") s"; cat /tmp/omni-step.log; } >> "$out/cold_start.log"
  echo "== $label: rc=$rc wall $(python3 -c "print(f'{$t1 - $t0:.2f}')") s"
  grep -vE "^\s*$" /tmp/omni-step.log | tail -22
}

serve() {  # serve [FLAG]: omni-serve -m $dir [FLAG] in the background, omni-say three times through it, SIGTERM
  python3 -c "from omni_cli.entry_points import serve; serve()" -m "$dir" $1 > /tmp/serve.log 2>&1 &
  local pid=$! t0
  t0=$(date +%s.%N)
  for _ in $(seq 1 480); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8484/health', timeout=2)" \
      2>/dev/null && break
    sleep 0.5
  done
  echo "omni-serve $1 ready after $(python3 -c "print(f'{$(date +%s.%N) - $t0:.1f}')") s"; tail -2 /tmp/serve.log
  timed "serve$1-1" "${say[@]}" -o /tmp/serve1.wav
  timed "serve$1-2" "${say[@]}" -o /tmp/serve2.wav
  timed "serve$1-3 (--server)" "${say[@]}" --server http://127.0.0.1:8484 -o /tmp/serve3.wav
  kill -TERM $pid; wait $pid; echo "omni-serve exit $?"; cat /tmp/serve.log >> "$out/cold_start.log"
}

health_steps() {  # what the server's /health says of its steps (plain, compiling, compiled)
  python3 -c "import json, urllib.request as u; print(json.load(u.urlopen('http://127.0.0.1:8484/health', timeout=2))['steps'])" 2>/dev/null
}

serve_beside() {
  python3 -c "from omni_cli.entry_points import serve; serve()" -m "$dir" > /tmp/serve.log 2>&1 &
  local pid=$! t0 i
  t0=$(date +%s.%N)
  for _ in $(seq 1 480); do health_steps > /dev/null && break; sleep 0.5; done
  echo "omni-serve ready after $(python3 -c "print(f'{$(date +%s.%N) - $t0:.1f}')") s; steps: $(health_steps)"
  timed "beside-compiling-1" "${say[@]}" -o /tmp/serve1.wav
  timed "beside-compiling-2" "${say[@]}" -o /tmp/serve2.wav
  echo "steps: $(health_steps)"
  for _ in $(seq 1 1200); do [ "$(health_steps)" = compiled ] && break; sleep 0.5; done
  echo "steps $(health_steps) after $(python3 -c "print(f'{$(date +%s.%N) - $t0:.1f}')") s"; tail -3 /tmp/serve.log
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
  for i in 1 2 3; do timed "beside-compiled-$i" "${say[@]}" -o /tmp/serve$i.wav; done
  kill -TERM $pid; wait $pid; echo "omni-serve exit $?"; cat /tmp/serve.log >> "$out/cold_start.log"
}

stop_background() {  # the server omni-say started (api/keep_alive.py's record), if any
  local rec=${XDG_CACHE_HOME:-$HOME/.cache}/omni_cli/serve/omni-serve.json pid
  [ -f "$rec" ] || return 0
  pid=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['pid'])" "$rec")
  kill -TERM "$pid" 2>/dev/null; while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
  echo "background omni-serve $pid stopped"; cat ${XDG_CACHE_HOME:-$HOME/.cache}/omni_cli/serve/omni-serve-8484.log >> "$out/cold_start.log"
}

for step in "$@"; do
  case $step in
    folder) timed folder python3 scripts/make_random_checkpoint.py "$dir" --preset qwen2.5-omni-7b --device cuda --force
            du -sh "$dir" ;;
    pack) timed pack python3 -c "from omni_cli.entry_points import quantize; quantize()" "$dir" "$dir-int4" --device cuda
          dir="$dir-int4"; say[4]="$dir"; du -sh "$dir" ;;
    fresh|fresh-noahead|fresh-noread) pkill -f "pycache_prefix=" 2>/dev/null; rm -rf "${XDG_CACHE_HOME:-$HOME/.cache}/omni_cli/pycache"
           rm -rf "${TRITON_CACHE_DIR:-$HOME/.triton/cache}"  # Triton's compiled kernels: a fresh machine has none
           sync; if echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; then echo "page cache dropped"; else
             echo "page cache NOT dropped (not allowed here)"; fi
           case $step in
             fresh) timed fresh "${say[@]}" -o /tmp/fresh.wav ;;
             fresh-noahead) OMNI_NO_COMPILE_AHEAD=1 timed fresh-noahead "${say[@]}" -o /tmp/fresh.wav ;;
             fresh-noread) OMNI_NO_READ_AHEAD=1 timed fresh-noread "${say[@]}" -o /tmp/fresh.wav ;;
           esac ;;
    again) timed again "${say[@]}" -o /tmp/again.wav ;;
    local) timed local1 "${say[@]}" --keep-alive 0 -o /tmp/local1.wav
           stop_background
           timed local2 "${say[@]}" --keep-alive 0 -o /tmp/local2.wav ;;
    stop) stop_background ;;
    compile) timed compile1 "${say[@]}" --compile -o /tmp/compile1.wav
             timed compile2 "${say[@]}" --compile -o /tmp/compile2.wav ;;
    serve) serve --no-compile ;;
    serve-beside) serve_beside ;;
    serve-compiled) serve --compile ;;
    audio) timed audio python3 scripts/audio_vs_text.py "$dir" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
