"""Speech-like test signals (no recordings of real speech are at hand): voiced syllables made by additive
synthesis, a gliding pitch with its harmonics shaped by two or three formants that change per syllable,
under a syllable envelope of 4-6 Hz, with pauses between words and between phrases; and noise to put
them in at a chosen SNR.

They are what a VAD is built to call speech (periodic, formant-shaped, syllabic), but not speech: no
consonants, no real coarticulation, no breath. Conclusions drawn from them hold for them.
"""

from __future__ import annotations

import numpy as np

# Vowel-ish formant pairs (Hz).
FORMANTS = [(730, 1090), (270, 2290), (530, 1840), (300, 870), (640, 1190), (490, 1350)]


def syllable(seconds: float, rate: int, rng: np.random.Generator, f0: float) -> np.ndarray:
    n = max(1, int(seconds * rate))
    t = np.arange(n) / rate
    glide = f0 * (1 + 0.08 * np.sin(2 * np.pi * rng.uniform(1, 3) * t + rng.uniform(0, 6)))
    phase = 2 * np.pi * np.cumsum(glide) / rate
    f1, f2 = FORMANTS[rng.integers(len(FORMANTS))]
    out = np.zeros(n)
    for k in range(1, int(3800 / f0)):
        freq = k * f0
        gain = np.exp(-((freq - f1) / 120) ** 2) + 0.6 * np.exp(-((freq - f2) / 160) ** 2) + 0.05 / k
        out += gain * np.sin(k * phase)
    env = np.sin(np.pi * np.arange(n) / n) ** 0.6
    return out * env


def utterance(words: int, rate: int = 16000, seed: int = 0, level: float = 0.25, pause: float = 0.12,
              f0: float = 140.0) -> np.ndarray:
    """`words` words of 1-3 syllables (0.12-0.25 s each), `pause` s of silence between words."""
    rng = np.random.default_rng(seed)
    parts = []
    for w in range(words):
        for _ in range(rng.integers(1, 4)):
            parts.append(syllable(rng.uniform(0.12, 0.25), rate, rng, f0 * rng.uniform(0.9, 1.1)))
        if w < words - 1:
            parts.append(np.zeros(int(pause * rate)))
    x = np.concatenate(parts)
    return (level * x / np.max(np.abs(x))).astype(np.float32)


def noise(seconds: float, rate: int = 16000, seed: int = 1, colour: str = "pink") -> np.ndarray:
    """Unit-RMS noise: white, or pink (1/f: closer to a room's hum and fans)."""
    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    white = rng.standard_normal(n)
    if colour == "pink":
        spectrum = np.fft.rfft(white)
        f = np.arange(spectrum.shape[0])
        spectrum[1:] /= np.sqrt(f[1:])
        white = np.fft.irfft(spectrum, n)
    return (white / np.sqrt(np.mean(white ** 2))).astype(np.float32)


def at_snr(speech: np.ndarray, background: np.ndarray, snr_db: float) -> np.ndarray:
    """`speech` plus `background` scaled so that speech power (over its voiced samples) / noise power = snr_db."""
    voiced = speech[np.abs(speech) > 1e-4]
    p_speech = float(np.mean(voiced ** 2)) if voiced.size else 0.0
    scale = np.sqrt(p_speech / 10 ** (snr_db / 10))
    return (speech + scale * background[:speech.shape[0]]).astype(np.float32)
