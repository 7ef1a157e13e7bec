"""Where audio goes: sinks and the thread that owns a sink.

    sinks.py        the sink protocol; files (WAV, FLAC, Ogg, Opus, MP3), stdout WAV, tee, null
    speaker.py      the sound device: SpeakerSink, output devices
    sink_thread.py  one thread owns a sink from start to close

It knows 24 kHz float32 blocks, sound devices and file formats; nothing of models or turns.
"""
