"""A small toolkit for building tiny Qwen-family checkpoints: a byte-level BPE trained on a fixed English
text, a Qwen2-style fast tokenizer around it (special tokens, chat template), the Qwen-Omni chat template
and Whisper feature block both families share, the legacy tokenizer files real folders carry, and two
weight helpers (the ids of unprintable byte tokens; a seeded "stop" row).

Used by the tiny-model generators (omni_dev/tiny_qwen2_5.py, scripts/make_tiny_qwen3_omni.py) and the
tests; never by the omni_cli package. Deterministic: the same inputs give the same files. It knows no
model family. tokenizers and torch are imported inside the functions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


CORPUS = """
Hello! How are you today? I am fine, thank you. What can I do for you?
The user asks a question and the assistant answers it in text and in speech.
You are a helpful assistant. Please answer the question of the user in a short and clear way.
The weather is nice today: the sun is shining and there is a light wind from the west.
Tomorrow it will rain in the morning, and in the afternoon the clouds will go away.
She reads a book in the garden while the children play with a red ball near the old tree.
We listen to music, we talk about our day, and then we cook dinner together at home.
A voice assistant listens to what you say, thinks about it, and speaks back to you.
The model turns text into sound: first it writes the words, then it says them out loud.
Numbers like 1, 2, 3, 10, 42 and 2025 are written one digit at a time.
Can you tell me the time? It is half past seven in the evening.
Please play some quiet music and turn off the lights in the kitchen.
What is the capital of France? The capital of France is Paris.
Why is the sky blue? Sunlight is scattered by the air, and blue light is scattered the most.
Thank you for your help. You are welcome; have a good night and sleep well.
The user said hello, and the assistant said hello back to the user.
Sorry, I did not understand that. Could you say it again, please?
This is a small test of the system. Everything is working as it should.
I think that the best way to learn is to try, to fail, and to try again.
The train leaves at nine and arrives in the city before noon.
Here is a list: apples, bananas, bread, milk, eggs, and a little cheese.
Speech is made of sounds, sounds are made of waves, and waves can be drawn as numbers.
When the user stops talking, the assistant starts to answer right away.
Good morning! Good afternoon! Good evening! See you later, and take care.
system
You are a friendly voice assistant that answers briefly.
user
Which planet is the largest in our solar system?
assistant
Jupiter is the largest planet; it is a giant made mostly of hydrogen and helium.
user
How do I boil an egg?
assistant
Put the egg in boiling water for about nine minutes, then cool it under cold water.
user
Translate "good night" into German, please.
assistant
In German you say "Gute Nacht".
Mountains, rivers, forests and deserts cover the surface of our beautiful planet.
My favourite colours are green, yellow, purple and orange; what are yours?
Every morning he drinks coffee, checks the news, and walks the dog around the park.
Computers store information as bits, and programs tell them exactly what to compute.
The doctor said that rest, water, and fresh vegetables would help me recover quickly.
Birds sing, bees buzz, frogs croak, and owls hoot quietly during the long summer nights.
Could you remind me to call my mother on Sunday afternoon at three o'clock?
The library opens at eight, closes at six, and is quiet except for whispering students.
If you mix blue and yellow paint, you get green; mixing red and white gives pink.
Scientists measure temperature in degrees, distance in metres, and weight in kilograms.
"""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1))
    printable += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _pretokenize(text: str) -> list[str]:
    """Split like Qwen2's pre-tokenizer, then map bytes to the byte-level alphabet."""
    from tokenizers import Regex, pre_tokenizers

    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return [piece for piece, _ in pre.pre_tokenize_str(text)]


def train_bpe(corpus: str, size: int) -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    """A deterministic byte-level BPE of `size` entries trained on `corpus` (pure Python). Shared by the
    tiny checkpoints of both families (scripts/make_tiny_qwen3_omni.py trains on its own corpus)."""
    byte_map = _bytes_to_unicode()
    order = sorted(range(256), key=lambda b: (ord(byte_map[b]) >= 256, ord(byte_map[b])))
    vocab = {byte_map[b]: i for i, b in enumerate(order)}
    counts: dict[tuple[str, ...], int] = {}
    for piece in _pretokenize(corpus):
        counts[tuple(piece)] = counts.get(tuple(piece), 0) + 1
    words = [list(w) for w in sorted(counts)]
    freq = [counts[tuple(w)] for w in words]
    pairs: dict[tuple[str, str], int] = {}
    for w, n in zip(words, freq):
        _count_pairs(pairs, w, n)
    merges: list[tuple[str, str]] = []
    while len(vocab) < size:
        if not pairs:
            raise RuntimeError("tiny BPE corpus too small for the vocabulary size")
        best = min(pairs, key=lambda p: (-pairs[p], p))  # most frequent; ties: smallest pair
        merges.append(best)
        vocab["".join(best)] = len(vocab)
        for i, (w, n) in enumerate(zip(words, freq)):
            if best[0] in w and best[1] in w:
                merged = _merge_word(w, best)
                if merged != w:
                    _count_pairs(pairs, w, -n)
                    _count_pairs(pairs, merged, n)
                    words[i] = merged
    return vocab, tuple(merges)


def _count_pairs(pairs: dict[tuple[str, str], int], word: list[str], n: int) -> None:
    for pair in zip(word, word[1:]):
        left = pairs.get(pair, 0) + n
        if left:
            pairs[pair] = left
        else:
            del pairs[pair]


def _merge_word(word: list[str], pair: tuple[str, str]) -> list[str]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def _backend_tokenizer(vocab: dict[str, int], merges, special_tokens) -> Any:
    """The `tokenizers.Tokenizer`: Qwen2's pipeline over a tiny BPE, specials appended in real order."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(
        BPE(
            vocab=dict(vocab),
            merges=list(merges),
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    for name, special in special_tokens:
        token = AddedToken(name, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    return tok


def qwen2_tokenizer(bpe, special_tokens, chat_template: str, model_specific: dict[str, str],
                    model_max_length: int):
    """A tiny `Qwen2TokenizerFast` (the class both Qwen-Omni families use): the trained `bpe` (vocab,
    merges), then `special_tokens` ((name, special) in id order, the first being <|endoftext|>, ids
    from the BPE's size on), the family's names for its multimodal tokens and its chat template."""
    from transformers import Qwen2TokenizerFast

    vocab, merges = bpe
    tok = Qwen2TokenizerFast(
        tokenizer_object=_backend_tokenizer(vocab, merges, special_tokens),
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=[n for n, special in special_tokens[1:] if special],
        model_max_length=model_max_length,
        chat_template=chat_template,
        errors="replace",
        split_special_tokens=False,
        **model_specific,
    )
    for i, (name, _) in enumerate(special_tokens):
        got = tok.convert_tokens_to_ids(name)
        if got != len(vocab) + i:
            raise RuntimeError(f"tiny tokenizer: {name} got id {got}, expected {len(vocab) + i}")
    return tok


def save_legacy_tokenizer_files(folder: Path, tokenizer, bpe, special_tokens) -> None:
    """vocab.json, merges.txt and special_tokens_map.json, which real Qwen folders carry beside tokenizer.json."""
    vocab, merges = bpe
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    lines = ["#version: 0.2"] + [f"{a} {b}" for a, b in merges]
    (folder / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    special = {
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "additional_special_tokens": [n for n, special in special_tokens[1:] if special],
    }
    text = json.dumps(special, indent=2, ensure_ascii=False) + "\n"
    (folder / "special_tokens_map.json").write_text(text, encoding="utf-8")


def unprintable_byte_ids(vocab: dict[str, int]) -> list[int]:
    """Ids in a byte-level BPE `vocab` of the single-byte tokens other than printable ASCII, space and
    newline (a head that never emits them prints no control characters or U+FFFD)."""
    byte_map = _bytes_to_unicode()
    keep = set(range(0x20, 0x7F)) | {0x0A}
    return sorted(vocab[byte_map[b]] for b in range(256) if b not in keep)


def stop_row(weight, seed: int):
    """A fresh row with the same scale as the head `weight`'s ordinary rows."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randn(weight.shape[1], generator=gen) / weight.shape[1] ** 0.5


def folder_size(folder: str | Path) -> int:
    """Total bytes of the files under a folder."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def chat_template(audio: str, image: str, video: str, default_system: str | None = None) -> str:
    """A Qwen-Omni chat template: `<|im_start|>role\n...<|im_end|>\n` turns, content parts rendered as text
    or as a family's placeholder for an audio / image / video part (e.g. "<|audio_bos|><|AUDIO|><|audio_eos|>"),
    and the assistant opener as the generation prompt. `default_system`: a system turn put first when the
    conversation has none (Qwen2.5-Omni's template does that; Qwen3-Omni's does not)."""
    system = ("{% if loop.first and message['role'] != 'system' %}"
              "<|im_start|>system\n" + default_system + "<|im_end|>\n"
              "{% endif %}") if default_system is not None else ""
    return (
        "{% for message in messages %}"
        + system
        + "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}"
        "{{ message['content'] }}"
        "{% else %}"
        "{% for part in message['content'] %}"
        "{% if part['type'] == 'text' %}{{ part['text'] }}"
        "{% elif part['type'] in ('audio', 'audio_url') %}" + audio
        + "{% elif part['type'] in ('image', 'image_url') %}" + image
        + "{% elif part['type'] in ('video', 'video_url') %}" + video
        + "{% endif %}"
        "{% endfor %}"
        "{% endif %}"
        "<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


# The audio side of a Qwen-Omni `preprocessor_config.json` (transformers' WhisperFeatureExtractor at
# 16 kHz, 128 mel bins), the same in both families; each adds its processor class (and image keys).
WHISPER_FEATURES: dict[str, Any] = {
    "chunk_length": 300,
    "dither": 0.0,
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 128,
    "hop_length": 160,
    "n_fft": 400,
    "n_samples": 4800000,
    "nb_max_frames": 30000,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
    "sampling_rate": 16000,
}
