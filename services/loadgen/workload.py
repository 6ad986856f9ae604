"""Locally generated workloads for ``pdserve bench``: nothing is downloaded.

A workload is a list of conversations; a conversation is one or more turns sent in order (the
next turn after the previous answer, its messages carrying the answers before it). Prompts are
made of common English words that most BPE vocabularies hold as one token each (with their
leading space), so a prompt of N words is close to N tokens on any model; the bench reports
the token counts the server's ``usage`` gives, not these estimates.

Registry: ``WORKLOADS`` (name -> builder); every builder takes the same ``WorkloadConfig``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

# NOTE: short, frequent words: one token each (with their leading space) in GPT-2, Llama-3,
# SmolLM2 and Qwen2 vocabularies alike
_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "was",
    "with",
    "as",
    "be",
    "at",
    "by",
    "this",
    "had",
    "not",
    "are",
    "but",
    "from",
    "or",
    "have",
    "an",
    "they",
    "which",
    "one",
    "you",
    "were",
    "all",
    "we",
    "her",
    "she",
    "there",
    "would",
    "their",
    "will",
    "when",
    "who",
    "him",
    "been",
    "has",
    "more",
    "if",
    "no",
    "out",
    "so",
    "said",
    "what",
    "up",
    "its",
    "about",
    "into",
    "than",
    "them",
    "can",
    "only",
    "other",
    "new",
    "some",
    "could",
    "time",
    "these",
    "two",
    "may",
    "then",
    "do",
    "first",
    "any",
    "my",
    "now",
    "such",
    "like",
    "our",
    "over",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "get",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "us",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
    "small",
    "house",
    "water",
    "light",
    "place",
    "city",
    "found",
    "land",
    "hand",
    "school",
    "part",
    "air",
    "night",
    "eye",
    "home",
    "end",
]


@dataclass(frozen=True, slots=True)
class Length:
    """A token-count distribution: ``fixed:N``, ``uniform:LO:HI``, ``normal:MEAN:SD`` or
    ``lognormal:MEAN:SD`` (of the count itself), clipped to [1, ``cap``]."""

    kind: str
    a: float
    b: float = 0.0
    cap: int = 1 << 20

    @classmethod
    def parse(cls, text: str, what: str = "length") -> Length:
        parts = text.split(":")
        try:
            if parts[0] == "fixed" and len(parts) == 2:
                return cls("fixed", float(parts[1]))
            if parts[0] in ("uniform", "normal", "lognormal") and len(parts) == 3:
                return cls(parts[0], float(parts[1]), float(parts[2]))
            if len(parts) == 1:
                return cls("fixed", float(parts[0]))
        except ValueError:
            pass
        raise ValueError(
            f"{what}: {text!r} is not fixed:N, uniform:LO:HI, normal:MEAN:SD or lognormal:MEAN:SD"
        )

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            x = self.a
        elif self.kind == "uniform":
            x = rng.uniform(self.a, self.b)
        elif self.kind == "normal":
            x = rng.gauss(self.a, self.b)
        else:  # lognormal with this mean and standard deviation
            import math

            var = math.log(1 + (self.b / self.a) ** 2)
            x = rng.lognormvariate(math.log(self.a) - var / 2, math.sqrt(var))
        return max(1, min(self.cap, round(x)))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.a:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


@dataclass(frozen=True, slots=True)
class Turn:
    """One request: its new user text and how many tokens to ask for."""

    text: str
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Conversation:
    system: str | None  # a system prompt (shared across conversations in ``multiturn``)
    turns: tuple[Turn, ...]


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    requests: int = 32  # requests in all (turns, for multi-turn)
    input_len: Length = field(default_factory=lambda: Length("normal", 256, 64))
    output_len: Length = field(default_factory=lambda: Length("normal", 64, 16))
    turns: int = 4  # multiturn: turns per conversation
    system_len: int = 512  # multiturn: words of the shared system prompt
    seed: int = 0


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _single(cfg: WorkloadConfig) -> list[Conversation]:
    rng = random.Random(cfg.seed)
    return [
        Conversation(None, (Turn(words(rng, cfg.input_len.draw(rng)), cfg.output_len.draw(rng)),))
        for _ in range(cfg.requests)
    ]


def _multiturn(cfg: WorkloadConfig) -> list[Conversation]:
    """Conversations sharing one system prompt, each of ``turns`` turns: every turn re-sends
    the system prompt and the conversation so far (a prefix cache's best case)."""
    rng = random.Random(cfg.seed)
    system = words(rng, cfg.system_len)
    out: list[Conversation] = []
    left = cfg.requests
    while left > 0:
        n = min(cfg.turns, left)
        turns = tuple(
            Turn(words(rng, cfg.input_len.draw(rng)), cfg.output_len.draw(rng)) for _ in range(n)
        )
        out.append(Conversation(system, turns))
        left -= n
    return out


def _preset(
    input_len: Length, output_len: Length
) -> Callable[[WorkloadConfig], list[Conversation]]:
    def build(cfg: WorkloadConfig) -> list[Conversation]:
        return _single(replace(cfg, input_len=input_len, output_len=output_len))

    return build


# name -> builder. ``random`` uses the config's lengths; the mixes fix theirs.
WORKLOADS: dict[str, Callable[[WorkloadConfig], list[Conversation]]] = {
    "random": _single,
    "multiturn": _multiturn,
    # prefill-heavy (summarising, RAG): long prompts, short answers
    "long-prompt": _preset(Length("normal", 1536, 256), Length("normal", 32, 8)),
    # decode-heavy (writing, reasoning): short prompts, long answers
    "long-output": _preset(Length("normal", 64, 16), Length("normal", 512, 128)),
}


def build(name: str, cfg: WorkloadConfig) -> list[Conversation]:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; one of {', '.join(WORKLOADS)}")
    return WORKLOADS[name](cfg)
