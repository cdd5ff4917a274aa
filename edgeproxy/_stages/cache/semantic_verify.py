"""The semantic cache's verifier: between "similar" and "hit".

An embedding sees that "enable two-factor authentication" and "disable two-factor
authentication" are about the same thing; it cannot see that their answers are
opposite. A candidate above the similarity threshold is served only if none of these
rules finds a difference, each of which changes an answer while barely moving an
embedding:

* **negation**: the negators each side uses (not, no, never, without, ...), contractions
  expanded first;
* **antonym and direction pairs**: enable/disable, upload/download, ascending/descending,
  to/from, increase/decrease, before/after, min/max, ...: a side using one member of a
  pair where the other uses the other, or only one side naming the pair at all;
* **numbers**: every number, with the unit or percent sign after it (number words read as
  digits), as a multiset;
* **names**: words capitalised in mid-sentence, acronyms, identifiers (digits,
  underscores, dots, camelCase), quoted strings and e-mail addresses: each must appear in
  the other side too, case aside;
* **language**: the languages named (translate into French, answer in Spanish);
* **format**: the shape asked for (word, sentence, paragraph, bullet, list, table, JSON,
  YAML, CSV, code, poem...).

It errs on the side of a miss: a paraphrase it rejects costs one upstream call; a near
miss it passed would serve a wrong answer.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Final

__all__ = ["differences"]

_CONTRACTIONS: Final = (
    (re.compile(r"\bcan't\b|\bcannot\b"), "can not"),
    (re.compile(r"\bwon't\b"), "will not"),
    (re.compile(r"\bshan't\b"), "shall not"),
    (re.compile(r"n't\b"), " not"),
)
_NEGATORS: Final = frozenset(
    {"not", "no", "never", "without", "none", "nothing", "neither", "nor", "nobody", "nowhere"}
)
_PAIRS: Final = (
    ("enable", "disable"),
    ("enabled", "disabled"),
    ("enabling", "disabling"),
    ("on", "off"),
    ("upload", "download"),
    ("uploading", "downloading"),
    ("ascending", "descending"),
    ("asc", "desc"),
    ("increase", "decrease"),
    ("increasing", "decreasing"),
    ("before", "after"),
    ("min", "max"),
    ("minimum", "maximum"),
    ("smallest", "largest"),
    ("lowest", "highest"),
    ("first", "last"),
    ("add", "remove"),
    ("install", "uninstall"),
    ("encrypt", "decrypt"),
    ("encode", "decode"),
    ("import", "export"),
    ("open", "close"),
    ("start", "stop"),
    ("lock", "unlock"),
    ("show", "hide"),
    ("allow", "deny"),
    ("accept", "reject"),
    ("push", "pull"),
    ("buy", "sell"),
    ("left", "right"),
    ("in", "out"),
    ("north", "south"),
    ("east", "west"),
    ("above", "below"),
    ("inside", "outside"),
    ("more", "less"),
    ("better", "worse"),
    ("pros", "cons"),
    ("advantages", "disadvantages"),
    ("true", "false"),
    ("input", "output"),
    ("client", "server"),
    ("celsius", "fahrenheit"),
    ("to", "from"),
    ("into", "from"),
)
_DIRECTIONAL: Final = {word: pair for pair in _PAIRS for word in pair}
_NUMBER_WORDS: Final = {
    word: str(i)
    for i, word in enumerate(
        "zero _ two three four five six seven eight nine ten eleven twelve thirteen "
        "fourteen fifteen sixteen seventeen eighteen nineteen twenty".split()
    )
}
# "one" is a pronoun as often as a number ("one line at a time"): not read as 1.
del _NUMBER_WORDS["_"]
_NUMBER_WORDS.update({"thirty": "30", "forty": "40", "fifty": "50", "hundred": "100"})
_LANGUAGES: Final = frozenset(
    "english french german spanish italian portuguese dutch russian chinese mandarin "
    "cantonese japanese korean arabic hindi bengali turkish polish swedish norwegian danish "
    "finnish greek hebrew czech hungarian romanian ukrainian vietnamese thai indonesian "
    "malay swahili latin persian urdu tamil".split()
)
_FORMATS: Final = frozenset(
    "word words sentence sentences paragraph paragraphs bullet bullets bulleted table "
    "json yaml csv xml markdown html essay summary haiku poem tweet email letter outline "
    "one-liner numbered".split()
)
_TOKEN: Final = re.compile(r"[A-Za-z0-9_@.\-/+#%$€£:]+")
_NUMBER: Final = re.compile(r"(?<![A-Za-z])[-+]?\d+(?:[.,:/]\d+)*")
_QUOTED: Final = re.compile(r"\"([^\"]+)\"|'([^']+)'|`([^`]+)`|“([^”]+)”")
_EMAIL: Final = re.compile(r"[\w.+-]+@[\w-]+\.[\w.]+")
_IDENTIFIER: Final = re.compile(r"[A-Za-z]*\d[\w.\-]*|\w+_\w+|\w+\.\w+|[a-z]+[A-Z]\w*|[A-Z]{2,}\w*")
_UNIT_AFTER: Final = re.compile(r"\s*(%|percent|[a-zA-Z]{1,12})?")


# Ways of saying one member of a pair, read as that member: a paraphrase using one is no
# difference.
_SYNONYMS: Final = (
    (re.compile(r"\b(turn|switch) on\b|\bactivate\b|\bswitch on\b"), "enable"),
    (re.compile(r"\b(turn|switch) off\b|\bdeactivate\b"), "disable"),
    (re.compile(r"\b(turned|switched) on\b|\bactivated\b"), "enabled"),
    (re.compile(r"\b(turned|switched) off\b|\bdeactivated\b"), "disabled"),
    (re.compile(r"\bbiggest\b"), "largest"),
    (re.compile(r"\bgreatest\b"), "largest"),
    (re.compile(r"\braise\b"), "increase"),
    (re.compile(r"\blower\b"), "decrease"),
)


def _lower(text: str) -> str:
    text = text.lower().replace("’", "'")
    for pattern, replacement in _CONTRACTIONS:
        text = pattern.sub(replacement, text)
    for pattern, replacement in _SYNONYMS:
        text = pattern.sub(replacement, text)
    return text


def _words(text: str) -> list[str]:
    words = [w.strip(".,;:!?()[]{}'\"") for w in _TOKEN.findall(text)]
    return [_NUMBER_WORDS.get(w, w) for w in words if w]


def _numbers(text: str) -> Counter[str]:
    """Numbers with what follows them (a unit, a percent sign), number words as digits."""
    words = " ".join(_words(text))
    found: Counter[str] = Counter()
    for match in _NUMBER.finditer(words):
        unit = _UNIT_AFTER.match(words, match.end())
        after = unit.group(1) if unit is not None and unit.group(1) else ""
        value = match.group().replace(",", "")
        if after in ("percent", "%"):
            after = "%"
        elif after and after not in _UNITS:
            after = ""
        found[f"{value}{after}"] += 1
    return found


_UNITS: Final = frozenset(
    "% km m cm mm mi miles km/h mph kg g mg lb lbs oz l ml gb mb kb tb gib mib ms s sec "
    "seconds minutes hours days weeks months years h min usd eur gbp dollars euros c f "
    "degrees px pt em".split()
)


def _names(text: str) -> set[str]:
    """Names a question is about: mid-sentence capitals, acronyms, identifiers, quoted
    strings, e-mail addresses (lower-cased)."""
    names: set[str] = set()
    for match in _QUOTED.finditer(text):
        names.add(next(g for g in match.groups() if g).strip().lower())
    for email in _EMAIL.findall(text):
        names.add(email.lower())
    for sentence in re.split(r"(?<=[.!?])\s+", text):
        tokens = sentence.split()
        for i, raw in enumerate(tokens):
            token = raw.strip(".,;:!?()[]{}\"'`“”").removesuffix("'s")
            if not token:
                continue
            if i > 0 and token[0].isupper() and token.lower() not in _SMALL_CAPITALS:
                names.add(token.lower())
            elif _IDENTIFIER.fullmatch(token) and not token.isdigit():
                names.add(token.lower())
    return names


# Capitalised words that say nothing about what is asked.
_SMALL_CAPITALS: Final = frozenset({"i", "i'm", "i've", "i'd", "i'll"})


def _mentions(name: str, text: str) -> bool:
    return name in text


def _ordered(words: list[str]) -> list[str]:
    """The order in which a question names languages and units: "from English to
    Spanish" and "from Spanish to English" name the same two, the other way round."""
    return [w for w in words if w in _LANGUAGES or w in _ORDERED_UNITS]


_ORDERED_UNITS: Final = frozenset(
    "celsius fahrenheit kelvin km kilometres kilometers miles mile metres meters feet inches "
    "cm mm kg pounds lb grams ounces oz usd eur gbp dollars euros pounds yen".split()
)


def _lookalike(a: str, b: str) -> bool:
    """Two different words a letter or two apart, not the same word inflected: ethanol
    and methanol, Austria and Australia."""
    if a[:4] == b[:4] and (a.startswith(b) or b.startswith(a)):
        return False
    if abs(len(a) - len(b)) > 2:
        return False
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1] <= 2


def differences(query: str, candidate: str) -> list[str]:
    """Why ``candidate``'s answer must not be served for ``query`` (short codes:
    ``negation``, ``antonym:<pair>``, ``number``, ``entity``, ``language``, ``format``);
    empty when no rule finds a difference."""
    reasons: list[str] = []
    low_q, low_c = _lower(query), _lower(candidate)
    words_q, words_c = _words(low_q), _words(low_c)
    set_q, set_c = set(words_q), set(words_c)
    if sorted(w for w in words_q if w in _NEGATORS) != sorted(w for w in words_c if w in _NEGATORS):
        reasons.append("negation")
    for pair in _PAIRS:
        used_q = set_q.intersection(pair)
        used_c = set_c.intersection(pair)
        # One side naming one member where the other names the other; a side naming
        # neither is wording ("the right way", "remove" for "delete"), left to the rest.
        if used_q and used_c and used_q != used_c:
            reasons.append(f"antonym:{pair[0]}/{pair[1]}")
            break
    if _ordered(words_q) != _ordered(words_c):
        reasons.append("antonym:order")
    if _numbers(low_q) != _numbers(low_c):
        reasons.append("number")
    names_q, names_c = _names(query), _names(candidate)
    if any(not _mentions(n, low_c) for n in names_q) or any(
        not _mentions(n, low_q) for n in names_c
    ):
        reasons.append("entity")
    only_q = {w for w in set_q - set_c if len(w) >= 5 and w.isalpha()}
    only_c = {w for w in set_c - set_q if len(w) >= 5 and w.isalpha()}
    if "entity" not in reasons and any(_lookalike(a, b) for a in only_q for b in only_c):
        reasons.append("entity")
    if set_q & _LANGUAGES != set_c & _LANGUAGES:
        reasons.append("language")
    if set_q & _FORMATS != set_c & _FORMATS:
        reasons.append("format")
    return reasons
