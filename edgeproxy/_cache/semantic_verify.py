"""The semantic cache's verifier: between "similar" and "hit".

An embedding sees that "ibuprofen's maximum dose" and "acetaminophen's maximum dose" are
about the same thing; it cannot see that their answers differ. Lists of the differences
that matter (antonyms, drug names, languages) never end: the next user asks about two
diets, two git commands or two cities written in lower case. So the rule here does not
depend on having seen a word before. It aligns the two questions and serves a candidate
only when every word that carries meaning is accounted for:

* **every content word of each side is matched in the other**: the same word, the same
  lemma (an inflection: "reverse" and "reversing", "policy" and "policies"), a closed
  compound ("e-mail", "email"), or a near-synonym from a small table of general words
  (fix/repair, big/large). Close embeddings are never a match: co-hyponyms (ibuprofen,
  acetaminophen) sit close in every embedding space. Words that only frame a question
  (how, explain, please, the way to) and function words may differ freely;
* **negation**: the negators each side uses (not, no, never, without...), contractions
  expanded first;
* **numbers**: every number with its unit or percent sign (number words read as digits),
  as a multiset;
* **direction, order and roles**: a word after a directional preposition (from, to,
  into, than, by) must have the same one in the other question ("migrate MySQL to
  PostgreSQL" is not "PostgreSQL to MySQL"), words with no such role must keep their
  order around the words between them ("dog chases cat" is not "cat chases dog"), and
  the members of a direction pair (in/out, up/down, before/after...) must agree.

It errs on the side of a miss: a paraphrase it rejects costs one upstream call; a near
miss it passed would serve a wrong answer with confidence.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache
from typing import Final

__all__ = ["differences"]

_CONTRACTIONS: Final = (
    (re.compile(r"\bcan't\b|\bcannot\b"), "can not"),
    (re.compile(r"\bwon't\b"), "will not"),
    (re.compile(r"\bshan't\b"), "shall not"),
    (re.compile(r"n't\b"), " not"),
    (re.compile(r"'re\b"), " are"),
    (re.compile(r"'ve\b"), " have"),
    (re.compile(r"'ll\b"), " will"),
    (re.compile(r"'d\b"), " would"),
    (re.compile(r"'m\b"), " am"),
    (re.compile(r"\b(what|that|it|where|how|who|there|here|he|she)'s\b"), r"\1 is"),
    (re.compile(r"'s\b"), ""),
)
# Ways of saying one thing, read as one word: a paraphrase using either is no difference.
_PHRASES: Final = (
    (re.compile(r"\b(turn|switch)(ed|ing|s)? on\b|\bactivat(e|ed|es|ing)\b"), "enable"),
    (re.compile(r"\b(turn|switch)(ed|ing|s)? off\b|\bdeactivat(e|ed|es|ing)\b"), "disable"),
    (re.compile(r"\b(log|sign)(ged|ging|s)? ?in(to)?\b"), "login"),
    (re.compile(r"\b(log|sign)(ged|ging|s)? ?out\b"), "logout"),
    (re.compile(r"\bsign(ed|ing|s)? ?up\b"), "register"),
    (re.compile(r"\bset(ting|s)? ?up\b"), "setup"),
    (re.compile(r"\b(look(ed|ing|s)? up|find(ing|s)? out|figur(e|ed|ing|es) out)\b"), "find"),
    (re.compile(r"\bspeed(ing|s)? up\b"), "accelerate"),
    (re.compile(r"\bin order to\b|\bso as to\b"), "to"),
    (re.compile(r"\bhow (can|do|should|would|could) (i|you|we|one)\b"), "how"),
    (re.compile(r"\b(is|are) there (a|an|any)\b"), "how"),
    (re.compile(r"\bwhat is the (best |right |correct |proper )?way to\b"), "how to"),
    (re.compile(r"\b(could|can|would|will) you (please )?(tell|show|explain to) me\b"), "how"),
    (re.compile(r"\bi (want|would like|need|wish) to (know|learn|understand)\b"), "how"),
    (re.compile(r"\bwhat (causes|caused|makes|made|is the reason|are the reasons)\b"), "why"),
    (re.compile(r"\bwhat (is|are|was|were) the (function|role|purpose|job)s? of\b"), "what does"),
    (re.compile(r"\bwhat (is|are) the (causes?|reasons?) (of|for)\b"), "why"),
    (
        re.compile(r"^\W*(list|name|give me|tell me|show me|calculate|compute|determine)\b"),
        "what",
    ),
    (re.compile(r"\b(stands?|short) for\b"), "meaning"),
    (re.compile(r"\bdiffer(s|ed|ing)?( from)?\b|\bdifferent (from|than|to)\b"), "difference"),
    (
        re.compile(r"\b(vs\.?|versus|compared (to|with)|in comparison (to|with))(?=\s)"),
        "difference",
    ),
    (re.compile(r"\b(in )?(what|which) year\b"), "when"),
    (re.compile(r"\bhow many people live (in|on)\b"), "population of"),
    (re.compile(r"\blooks? like\b"), ""),
    (re.compile(r"\bbiggest\b|\bgreatest\b"), "largest"),
    (re.compile(r"\bmax\b"), "maximum"),
    (re.compile(r"\bmin\b"), "minimum"),
)
_NEGATORS: Final = frozenset(
    {"not", "no", "never", "without", "none", "nothing", "neither", "nor", "nobody", "nowhere"}
)
# Prepositions that give the word after them a role: where from, where to, compared with
# what, done by whom. Swapping two words' roles swaps the answer.
_DIRECTIONAL: Final = frozenset({"from", "to", "into", "onto", "toward", "towards", "than", "by"})
# Pairs whose members are function words (in, on, up...) or words a question can drop
# ("the first", "the last"): one side naming one member where the other names the other.
_PAIRS: Final = (
    ("in", "out"),
    ("on", "off"),
    ("up", "down"),
    ("over", "under"),
    ("above", "below"),
    ("inside", "outside"),
    ("before", "after"),
    ("first", "last"),
    ("more", "less"),
    ("most", "least"),
    ("to", "from"),
    ("into", "from"),
    ("with", "without"),
    ("show", "hide"),
)
# Function words and the words that frame a question without changing what it asks:
# either side may have them where the other has none.
_FUNCTION: Final = frozenset(
    """a an the this that these those there here it its itself some any each every
    i me my mine myself we us our ours you your yours yourself he him his she her hers
    they them their theirs one ones someone somebody something anything thing things
    of in on at for with about as into onto over under up down out off via per
    and or but if then so also just too very really actually basically exactly
    is are was were be been being am do does did doing done have has had having
    can could would should shall may might must will
    how what which whats please kindly thanks thank hi hello hey
    explain explanation describe description tell show give provide know want need like
    wonder wondering curious help let understand learn
    way ways method methods step steps process procedure approach
    best good proper correct recommended possible possibly
    question mean meaning definition define work works happen happens purpose
    between many much using command commands people all whether if required allowed able
    guide tutorial instructions overview introduction information info details
    say told go get getting""".split()
)
# General near-synonyms, one group a line: a content word matches any of its group.
_SYNONYM_GROUPS: Final = """
fix repair resolve solve
create make build generate
view see
write draft
delete remove erase
begin start commence
end finish
big large
small little tiny
fast quick rapid speedy
buy purchase
car automobile
use utilize employ
difference distinction
earth world
symptom sign
cause reason
cheap inexpensive affordable
expensive costly pricey
price cost
choose select pick
change modify alter
improve enhance boost
obtain retrieve fetch
check verify
find locate
run execute
install setup
problem issue trouble
simple easy
hard difficult
often frequently
usually typically generally normally
kid child
doctor physician
medicine medication
illness disease sickness
job occupation
salary pay wage
house home
picture photo image
film movie
program software application app
computer pc
phone smartphone mobile cellphone
website site webpage
email mail
answer reply respond response
write compose
country nation
amount quantity
near nearby close
allow permit
prevent avoid
decrease reduce
increase raise
kill terminate
benefit advantage
drawback disadvantage downside
example instance
author writer
important significant
safe secure
dangerous unsafe hazardous
wrong incorrect
journey trip
healthy nutritious
compute calculate
dict dictionary
repo repository
db database
config configuration
env environment
k8s kubernetes
js javascript
ts typescript
"""


def _synonyms() -> dict[str, int]:
    table: dict[str, int] = {}
    for group, line in enumerate(_SYNONYM_GROUPS.strip().splitlines()):
        for word in line.split():
            table[word] = group
    return table


_SYNONYM_OF: Final = _synonyms()
_UNITS_WORDS: Final = {
    word: i
    for i, word in enumerate(
        "zero _ two three four five six seven eight nine ten eleven twelve thirteen "
        "fourteen fifteen sixteen seventeen eighteen nineteen".split()
    )
    if word != "_"
}
# "one" is a pronoun as often as a number ("one line at a time"): alone, not read as 1.
_TENS: Final = {
    word: 10 * i
    for i, word in enumerate("_ _ twenty thirty forty fifty sixty seventy eighty ninety".split())
    if word != "_"
}
_SCALES: Final = {"hundred": 100, "thousand": 1000, "million": 1_000_000}


def _spelled(words: list[str]) -> list[str]:
    """Number words read as digits: "thirty-nine", "one hundred forty-four", "eighty"."""
    out: list[str] = []
    value: int | None = None
    for word in words:
        parts = word.split("-") if "-" in word else [word]
        if all(p in _UNITS_WORDS or p in _TENS or p in _SCALES or p == "one" for p in parts):
            if parts == ["one"] and value is None:
                out.append(word)
                continue
            total = value or 0
            for part in parts:
                if part in _SCALES:
                    total = max(total, 1) * _SCALES[part]
                else:
                    total += _UNITS_WORDS.get(part, _TENS.get(part, 1))
            value = total
            continue
        if value is not None:
            out.append(str(value))
            value = None
        out.append(word)
    if value is not None:
        out.append(str(value))
    return out


_UNITS: Final = frozenset(
    "% km m cm mm mi miles km/h mph kg g mg lb lbs oz l ml gb mb kb tb gib mib ms s sec "
    "seconds minutes hours days weeks months years h min usd eur gbp dollars euros c f "
    "degrees px pt em".split()
)
_TOKEN: Final = re.compile(r"[a-z0-9_@.+#%$€£/]+(?:-[a-z0-9_@.+#%$€£/]+)*")
_NUMBER: Final = re.compile(r"(?<![a-z])[-+]?\d+(?:[.,:/]\d+)*")
_UNIT_AFTER: Final = re.compile(r"\s*(%|percent|[a-z]{1,12})?")
_PERCENT: Final = frozenset({"percent", "%"})
# The parts of speech whose lemmas make two words one: an adjective's ("better" is a form
# of "good") would merge words a question tells apart.
_LEMMA_POS: Final = ("NOUN", "VERB", "AUX")


def _lemmatizer() -> Callable[[str], dict[str, tuple[str, ...]]] | None:
    try:
        from lemminflect import getAllLemmas
    except ImportError:  # the semantic extra is not installed: inflections are not merged
        return None
    return getAllLemmas  # type: ignore[no-any-return]


_LEMMAS: Final = _lemmatizer()


@lru_cache(maxsize=65536)
def _forms(word: str) -> frozenset[str]:
    """The word and its lemmas as a noun or a verb (``policies``: policy; ``ran``: run)."""
    forms = {word}
    if _LEMMAS is not None and word.isalpha():
        known = _LEMMAS(word)
        for pos, lemmas in known.items():
            if pos in _LEMMA_POS:
                forms.update(lemmas)
        if not known and len(word) > 3 and word[-1] == "s" and word[-2] != "s":
            forms.add(word[:-1])  # a plural the lemmatizer does not know: "apis", "gpus"
    return frozenset(forms)


def _normal(text: str) -> str:
    text = text.lower().replace("’", "'").replace("‘", "'")
    for pattern, replacement in _CONTRACTIONS:
        text = pattern.sub(replacement, text)
    for pattern, replacement in _PHRASES:
        text = pattern.sub(replacement, text)
    return text


def _words(text: str) -> list[str]:
    words = [w.strip(".,;:!?()[]{}'\"`/") for w in _TOKEN.findall(text)]
    return _spelled([w for w in words if w])


def _numbers(words: list[str]) -> list[str]:
    """Numbers with what follows them (a unit, a percent sign), in order: "12 divided by 4"
    is not "4 divided by 12"."""
    joined = " ".join(words)
    found: list[str] = []
    for match in _NUMBER.finditer(joined):
        unit = _UNIT_AFTER.match(joined, match.end())
        after = unit.group(1) if unit is not None and unit.group(1) else ""
        value = match.group().replace(",", "")
        if after in ("percent", "%"):
            after = "%"
        elif after and after not in _UNITS:
            after = ""
        found.append(f"{value}{after}")
    return found


def _infinitive(words: list[str], at: int) -> bool:
    """Whether the "to" at ``at`` marks an infinitive ("how to", "steps to"), not a
    direction: it follows a function word, or opens the question."""
    return at == 0 or words[at - 1] in _FUNCTION


class _Content:
    """One content word of a question: where it stands, its forms, and its role (the
    directional preposition it follows, "" for none)."""

    __slots__ = ("word", "at", "forms", "role")

    def __init__(self, word: str, at: int, role: str) -> None:
        self.word = word
        self.at = at
        self.forms = _forms(word)
        self.role = role


def _content(words: list[str]) -> list[_Content]:
    """The words that carry meaning, in order, each with its role. A role lasts from its
    preposition to the next function word that is not an article or determiner. A "to"
    after a function word ("how to", "steps to") marks an infinitive, not a direction."""
    out: list[_Content] = []
    role = ""
    for at, word in enumerate(words):
        if word in _DIRECTIONAL:
            role = "" if word == "to" and _infinitive(words, at) else word
            continue
        if word in _NEGATORS or word in _PERCENT or _NUMBER.match(word):
            continue  # the negation and number rules compare these
        if word in _FUNCTION:
            if word not in _DETERMINERS:
                role = ""
            continue
        out.append(_Content(word, at, role))
    return out


_DETERMINERS: Final = frozenset(
    "a an the this that these those my your our their his her its some any each every".split()
)


def _same(a: _Content, b: _Content) -> bool:
    if a.forms & b.forms:
        return True
    group = _SYNONYM_OF.get(a.word)
    if group is None:
        group = next((g for f in a.forms if (g := _SYNONYM_OF.get(f)) is not None), None)
    if group is None:
        return False
    return any(_SYNONYM_OF.get(f) == group for f in b.forms)


def _align(ours: list[_Content], theirs: list[_Content]) -> tuple[list[int], list[_Content]]:
    """For each of ``ours``, the index of its match in ``theirs`` (-1: none), and those of
    ``theirs`` nothing matched. A word may also match two adjacent words written apart
    ("e-mail", "e mail", "email")."""
    matched = [-1] * len(ours)
    used = [False] * len(theirs)
    for i, word in enumerate(ours):
        for j, other in enumerate(theirs):
            if not used[j] and _same(word, other):
                matched[i], used[j] = j, True
                break
    joined = {o.word.replace("-", ""): j for j, o in enumerate(theirs)}
    for i, word in enumerate(ours):
        if matched[i] == -1:
            j = joined.get(word.word.replace("-", ""), -1)
            if j >= 0 and not used[j]:
                matched[i], used[j] = j, True
    left = [o for j, o in enumerate(theirs) if not used[j]]
    return matched, _compounds(ours, left)


def _compounds(ours: list[_Content], left: list[_Content]) -> list[_Content]:
    """``left`` less the words that, two by two, spell one of ``ours`` ("data base")."""
    if not left:
        return left
    spelled = {o.word.replace("-", "") for o in ours}
    out: list[_Content] = []
    skip = False
    for k, word in enumerate(left):
        if skip:
            skip = False
            continue
        nxt = left[k + 1] if k + 1 < len(left) else None
        if nxt is not None and nxt.at == word.at + 1 and word.word + nxt.word in spelled:
            skip = True
            continue
        out.append(word)
    return out


def _unmatched(ours: list[_Content], matched: list[int], theirs: list[_Content]) -> list[str]:
    spelled = {
        theirs[k].word + theirs[k + 1].word
        for k in range(len(theirs) - 1)
        if theirs[k + 1].at == theirs[k].at + 1
    }
    return [
        o.word
        for i, o in enumerate(ours)
        if matched[i] == -1 and o.word.replace("-", "") not in spelled
    ]


def _swapped(ours: list[_Content], matched: list[int], theirs: list[_Content]) -> bool:
    """Whether two words without a role swap sides around a third matched word: "dog
    chases cat" against "cat chases dog"."""
    pairs = [(i, matched[i]) for i in range(len(ours)) if matched[i] >= 0]
    positions = [(ours[i].at, theirs[j].at) for i, j in pairs]
    bare = [k for k, (i, j) in enumerate(pairs) if not ours[i].role and not theirs[j].role]
    for x in range(len(positions)):
        qx, cx = positions[x]
        for a in bare:
            qa, ca = positions[a]
            for b in bare:
                qb, cb = positions[b]
                if a == b or x in (a, b):
                    continue
                if qa < qx < qb and cb < cx < ca:
                    return True
    return False


def differences(query: str, candidate: str) -> list[str]:
    """Why ``candidate``'s answer must not be served for ``query`` (short codes:
    ``negation``, ``number``, ``word:<w>`` for a content word the other side does not
    match, ``role:<w>``, ``order``, ``antonym:<pair>``); empty when the two ask the same."""
    reasons: list[str] = []
    words_q, words_c = _words(_normal(query)), _words(_normal(candidate))
    if sorted(w for w in words_q if w in _NEGATORS) != sorted(w for w in words_c if w in _NEGATORS):
        reasons.append("negation")
    if _numbers(words_q) != _numbers(words_c):
        reasons.append("number")
    set_q, set_c = _paired(words_q), _paired(words_c)
    for pair in _PAIRS:
        used_q, used_c = set_q.intersection(pair), set_c.intersection(pair)
        if used_q and used_c and used_q != used_c:
            reasons.append(f"antonym:{pair[0]}/{pair[1]}")
            break
    if _scope(words_q) * _scope(words_c) < 0:
        reasons.append("scope")
    content_q, content_c = _content(words_q), _content(words_c)
    matched, left = _align(content_q, content_c)
    missing = _unmatched(content_q, matched, content_c)
    reasons.extend(f"word:{w}" for w in [*missing, *(o.word for o in left)])
    for i, j in enumerate(matched):
        if j >= 0 and content_q[i].role != content_c[j].role:
            reasons.append(f"role:{content_q[i].word}")
            break
    # A comparison ("the difference between A and B", "A versus B") names its two sides
    # in either order.
    symmetric = "difference" in words_q and "difference" in words_c
    if not symmetric and _swapped(content_q, matched, content_c):
        reasons.append("order")
    return reasons


_UNIVERSAL: Final = frozenset({"all", "every", "each", "always"})
_PARTIAL: Final = frozenset({"some", "few", "several", "sometimes"})


def _scope(words: list[str]) -> int:
    """Whether a question is about all of something (1), some of it (-1), or says neither
    (0): the quantifiers are function words, but "delete all" is not "delete some"."""
    universal = any(w in _UNIVERSAL for w in words)
    partial = any(w in _PARTIAL for w in words)
    return 0 if universal == partial else (1 if universal else -1)


def _paired(words: list[str]) -> set[str]:
    """The words of a question that may be members of a pair: an infinitive's "to" is not."""
    return {w for at, w in enumerate(words) if not (w == "to" and _infinitive(words, at))}
