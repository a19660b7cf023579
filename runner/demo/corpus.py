"""The demo's training text: a small synthetic grammar, generated deterministically.

Nothing is downloaded or shipped: the text is a pure function of ``(seed, size)``, produced with
a private splitmix64 generator (not ``random``, whose algorithms may change between Python
versions), so every machine trains on the same bytes. The grammar is a ship's log of a crew
running on borrowed machines: subject-verb agreement, tense, clauses and punctuation give a
character model structure to learn at several scales (spelling, word order, sentence shape), so
its loss keeps falling for a few hundred steps.
"""

from __future__ import annotations

DEFAULT_SEED = 0
DEFAULT_CHARS = 200_000

_MASK64 = (1 << 64) - 1

NAMES = ("Ada", "Brin", "Cato", "Dara", "Edda", "Faro", "Gwen", "Hale", "Iris", "Juno")
NOUNS = (
    "node", "ship", "model", "signal", "bucket", "shard", "pilot", "engine", "night", "storm",
    "harbor", "lantern", "ledger", "crew", "river", "tower", "orchard", "market", "bell", "wheel",
)  # fmt: skip
ADJECTIVES = (
    "quiet", "brave", "spare", "cold", "bright", "old", "patient", "narrow", "golden", "restless",
    "distant", "careful", "broken", "steady", "hollow",
)  # fmt: skip
# (base, third person singular, past)
VERBS = (
    ("carry", "carries", "carried"), ("watch", "watches", "watched"), ("save", "saves", "saved"),
    ("mend", "mends", "mended"), ("follow", "follows", "followed"), ("guard", "guards", "guarded"),
    ("count", "counts", "counted"), ("lift", "lifts", "lifted"), ("find", "finds", "found"),
    ("keep", "keeps", "kept"), ("leave", "leaves", "left"), ("hear", "hears", "heard"),
)  # fmt: skip
ADVERBS = ("slowly", "again", "at dawn", "before the storm", "without a word", "in time")
PREPOSITIONS = ("near", "under", "beyond", "beside", "across", "behind")
CONNECTIVES = ("and", "but", "so", "while")


class _SplitMix64:
    """Tiny, fully specified PRNG: the corpus must not depend on the Python version."""

    def __init__(self, seed: int) -> None:
        self._state = seed & _MASK64

    def next(self) -> int:
        self._state = (self._state + 0x9E3779B97F4A7C15) & _MASK64
        z = self._state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n

    def pick(self, options: tuple[str, ...]) -> str:
        return options[self.below(len(options))]


def generate_corpus(*, seed: int = DEFAULT_SEED, size: int = DEFAULT_CHARS) -> str:
    """About `size` characters of the ship's log (whole lines, at least one)."""
    rng = _SplitMix64(seed)
    lines: list[str] = []
    total = 0
    day = 1
    while total < size:
        line = _log_entry(rng, day) if rng.below(6) == 0 else _sentence(rng)
        if line.startswith("Day"):
            day += 1
        lines.append(line)
        total += len(line) + 1
    return "\n".join(lines) + "\n"


def _log_entry(rng: _SplitMix64, day: int) -> str:
    return f"Day {day}. {rng.pick(NAMES)} keeps the log."


def _noun_phrase(rng: _SplitMix64) -> tuple[str, bool]:
    """A noun phrase and whether it is plural."""
    if rng.below(4) == 0:
        return rng.pick(NAMES), False
    plural = rng.below(3) == 0
    noun = rng.pick(NOUNS) + ("s" if plural else "")
    if rng.below(2):
        noun = f"{rng.pick(ADJECTIVES)} {noun}"
    return f"the {noun}", plural


def _clause(rng: _SplitMix64) -> str:
    subject, plural = _noun_phrase(rng)
    base, third, past = VERBS[rng.below(len(VERBS))]
    tense = rng.below(3)
    verb = past if tense == 0 else (base if plural else third) if tense == 1 else f"will {base}"
    obj, _ = _noun_phrase(rng)
    clause = f"{subject} {verb} {obj}"
    extra = rng.below(4)
    if extra == 0:
        clause += f" {rng.pick(ADVERBS)}"
    elif extra == 1:
        place, _ = _noun_phrase(rng)
        clause += f" {rng.pick(PREPOSITIONS)} {place}"
    return clause


def _sentence(rng: _SplitMix64) -> str:
    text = _clause(rng)
    if rng.below(3) == 0:
        text += f", {rng.pick(CONNECTIVES)} {_clause(rng)}"
    return text[0].upper() + text[1:] + "."
