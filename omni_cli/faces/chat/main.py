"""omni-chat: a conversation with the model in the terminal (`>>>` prompts, replies in text and speech,
slash commands; a piped script drives the same loop).

The flags map onto the options objects; `connect` gives the assistant (a server, a background server
kept alive, or a model loaded here); the loop is `ChatRepl` (loop.py). An open chat holds its server
(a keep-alive does not stop it under the person) and lets it go when the chat ends.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ...config import ReplyOptions
from .. import connect
from ..console import consoles, isatty, print_audio_devices, print_text, safe_text_streams
from ..options import (
    ApiKeyOpt, AttentionKernelOpt, AudioDeviceOpt, CompileOpt, DebugOpt, DeviceOpt, DtypeOpt, GraphsOpt, GreedyOpt, KeepAliveOpt, KernelsOpt, QuantizeOpt, GroupSizeOpt,
    BargeInOpt, EndSilenceOpt, HeadphonesOpt, TalkOpt, VadModelOpt, listen_options,
    ListDevicesOpt, LocalOpt, MaxCodesOpt, MaxContextOpt, MaxTextOpt, ModelOpt, OneLineErrors, SeedOpt, ServerOpt,
    TemperatureOpt, TopKOpt, TopPOpt, VerboseOpt, VersionOpt, VoiceOpt, make_app, runtime_options, where_from_flags,
)
from ..program import end_on_signals, exit_on, report_library_logs, run

chat_app = make_app(
    "omni-chat",
    "Talk with a local Qwen-Omni model (Qwen2.5-Omni or Qwen3-Omni): type a message, read and hear the reply.")


@chat_app.command(cls=OneLineErrors)
def chat(
    model: ModelOpt = None,
    voice: VoiceOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    graphs: GraphsOpt = True,
    compile: CompileOpt = False,
    kernels: KernelsOpt = True,
    quantize: QuantizeOpt = None,
    group_size: GroupSizeOpt = None,
    attention_kernel: AttentionKernelOpt = True,
    seed: SeedOpt = None,
    greedy: GreedyOpt = False,
    temperature: TemperatureOpt = None,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    max_text_tokens: MaxTextOpt = None,
    max_codes: MaxCodesOpt = None,
    max_context: MaxContextOpt = 4096,
    system: Annotated[Optional[str], typer.Option("--system", metavar="TEXT", show_default=False, help="System prompt (default: the model's own: Qwen2.5-Omni's, which it needs to speak; none for Qwen3-Omni).")] = None,
    mute: Annotated[bool, typer.Option("--mute", help="Start muted: replies in text only (/unmute to hear them).")] = False,
    audio_device: AudioDeviceOpt = None,
    list_audio_devices: ListDevicesOpt = False,
    server: ServerOpt = None,
    api_key: ApiKeyOpt = None,
    local: LocalOpt = False,
    keep_alive: KeepAliveOpt = "5m",
    input_device: Annotated[Optional[str], typer.Option("--input-device", metavar="NAME|INDEX", show_default=False, help="The microphone /listen records from (see --list-audio-devices). Default: the system's default input.")] = None,
    input_rate: Annotated[Optional[int], typer.Option("--input-rate", min=8000, max=384000, metavar="HZ", show_default=False, help="The rate /listen records at (default: the device's own).")] = None,
    vad: Annotated[bool, typer.Option("--vad/--no-vad", help="/listen ends the turn when you stop speaking (voice-activity detection); --no-vad: only Enter or the length limit end it.")] = True,
    talk: TalkOpt = False,
    headphones: HeadphonesOpt = False,
    vad_model: VadModelOpt = "webrtc",
    barge_in_ms: BargeInOpt = 300,
    end_silence_ms: EndSilenceOpt = 800,
    history_file: Annotated[Optional[Path], typer.Option("--history-file", metavar="FILE", show_default=False, dir_okay=False, help="Where the input history is kept (default: ~/.local/share/omni-cli/chat_history).")] = None,
    no_history: Annotated[bool, typer.Option("--no-history", help="Keep no input history on disk (so does OMNI_NOHISTORY=1).")] = False,
    load: Annotated[Optional[Path], typer.Option(
        "--load", metavar="PATH", show_default=False, dir_okay=False,
        help="Resume a conversation saved with /save (PATH or PATH.json): its history is the model's context. "
        "A regular file of at most 16 MiB.")] = None,
    verbose: VerboseOpt = False,
    debug: DebugOpt = False,
    version: VersionOpt = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No notes on stderr (errors and the replies still).")] = False,
) -> None:
    """Chat with the model: >>> prompts, replies in text and speech, /? for the commands, Ctrl-D to leave."""
    import time

    t_command = time.perf_counter()
    safe_text_streams()
    end_on_signals()
    report_library_logs(quiet)
    held = None
    try:
        if list_audio_devices:
            print_audio_devices()
            return
        # One options object from the flags, checked before the model loads (a bad --top-p is exit 2 now).
        listen = listen_options(input_device, headphones, vad_model, barge_in_ms, end_silence_ms)
        options = ReplyOptions(voice=voice, seed=seed, greedy=greedy, max_text_tokens=max_text_tokens,
                               max_codes=max_codes, temperature=temperature, top_p=top_p, top_k=top_k).check()
        where = where_from_flags(model, runtime_options(device, dtype, graphs, compile, max_context, kernels, attention_kernel, quantize=quantize, group_size=group_size), server,
                                 api_key, local, keep_alive, quiet)
        from ...audio.speaker import SpeakerSink
        from .loop import CHAT_PLAY_HINT, ChatRepl, line_reader

        if not mute:
            SpeakerSink(audio_device, hint=CHAT_PLAY_HINT)  # PortAudio and a device, before loading
        out, err = consoles()
        assistant = connect.find_server(where)
        loaded_now = assistant is None  # a model loaded for this chat has not replied yet (a found server has)
        if assistant is None:
            options = connect.voice_for(options, where)
            assistant = connect.load(where, err, t_command, "before loading")
        if assistant.url is not None:
            options = connect.voice_for(options, where, assistant)
            served = assistant.info.get("max_context")
            if served and served != max_context:
                where.note(f"the server keeps {served} tokens of conversation, not the {max_context} of --max-context "
                           "(--local loads the model here with yours)")
            from ...api.keep_alive import hold

            held = hold(assistant.url)  # a server that stops when idle stays while this chat is open
        if loaded_now and isatty(sys.stdin) and isatty(sys.stdout):
            # while the person types (a background server made none: --no-warm-up): the first reply is then
            # as quick as the next
            assistant.warm_up(background=True)

        def speaker():
            sink = SpeakerSink(audio_device, hint=CHAT_PLAY_HINT)
            sink.open(assistant.sample_rate)
            return sink

        from ...audio.microphone import RecordOptions

        repl = ChatRepl(assistant, out, err, options=options, muted=mute, system=system,
                        speaker=speaker, verbose=verbose, debug=debug,
                        record=RecordOptions(device=input_device, sample_rate=input_rate, vad=vad), listen=listen)
        if load is not None:
            repl.load_transcript(load)  # an OmniError (one line, exit 2) for a file that is not a transcript
        if talk:
            repl.command("/talk")  # an error is one line; the session goes on at the prompt
        if isatty(sys.stdin) and isatty(sys.stdout):
            code = _chat_in_terminal(repl, err, assistant, history_file, no_history)
        else:
            code = repl.run(line_reader())
    except BaseException as exc:  # noqa: BLE001
        if isinstance(exc, (SystemExit, typer.Exit)):
            raise
        exit_on(exc, debug)
    finally:
        if held is not None:
            held.release()  # the server may stop when idle again, or serve another model's command at once
    raise typer.Exit(code)


def _chat_in_terminal(repl, err, assistant, history_file, no_history) -> int:
    from prompt_toolkit.patch_stdout import patch_stdout

    from .history import default_history_file, history_disabled_by_env, make_history, make_session

    path = None if (no_history or history_disabled_by_env()) else (history_file or default_history_file())
    session = make_session(make_history(path, lambda m: print_text(err, m, style="yellow")))
    where = assistant.model_info.where
    sound = "muted" if repl.muted else f"voice {repl.voice}"
    # The model's name and where it runs may be a server's words: text, never markup or control characters.
    print_text(err, f"{assistant.name}{f' on {where}' if where else ''} · {sound} · /? for help · Ctrl-D to leave",
               style="dim")

    def read(prompt: str) -> str:
        # While the prompt is on screen, output from other threads goes above it (patch_stdout). A
        # reply is written straight to the terminal once the prompt is gone: no proxy delay.
        with patch_stdout(raw=True):
            return session.prompt(prompt)

    return repl.run(read)



def main() -> None:
    """The `omni-chat` program."""
    run(chat_app, "omni-chat")


if __name__ == "__main__":
    main()
