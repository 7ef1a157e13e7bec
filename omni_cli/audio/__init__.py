"""Where audio goes: sinks (speaker, files, stdout WAV, null) and the thread that owns a sink.

It knows 24 kHz float32 blocks, sound devices and file formats; nothing of models or turns.
"""
