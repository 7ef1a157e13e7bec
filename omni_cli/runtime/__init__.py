"""The family-free runtime: one turn of thinker and talker steps, streamed.

    engine.py          Engine: a model's steps, run one turn at a time
    beside.py          compiled steps made on a thread of their own while the plain ones serve
    turn.py            a turn's threads (engine, producer, vocoder) and channels
    schedule.py        the decode order on the engine thread (thinker j, then talker k)
    boundary.py        the async output boundary: sampled ids device -> host, off the step path
    detokenize.py      reply ids -> text deltas
    stats.py           a turn's timings and the Reply's stats
    vocoder_worker.py  the vocoder thread's body
    events.py          TurnRequest, TextDelta, AudioBlock, Reply, Done
    channel.py         the bounded channel the threads talk through
    kv_cache.py        static KV cache
    decoder.py         a decoder stack's forward over the static cache (the library's layers)
    fused.py           the fixed-shape one-token step of a stack (dense or MoE), for graphs and compile
    encoders.py        a prompt's audio and image placeholders filled with the thinker's encoders' outputs
    graphs.py          CUDA graphs and torch.compile behind one switch
    sampling.py        sync-free, transformers-exact token selection
    compat.py          the transformers versions' differences

It knows no model family (models/) and no terminal (cli, chat, ui).
"""
