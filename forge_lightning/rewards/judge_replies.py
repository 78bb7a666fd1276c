"""Reading an LLM judge's reply as a score (rewards/judge.py): a yes or a no, or the number the
judge gives, in the units of the scale its template asks for.

The judge's own words about the scale ("On a scale of 0 to 10, I give it 3.", "from 1 to 10") are
never the score; they say what a number is out of. Where the number says it too ("4/5", "8.5 out
of 10") and the template names its scale ("from 0 (useless) to 10 (perfect)"), the number is
put in the template's units (4/5 on a 0-10 template is 8.0), and a number outside the template's
scale is no score. A reply with no number left, or one out of range, is no score (None): the
judge's sample is then an error, never 0.
"""

from __future__ import annotations

import re

_NUMBER = r"[-+]?(?:\d+(?:\.\d+)?|\.\d+)"
# A scale named in words: "scale of 0 to 10", "scale from 1-5", "from 0 (useless) to 10
# (perfect)", "between 1 and 10", "(1-10)". Groups: its bottom and its top.
_ASIDE = r"(?:\s*\([^)\d]*\))?"
_SCALE = re.compile(
    rf"(?:\b(?:scale|range)\s+(?:of\s+|from\s+)?|\bfrom\s+|\bbetween\s+|\()"
    rf"({_NUMBER}){_ASIDE}\s*(?:to|and|-|–|—)\s*({_NUMBER}){_ASIDE}\)?",
    re.IGNORECASE,
)
# Where the score is, first found first: a number named the score ("Score: 7", "Rating - 8.5"),
# one the judge gives ("I give it 3", "I'd rate it a 6"), else the first number.
_GIVEN = (
    re.compile(rf"\b(?:score|rating|grade|verdict)\b[^0-9\n]{{0,25}}?({_NUMBER})", re.IGNORECASE),
    re.compile(
        rf"\b(?:rate[sd]?|give[sn]?|giving|award(?:s|ed)?)\b[^0-9\n]{{0,25}}?({_NUMBER})", re.IGNORECASE
    ),
    re.compile(f"({_NUMBER})"),
)
# What a number is out of, right after it: "/10", "**/10", " / 10", " out of 10"; or "%" (100).
_OUT_OF = re.compile(r"\s*\**\s*(?:/|out\s+of)\s*\**\s*(\d+(?:\.\d+)?)|\s*(%)", re.IGNORECASE)
_YES_NO = {"yes": 1.0, "no": 0.0}


def read_score(reply: str, scale: tuple[float, float] | None = None) -> float | None:
    """A judge's reply as a score: 1.0 or 0.0 where its first word is yes or no (any case, any
    punctuation after it); else the number it gives (module docstring: a labelled one, ``"Score:
    7"``, ``"I give it 3"``, before the first other number), put in ``scale``'s units (the
    template's ``(bottom, top)``; None: as written) where it says what it is out of. None when it
    has none, or (with ``scale``) one outside it."""
    words = reply.strip().split(maxsplit=1)
    first = words[0].strip(".,:;!?\"'*").lower() if words else ""
    if first in _YES_NO:
        return _YES_NO[first]
    text, reply_top = _without_scales(reply)
    found = next((match for pattern in _GIVEN if (match := pattern.search(text))), None)
    if found is None:
        return None
    number = float(found.group(1))
    top = _out_of(text, found.end()) or reply_top
    if top is not None and not 0 <= number <= top:
        return None
    return _in_units(number, top, scale)


def template_scale(template: str) -> tuple[float, float] | None:
    """The ``(bottom, top)`` of the scale ``template`` asks for (``"from 0 (useless) to 10"``,
    ``"on a scale of 1 to 5"``); None where it names none."""
    found = _SCALE.search(template)
    if found is None:
        return None
    bottom, top = float(found.group(1)), float(found.group(2))
    return (bottom, top) if bottom < top else None


def _without_scales(reply: str) -> tuple[str, float | None]:
    """``reply`` with the scales it names blanked out, and the top of the first (None: none)."""
    found = _SCALE.search(reply)
    top = float(found.group(2)) if found else None
    return _SCALE.sub(" ", reply), top


def _out_of(text: str, end: int) -> float | None:
    """What the number that ends at ``end`` says it is out of ("/10", "out of 10", "%"); None: nothing."""
    found = _OUT_OF.match(text, end)
    if found is None:
        return None
    return 100.0 if found.group(2) else float(found.group(1))


def _in_units(number: float, top: float | None, scale: tuple[float, float] | None) -> float | None:
    """``number`` (out of ``top``, where the reply says) in ``scale``'s units; None outside it."""
    if scale is None:
        return number
    if top is not None and top != scale[1]:
        number = number / top * scale[1]
    return number if scale[0] <= number <= scale[1] else None
