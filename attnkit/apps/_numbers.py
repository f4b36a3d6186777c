"""French number words and their German translation, from num2words' grammars: ``translate``'s pairs
between two natural languages.

``num2words(n, lang="fr")`` and ``num2words(n, lang="de")`` write each whole number in the
language's own rules (num2words is a registry package; nothing is downloaded). The pair for 97
shows what makes it translation and not transcription: "quatre-vingt-dix-sept" (four twenties,
ten, seven) is "siebenundneunzig" (seven and ninety): the German puts the units first and has one
word for ninety where the French adds three parts. Source tokens are the French words (split at
spaces and hyphens; the hyphens are spelling, not meaning), target tokens German characters
(German writes a number below a million as one word).
"""

from __future__ import annotations

import re
from functools import cache

#: The numbers translated: 1 to :data:`LAST`.
LAST = 9999
#: Every French word and German letter of those numbers (a test checks that they are all).
FRENCH_WORDS = ("cent cents cinq cinquante deux dix douze et huit mille neuf onze quarante quatorze quatre quinze "
                "seize sept six soixante treize trente trois un vingt vingts").split()
GERMAN_CHARS = list("abcdefghilnrstuvwzßöü")
SRC_LEN = 8  # "neuf mille neuf cent quatre-vingt-dix-neuf"
TGT_LEN = 43  # "siebentausendsiebenhundertsiebenundsiebzig" and <eos>


def french(n: int) -> list[str]:
    """``n`` in French words: ``97 -> ["quatre", "vingt", "dix", "sept"]``."""
    from num2words import num2words

    return re.split(r"[ -]", num2words(n, lang="fr"))


def german(n: int) -> str:
    """``n`` in German: ``97 -> "siebenundneunzig"``."""
    from num2words import num2words

    return num2words(n, lang="de")


@cache
def pairs() -> tuple[tuple[tuple[str, ...], str], ...]:
    """``(French words, German text)`` for 1 .. :data:`LAST`, in order (made once, about a second)."""
    return tuple((tuple(french(n)), german(n)) for n in range(1, LAST + 1))
