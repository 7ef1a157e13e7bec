"""Audio said to the model (omni_cli/media.py, each family's `audio_inputs`, the thinker's
audio encoder in the prefill, the talker's prompt with the audio positions zeroed): greedy text ids and
codec codes equal to transformers' `generate` given what the checkpoint's own processor
(`Qwen2_5OmniProcessor`) makes of the same clip and text; and `omni-say --audio` from a file and from
stdin, with one-line errors for files that are not audio.

The processor is built without its image and video processors: with no image or video given it reads
only their merge sizes, and the real ones need torchvision, which does not install beside this CPU torch.
Qwen3-Omni the same way (its processor, its encoder's length rule, its talker's `hidden_projection` of
the audio positions). Images (Qwen2.5-Omni): the vision encoder's outputs at the image positions, the
prompt's 3-D M-RoPE positions and the delta the decode steps add, in the thinker and the talker; the
reference's generate is given `thinker_pixel_values` (transformers 5.17's generate hands `pixel_values`
to the talker too, whose generate refuses them). Qwen3-Omni's images are not written yet.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import soundfile
import torch

from conftest import cli_env, run_omni_say
from hf_reference import reference_generate

ASSET = "assets/tiny-qwen2.5-omni"


@pytest.fixture(scope="module")
def assistant():
    import omni_cli

    return omni_cli.load(device="cpu")


def processor(path: str, cls_name: str = "Qwen2_5OmniProcessor"):
    """The checkpoint's processor (Qwen2_5OmniProcessor, Qwen3OmniMoeProcessor), for audio and text (see
    the module docstring)."""
    import transformers
    from transformers import AutoFeatureExtractor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    cls = getattr(transformers, cls_name)
    proc = cls.__new__(cls)
    proc.feature_extractor, proc.tokenizer = AutoFeatureExtractor.from_pretrained(path), tok
    proc.image_processor = SimpleNamespace(merge_size=2)
    proc.video_processor = SimpleNamespace(merge_size=2, temporal_patch_size=2)
    for name in ("image_token", "audio_token", "video_token", "vision_bos_token", "vision_eos_token",
                 "audio_bos_token", "audio_eos_token"):
        setattr(proc, name, getattr(tok, name))
    return proc


def tone(seconds: float, rate: int, hz: float, seed: int = 0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(seed).standard_normal(len(t))
    return (0.3 * np.sin(2 * np.pi * hz * t) + 0.05 * noise).astype(np.float32)


def reference(assistant, clips, text: str | None, n_text: int, n_codes: int):
    """(prompt ids, text ids, codes) of generate on the processor's inputs for the same conversation."""
    proc = processor(ASSET)
    parts = [{"type": "audio"} for _ in clips] + ([{"type": "text", "text": text}] if text else [])
    messages = [{"role": "system", "content": assistant.default_system}, {"role": "user", "content": parts}]
    rendered = proc.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = proc(text=rendered, audio=[c.at().pcm for c in clips], return_tensors="pt", padding=True)
    text_ids, codes = reference_generate(assistant.loaded.model, [], n_text=n_text, n_codes=n_codes,
                                         eos=assistant.engine.eos_ids, inputs=dict(inputs),
                                         repetition_penalty=assistant.thinker_sampling.repetition_penalty)
    return inputs["input_ids"][0].tolist(), text_ids, codes


def seeing_ids(model, call):
    """(what `call()` returns, the prompt ids `model`'s engine got during it)."""
    seen, original = {}, model.engine.stream

    def spy(req):
        seen["ids"] = list(req.input_ids)
        return original(req)

    model.engine.stream = spy
    try:
        return call(), seen["ids"]
    finally:
        model.engine.stream = original


def say_seeing_ids(assistant, text, clips, **options):
    """(the reply, the prompt ids the engine got) for `text` and `clips` through the API."""
    return seeing_ids(assistant, lambda: assistant.say(text or "", audio=clips, greedy=True, seed=0, **options))


@pytest.mark.parametrize("text, clips", [
    ("What is this sound?", [(1.7, 22_050, 220.0)]),  # a clip at another rate, with text
    (None, [(1.1, 16_000, 440.0), (0.6, 48_000, 330.0)]),  # two clips, no text
], ids=["clip-and-text", "two-clips"])
def test_audio_prompt_equals_transformers(assistant, text, clips):
    from omni_cli.media import AudioClip

    clips = [AudioClip(tone(s, r, hz, i), r) for i, (s, r, hz) in enumerate(clips)]
    ref_ids, ref_text, ref_codes = reference(assistant, clips, text, 10, 60)
    assert ref_ids.count(assistant.family.audio_token_id(assistant.loaded.model.config)) > 10  # audio tokens
    reply, ids = say_seeing_ids(assistant, text, clips, max_text_tokens=10, max_codes=60)
    assert ids == ref_ids  # the processor's token layout
    assert reply.text_ids == ref_text
    assert reply.codes == ref_codes and len(reply.codes) > 0


QWEN3 = "assets/tiny-qwen3-omni"


def assert_qwen3_reference(qwen3, inputs: dict, ids: list[int], reply) -> None:
    """Our prompt ids, text ids and every codebook of every frame equal Qwen3's greedy `generate` on the
    processor's `inputs` (10 text tokens, 30 frames)."""
    import warnings

    model, caught = qwen3.loaded.model, {}
    hook = model.code2wav.register_forward_pre_hook(lambda _m, args: caught.setdefault("codes", args[0]))
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sequences, _ = model.generate(
                **inputs, speaker="ethan", thinker_max_new_tokens=10, thinker_eos_token_id=qwen3.engine.eos_ids,
                thinker_do_sample=False, thinker_repetition_penalty=qwen3.thinker_sampling.repetition_penalty,
                talker_do_sample=False, talker_max_new_tokens=31)
    finally:
        hook.remove()
    n = inputs["input_ids"].shape[1]
    assert ids == inputs["input_ids"][0].tolist()
    assert reply.text_ids == sequences[0, n:].tolist()
    assert reply.codes == caught["codes"][0].T.tolist() and len(reply.codes) > 0


@pytest.fixture(scope="module")
def qwen3():
    import omni_cli

    return omni_cli.load(QWEN3, device="cpu")


@pytest.mark.parametrize("text, clips", [
    ("What is this?", [(2.3, 22_050, 220.0)]),  # more than one 100-frame chunk of the encoder
    (None, [(0.7, 16_000, 440.0), (1.3, 44_100, 330.0)]),
], ids=["clip-and-text", "two-clips"])
def test_qwen3_audio_prompt_equals_transformers(qwen3, text, clips):
    """The same for Qwen3-Omni, whose talker reads the audio positions of the user turn through
    `hidden_projection` of the thinker's accepted hidden state (every codebook of every frame compared)."""
    from omni_cli.media import AudioClip

    clips = [AudioClip(tone(s, r, hz, i), r) for i, (s, r, hz) in enumerate(clips)]
    proc = processor(QWEN3, "Qwen3OmniMoeProcessor")
    parts = [{"type": "audio"} for _ in clips] + ([{"type": "text", "text": text}] if text else [])
    rendered = proc.tokenizer.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                                  tokenize=False)
    inputs = proc(text=rendered, audio=[c.at().pcm for c in clips], return_tensors="pt")
    reply, ids = say_seeing_ids(qwen3, text, clips, max_text_tokens=10, max_codes=30)
    assert_qwen3_reference(qwen3, dict(inputs), ids, reply)
    assert reply.stats["audio_in_seconds"] == pytest.approx(sum(c.at().seconds for c in clips))  # heard at 16 kHz
    assert reply.stats["audio_encoder_ms"] > 0


def _history_case(model, path: str, cls_name: str):
    """Two turns: a clip with a question, then a text question. Returns (the processor's inputs for the
    second turn's whole conversation, the second reply, the ids the engine got for it)."""
    from omni_cli.media import AudioClip

    clip = AudioClip(tone(1.2, 22_050, 300.0, 3), 22_050)
    chat = model.conversation()
    first = chat.say("What is this sound?", audio=[clip], greedy=True, seed=0, max_text_tokens=6, max_codes=20)
    kept, _ = chat.history.media()  # kept with its turn, at the encoder's rate
    assert len(kept) == 1 and np.array_equal(kept[0].pcm, clip.at().pcm)
    steps = 60 if cls_name == "Qwen2_5OmniProcessor" else 30  # codes, or Qwen3's frames
    second, ids = seeing_ids(model, lambda: chat.say("And what came before?", greedy=True, seed=0,
                                                     max_text_tokens=10, max_codes=steps))
    proc = processor(path, cls_name)
    messages = ([{"role": "system", "content": model.default_system}] if model.default_system else []) + [
        {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What is this sound?"}]},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And what came before?"},
    ]
    rendered = proc.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = proc(text=rendered, audio=[clip.at().pcm], return_tensors="pt", padding=True)
    return dict(inputs), second, ids


def test_a_clip_said_in_an_earlier_turn_is_heard_again(assistant):
    """A conversation keeps a turn's clip: the next turn's prompt holds it where the processor puts it
    for the whole conversation, and the reply equals transformers' generate on that."""
    inputs, reply, ids = _history_case(assistant, ASSET, "Qwen2_5OmniProcessor")
    assert ids == inputs["input_ids"][0].tolist()
    text_ids, codes = reference_generate(assistant.loaded.model, [], n_text=10, n_codes=60,
                                         eos=assistant.engine.eos_ids, inputs=inputs,
                                         repetition_penalty=assistant.thinker_sampling.repetition_penalty)
    assert reply.text_ids == text_ids
    assert reply.codes == codes and len(codes) > 0


def test_qwen3_hears_an_earlier_turns_clip_again(qwen3):
    inputs, reply, ids = _history_case(qwen3, QWEN3, "Qwen3OmniMoeProcessor")
    assert_qwen3_reference(qwen3, inputs, ids, reply)


def test_a_conversations_clips_and_images_are_made_into_encoder_inputs_once(assistant):
    """Each turn's prompt holds every clip and image said so far; their features are made once, when
    they are new (omni_cli/encoder_inputs.py), and a dropped turn's go with it."""
    from omni_cli.media import AudioClip

    chat = assistant.conversation()
    kw = dict(greedy=True, seed=0, max_text_tokens=3, max_codes=8)
    chat.say("What is this?", audio=[AudioClip(tone(0.9, 16_000, 300.0, 1), 16_000)], **kw)
    kept = assistant._encoder_inputs
    made = kept.clips.made, kept.images.made
    chat.say("And this?", images=[picture(60, 80, 2)], **kw)
    chat.say("Both again?", **kw)
    chat.say("One more sound", audio=[AudioClip(tone(0.5, 16_000, 500.0, 4), 16_000)], **kw)
    assert (kept.clips.made - made[0], kept.images.made - made[1]) == (1, 1)  # turn 4's clip; turn 2's image
    assert len(kept.clips.items) == 2 and len(kept.images.items) == 1
    chat.clear()
    chat.say("hi", audio=[AudioClip(tone(0.5, 16_000, 500.0, 4), 16_000)], **kw)  # the same samples
    assert kept.clips.made - made[0] == 1 and len(kept.clips.items) == 1


@pytest.mark.parametrize("family, path, cls_name", [
    ("qwen2_5_omni", ASSET, "Qwen2_5OmniProcessor"), ("qwen3_omni", QWEN3, "Qwen3OmniMoeProcessor")])
def test_features_made_per_clip_equal_the_processors_where_the_encoder_reads(family, path, cls_name):
    """A clip's features made alone and joined equal the processor's batch on every frame its mask
    keeps: Qwen2.5-Omni's exactly, for every clip; Qwen3-Omni's exactly for the longest clip and, for a
    shorter one, but for its last frame (models/audio_features.py says why)."""
    import importlib

    from omni_cli.encoder_inputs import EncoderInputs
    from omni_cli.media import AudioClip

    fam = importlib.import_module(f"omni_cli.models.{family}")
    clips = [AudioClip(tone(s, 16_000, hz, i), 16_000) for i, (s, hz) in enumerate([(0.73, 250.0), (1.41, 400.0)])]
    extractor = processor(path, cls_name).feature_extractor
    ours, counts = EncoderInputs().audio_inputs(fam, extractor, clips)
    padding = dict(padding="max_length") if family == "qwen2_5_omni" else dict(padding=True, truncation=False)
    theirs = extractor([c.pcm for c in clips], sampling_rate=16_000, return_attention_mask=True,
                       return_tensors="pt", **padding)
    assert ours["feature_attention_mask"].sum(-1).tolist() == theirs["attention_mask"].sum(-1).tolist()
    for i, n in enumerate(ours["feature_attention_mask"].sum(-1).tolist()):
        mine, ref = ours["input_features"][i, :, :n], theirs["input_features"][i, :, :n]
        if family == "qwen3_omni" and n < ours["input_features"].shape[-1]:
            mine, ref = mine[:, :-1], ref[:, :-1]
        torch.testing.assert_close(mine, ref, rtol=0, atol=0)
    assert counts == fam.audio_inputs(extractor, clips)[1] and min(counts) > 0


def test_dropping_old_turns_drops_their_media():
    """`fit` drops the oldest exchanges; their clips' placeholders go with them, and the expansion uses
    the counts of the clips that stayed (the newest)."""
    from omni_cli.prompt import expand_placeholders

    assert expand_placeholders([1, 9, 2, 9, 3], 9, [2, 3]) == [1, 9, 9, 2, 9, 9, 9, 3]
    assert expand_placeholders([1, 2, 9, 3], 9, [2, 3]) == [1, 2, 9, 9, 9, 3]  # the first clip's turn is gone


def test_a_clip_longer_than_the_context_is_one_line(tmp_path):
    clip = tmp_path / "long.wav"
    soundfile.write(clip, tone(40.0, 16_000, 300.0), 16_000)  # 40 s: ~1,000 audio tokens
    r = run_omni_say("--audio", clip, "hi", "-o", tmp_path / "a.wav", env=cli_env())  # the demo model: 4,096
    assert r.returncode == 0, r.stderr  # it fits
    from omni_cli.errors import UsageError

    import omni_cli

    from omni_cli.config import RuntimeOptions

    small = omni_cli.load(device="cpu", runtime=RuntimeOptions(device="cpu", max_context=256))
    with pytest.raises(UsageError, match=r"context holds .*40\.0 s of audio is part of it"):
        small.say("hi", audio=[str(clip)])


def picture(height: int, width: int, seed: int = 0):
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8"))


@pytest.mark.parametrize("text, images, clips", [
    ("What is in it?", [(90, 120)], []),  # one image: a 3x4 grid of merged patches, rope delta -8
    ("And these?", [(60, 80), (100, 70)], [(0.8, 22_050, 250.0)]),  # two images and a clip
], ids=["image", "two-images-and-audio"])
def test_image_prompt_equals_transformers(assistant, text, images, clips):
    from omni_cli.media import AudioClip
    from omni_cli.models.qwen2_5_omni import image_processor

    pictures = [picture(h, w, i) for i, (h, w) in enumerate(images)]
    clips = [AudioClip(tone(s, r, hz, i), r) for i, (s, r, hz) in enumerate(clips)]
    proc = processor(ASSET)
    proc.image_processor = image_processor(ASSET)
    parts = ([{"type": "image"} for _ in pictures] + [{"type": "audio"} for _ in clips]
             + [{"type": "text", "text": text}])
    messages = [{"role": "system", "content": assistant.default_system}, {"role": "user", "content": parts}]
    rendered = proc.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = dict(proc(text=rendered, images=pictures, audio=[c.at().pcm for c in clips] or None,
                       return_tensors="pt", padding=True))
    ids = inputs["input_ids"][0].tolist()
    inputs["thinker_pixel_values"] = inputs.pop("pixel_values")  # see the module docstring
    ref_text, ref_codes = reference_generate(assistant.loaded.model, [], n_text=10, n_codes=60,
                                             eos=assistant.engine.eos_ids, inputs=inputs,
                                             repetition_penalty=assistant.thinker_sampling.repetition_penalty)
    reply, seen = say_seeing_ids(assistant, text, clips or None, images=pictures, max_text_tokens=10, max_codes=60)
    assert seen == ids
    assert reply.text_ids == ref_text
    assert reply.codes == ref_codes and len(reply.codes) > 0
    assert reply.stats["images_in"] == len(pictures) and reply.stats["image_encoder_ms"] > 0


def test_say_image_and_its_errors(tmp_path):
    png = tmp_path / "p.png"
    picture(90, 120).save(png)
    r = run_omni_say("--image", png, "What is this?", "-o", tmp_path / "a.wav", "--verbose", env=cli_env())
    assert r.returncode == 0 and "images in" in r.stderr, r.stderr
    (tmp_path / "not.png").write_bytes(b"not an image")
    r = run_omni_say("--image", tmp_path / "not.png", "hi", "-o", tmp_path / "b.wav", env=cli_env())
    assert r.returncode == 2 and "not an image Pillow can open" in r.stderr and "Traceback" not in r.stderr
    r = run_omni_say("-m", QWEN3, "--image", png, "hi", "-o", tmp_path / "b.wav", env=cli_env())
    assert r.returncode == 0, r.stderr


def test_qwen3_image_prompt_equals_transformers(qwen3):
    """Qwen3-Omni sees: the vision encoder's outputs at the image positions, its deepstack features added
    after the first layers, the 3-D positions and their delta in the thinker and the talker, the talker's
    user rows from hidden_projection at the image positions; all 16 codebooks of every frame compared."""
    from omni_cli.models.qwen3_omni import image_processor

    proc = processor(QWEN3, "Qwen3OmniMoeProcessor")
    proc.image_processor = image_processor(QWEN3)
    pictures = [picture(96, 128)]
    parts = [{"type": "image"}, {"type": "text", "text": "What is this?"}]
    rendered = proc.tokenizer.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                                  tokenize=False)
    inputs = dict(proc(text=rendered, images=pictures, return_tensors="pt"))
    reply, ids = say_seeing_ids(qwen3, "What is this?", None, images=pictures, max_text_tokens=10, max_codes=30)
    assert_qwen3_reference(qwen3, inputs, ids, reply)


def test_say_audio_from_a_file_and_from_stdin(tmp_path):
    clip = tmp_path / "q.flac"
    soundfile.write(clip, np.stack([tone(1.2, 44_100, 300.0)] * 2, axis=1), 44_100)  # stereo FLAC
    out = tmp_path / "a.wav"
    r = run_omni_say("--audio", clip, "What do you hear?", "-o", out, "--seed", "1", env=cli_env())
    assert r.returncode == 0, r.stderr
    assert soundfile.info(out).frames > 0 and r.stdout.strip()
    r = run_omni_say("--audio", "-", "-o", out, "--seed", "1", input=clip.read_bytes(), text=False, env=cli_env())
    assert r.returncode == 0, r.stderr


def written(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("make, says", [
    (lambda d: d / "missing.wav", "does not exist"),
    (lambda d: written(d / "empty.wav", b""), "is empty"),
    (lambda d: written(d / "notes.wav", b"not audio at all"), "not an audio file"),
    (lambda d: d, "is a folder"),
], ids=["missing", "empty", "not-audio", "folder"])
def test_a_file_that_is_not_audio_is_one_line(tmp_path, make, says):
    r = run_omni_say("--audio", make(tmp_path), "hi", "-o", tmp_path / "a.wav", env=cli_env())
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "a.wav").exists()


def test_qwen3_hears_a_file_too(tmp_path):
    clip = tmp_path / "q.wav"
    soundfile.write(clip, tone(0.5, 16_000, 300.0), 16_000)
    r = run_omni_say("-m", QWEN3, "--audio", clip, "hi", "-o", tmp_path / "a.wav", "--verbose", env=cli_env())
    assert r.returncode == 0 and "audio in" in r.stderr and "encoder" in r.stderr, r.stderr
