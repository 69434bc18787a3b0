"""What the draft head trains on, as text: the prompts the target is asked to continue, from the
workloads' `train` split, corpora on every machine (fortunes, the Python standard library) and
requests the target writes itself (Magpie-style self-instruction); and the check that none of
them is an `eval` or `calib` prompt of any workload, or a near-duplicate of one.

A near-duplicate shares at least `threshold` of the shorter text's word n-grams with the other
(containment, not Jaccard: a fortune quoted inside a longer request still counts). Texts shorter
than n words are compared whole, after normalising case and spacing."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from ogspo.artifacts.prompts import render_chat

HELD_OUT_SPLITS = ("eval", "calib")
_WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class TrainText:
    source: str  # where it came from: "<workload>/train", "fortunes/extra", "stdlib/function", "self-instruct", ...
    text: str  # the raw text the near-duplicate check reads (a user turn, or a continuation prompt)
    prompt: str  # the complete prompt the target continues (chat template or BOS applied)


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def ngram_set(text: str, n: int) -> frozenset:
    """The text's word n-grams, each kept as its hash (the index holds whole conversations: ints, not
    tuples of strings; a hash is stable within the process, which is all an index needs)."""
    w = words(text)
    if len(w) < n:
        return frozenset({hash(tuple(w))}) if w else frozenset()
    return frozenset(hash(tuple(w[i : i + n])) for i in range(len(w) - n + 1))


class NearDuplicateIndex:
    """Word n-gram sets of reference texts, and the question whether a text is near one of them."""

    def __init__(self, texts: list[str] = (), *, n: int = 5, threshold: float = 0.5):
        self.n, self.threshold = n, threshold
        self.sets: list[frozenset] = []
        self.by_gram: dict[int, list[int]] = {}
        for t in texts:
            self.add(t)

    def add(self, text: str) -> None:
        s = ngram_set(text, self.n)
        for g in s:
            self.by_gram.setdefault(g, []).append(len(self.sets))
        self.sets.append(s)

    def near(self, text: str) -> bool:
        s = ngram_set(text, self.n)
        if not s:
            return False
        shared: dict[int, int] = {}
        for g in s:
            for i in self.by_gram.get(g, ()):
                shared[i] = shared.get(i, 0) + 1
        return any(c >= self.threshold * min(len(s), len(self.sets[i])) for i, c in shared.items())


def held_out_texts(workloads_dir: Path) -> list[str]:
    """The text of every `eval` and `calib` prompt of every workload under `workloads_dir`."""
    out: list[str] = []
    for path in sorted(Path(workloads_dir).glob("*.parquet")):
        df = pl.read_parquet(path, columns=["split", "text"])
        out += df.filter(pl.col("split").is_in(HELD_OUT_SPLITS))["text"].to_list()
    return out


def decontaminate(items: list[TrainText], held_out: list[str], *, n: int = 5, threshold: float = 0.5
                  ) -> tuple[list[TrainText], int, int]:
    """`items` without any near-duplicate of a held-out text, nor of an item kept before it.
    Returns (kept, dropped as near a held-out text, dropped as near an earlier item)."""
    held = NearDuplicateIndex(held_out, n=n, threshold=threshold)
    seen = NearDuplicateIndex(n=n, threshold=threshold)
    kept, near_held, repeats = [], 0, 0
    for item in items:
        if held.near(item.text):
            near_held += 1
        elif seen.near(item.text):
            repeats += 1
        else:
            seen.add(item.text)
            kept.append(item)
    return kept, near_held, repeats


def user_turn_prefix(tokenizer) -> str:
    """The chat template up to where the user's words start (system turn included): the context from
    which the target writes a request of its own."""
    marker = "\x00USER\x00"
    rendered = render_chat(tokenizer, marker)
    if rendered.count(marker) != 1:
        raise ValueError("the chat template does not place the user's text once: self-instruction needs a template that does")
    return rendered.split(marker)[0]


def clean_request(text: str, *, min_words: int = 4) -> str | None:
    """A self-written user turn as a request, or None: stripped, at least `min_words` words, and not
    a template marker run-on (a second turn)."""
    text = text.strip()
    if "<|" in text or len(words(text)) < min_words:
        return None
    return text
