"""The one connect step of every face: from the flags to an assistant that answers.

Where the model runs is decided here, once, in this order:
1. `--server URL`: that server (an error if it does not answer or serves another model);
2. an omni-serve on the default address that serves the same model (unless `--local`) and proves it is
   this user's (api/ownership.py: a challenge on /health, before the API key or a prompt is sent);
3. with a keep-alive (`--keep-alive`, default 5 min): a background omni-serve started now, which keeps the
   model loaded for the next command (api/keep_alive.py);
4. else the model loaded in this process.

What a person typed is checked before anything is started or stopped: a model path that does not exist
is a usage error, not a background server that fails (and stops another model's idle one on the way).

The result is a local `Assistant` or a `RemoteAssistant`: the faces use either through
`omni_cli.interface`. Nothing here imports torch on the way to a server; a local load imports it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from ..config import ReplyOptions, RuntimeOptions
from ..errors import UsageError
from .console import loading, model_label
from .program import err_line


@dataclass(frozen=True)
class Where:
    """Where a command's model runs, from its flags (the same fields for omni-say and omni-chat)."""

    # -m: a folder or a hub id; None = $OMNI_MODEL, else the built-in tiny model.
    model: str | None = None
    # How a model loaded here (or in a background server) runs: device, dtype, graphs, compile, context.
    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)
    # --server URL (or $OMNI_SERVER); None = look for an omni-serve on the default address.
    server: str | None = None
    # --api-key (or $OMNI_API_KEY).
    api_key: str | None = None
    # --local: load the model in this process even when a server answers.
    local: bool = False
    # --keep-alive in seconds: a background omni-serve keeps the model that long after the last request;
    # 0 = load it in this process.
    keep_seconds: float = 0.0
    # -q: no notes on stderr.
    quiet: bool = False

    def note(self, text: str) -> None:
        if not self.quiet:
            err_line(f"note: {text}")


def check_model(model: str | None) -> None:
    """A model named by a path that does not exist is a usage error now, before any server is asked,
    started or stopped (a hub id such as Qwen/Qwen2.5-Omni-7B is checked when it is looked up)."""
    if model is None:
        return
    from ..loader import model_name_problem

    problem = model_name_problem(model)
    if problem:
        raise UsageError(problem)


def find_server(where: Where) -> Any | None:
    """The server to use instead of loading the model, or None: `--server URL` (a ServerError if it
    does not answer; the person named it, so it is trusted as it is), else an omni-serve on the default
    address serving the same model and proving it is this user's (said on stderr), unless --local. No
    torch is imported on this path."""
    from ..api.client import RemoteAssistant, find_local_server, model_key

    model = where.model
    remote: Any | None
    if where.server:
        remote = RemoteAssistant.connect(where.server, where.api_key)
        if model is not None and remote.info.get("key") not in (None, model_key(model)) and model != remote.name:
            raise UsageError(f"the server at {remote.url} serves {remote.name}, not {model}: leave out -m, "
                             "or leave out --server to load it here")
        _demo_note(where, remote)
    elif where.local:
        return None
    else:
        remote = find_local_server(model, where.api_key)
        if remote is not None and _other_weights(remote, where):
            remote.close()
            remote = None
        if remote is not None:
            where.note(f"using omni-serve at {remote.url} ({remote.name}); --local loads the model here instead")
            _demo_note(where, remote)
    if remote is not None and not where.quiet:
        _runtime_note(remote, where.runtime)
    return remote


def _other_weights(remote: Any, where: Where) -> bool:
    """Whether the server found on the default address holds the model packed otherwise than --quantize
    asks (int4 against bfloat16): it is not handed to this command, which starts its own (or loads here)."""
    from ..api.keep_alive import served_quantize

    served = served_quantize(remote)
    if served == where.runtime.quantize:
        return False
    where.note(f"the omni-serve at {remote.url} holds {served or 'unpacked'} weights, not the "
               f"{where.runtime.quantize or 'unpacked'} ones asked for: not using it")
    return True


def load(where: Where, err: Any, t_command: float, before: str) -> Any:
    """The model loaded for this command: in a background omni-serve when a keep-alive is asked for (and
    the default port is free for it), else in this process. `err`: the console the spinner goes to;
    `before`: what the time until loading began is called in `--verbose`'s start-up block."""
    if where.keep_seconds > 0:
        remote = _background_server(where, err, t_command)
        if remote is not None:
            return remote
    return _timed_load(where, err, t_command, before)


def load_here(where: Where, err: Any) -> Any:
    """omni_cli.load() under a spinner that names the model (not with quiet: then only the library's
    warnings get through)."""
    import omni_cli

    from ..bytecode import write_bytecode_later

    with loading(err, model_label(where.model), enabled=not where.quiet) as progress:
        assistant = omni_cli.load(where.model, runtime=where.runtime, progress=progress)
    write_bytecode_later()  # the first start's bytecode, now that torch and transformers are imported
    return assistant


def _timed_load(where: Where, err: Any, t_command: float, before: str) -> Any:
    """`load_here`, with the assistant's `startup` (`--verbose`) counted from `t_command`: `before` names
    the time until loading began, then importing torch and the engine, then the loader's own phases."""
    t_load = time.perf_counter()
    assistant = load_here(where, err)
    took = time.perf_counter() - t_load
    phases = dict(assistant.startup or {})
    assistant.startup = {before: t_load - t_command, "import torch and the engine": took - sum(phases.values()),
                         **phases}
    return assistant


def _runtime_note(remote: Any, asked: RuntimeOptions) -> None:
    """A note when the server runs the model otherwise than this command's flags ask: they would apply to
    a model loaded here (--local). Only what differs from the defaults is compared (auto asks nothing);
    a server that does not say how it runs (an older omni-serve, vLLM-Omni) gets no note."""
    from ..config import RuntimeOptions
    from ..loader import canonical_dtype

    try:
        served = RuntimeOptions.from_json(remote.info.get("runtime"))
    except (ValueError, TypeError):
        return
    differ = []
    where = served.device
    device, dtype = asked.device, asked.dtype
    if device != "auto" and where != "auto" and device != (where if ":" in device else where.split(":")[0]):
        differ.append(f"--device {device}")
    if dtype != "auto" and served.dtype != "auto" and canonical_dtype(dtype) != served.dtype:
        differ.append(f"--dtype {dtype}")
    if not asked.graphs and served.graphs:
        differ.append("--no-graphs")
    if asked.compile and not served.compile:
        differ.append("--compile")
    if asked.quantize is not None and asked.quantize != served.quantize:
        differ.append(f"--quantize {asked.quantize}")
    if differ:
        how = f"on {where} in {served.dtype}" + (
            ", compiled" if served.compile else " with plain CUDA graphs" if served.graphs else ", eagerly")
        err_line(f"note: the server runs the model {how}: {' '.join(differ)} would apply to a model loaded here "
                 "(--local)")


def _demo_note(where: Where, remote: Any) -> None:
    """What the loader would have said of a built-in tiny model, which a server's client does not load:
    that no model was given (and how to give one), or, for `-m` naming a built-in model, only what it is."""
    if not remote.is_demo:
        return
    from ..loader import demo_notice

    where.note(demo_notice(where.model, remote.name))


def _background_server(where: Where, err: Any, t_command: float) -> Any | None:
    """The keep-alive (api/keep_alive.py): the model loaded by a background omni-serve, or None where the
    default port is another server's (then this process loads it, and the note says why)."""
    from ..api.keep_alive import start_server

    t_start = time.perf_counter()
    # The server runs the model as this command would: the one runtime object, as omni-serve's flags. Without
    # --compile it never compiles: compiling in the background (omni-serve's default) would slow the next
    # commands, which come soon after (7B on an H200: first audio 1.5-3.8 s while it compiles).
    flags = where.runtime.to_argv()
    with loading(err, f"{model_label(where.model)} in a background omni-serve", enabled=not where.quiet):
        remote = start_server(where.model, flags, where.keep_seconds, where.api_key,
                              note=lambda text: where.note(text), quantize=where.runtime.quantize)
    if remote is None:
        return None  # the note said why
    _demo_note(where, remote)
    remote.startup = {"before the server (prompt, outputs, voice)": t_start - t_command,
                      "start omni-serve in the background, until it serves": time.perf_counter() - t_start}
    # The server's own start, as it counted it (omni-serve serves it in its model info): "of which" rows.
    for phase, seconds in (remote.info.get("startup") or {}).items():
        remote.startup[f"  {phase}"] = seconds
    return remote


def voice_for(options: ReplyOptions, where: Where, assistant: Any | None = None) -> ReplyOptions:
    """`options` with its voice checked: against a server's voices when `assistant` is one, else against
    the model's (spk_dict.pt or config.json, read without torch) before it loads, so an unknown voice is
    a usage error in a fraction of a second, not after loading. None stays None: the model's default."""
    if options.voice is None:
        return options
    from ..loader import check_voice, model_voices

    if assistant is not None:
        voices = list(assistant.voices)
        return replace(options, voice=check_voice(voices, options.voice)) if voices else options
    # The load that follows gives the demo notice; said twice it would be noise.
    return replace(options, voice=check_voice(model_voices(where.model, notice=False), options.voice))
