"""Draft tokens for speculative decoding: prompt-lookup proposals and an adaptive budget.

Two drafters look at one request's history (prompt + output) and propose what followed the
latest earlier occurrence of its longest recent suffix:

* :class:`TextDrafter` (the default, `--draft-match text`) matches the *text*. The same words
  tokenize differently in different places (` Riverside` in a passage is one token, `"Riverside`
  in a JSON value is `R` `ivers` `ide`), so token n-grams miss exactly the copies structured
  outputs make. It also matches a partial word at the start of any earlier word, and tokenizes
  the continuation it found the way the model writes it. Inside a quoted string of the output
  (a JSON value) it ends the copy where the copied phrase ends and closes the quote, so that the
  grammar can add what it forces after the string (the next key) to the same drafts.
* :class:`NgramDrafter` (`--draft-match tokens`) matches token n-grams through an index extended
  incrementally, so a proposal costs O(max_n) dictionary look-ups.

:class:`DraftBudget` decides how many drafts a request gets per step: it grows after fully
accepted drafts, halves after fully rejected ones and, after a run of misses, pauses drafting for
a cooldown that doubles each time, so a request whose text never repeats soon pays nothing.
Drafts the speculation gate declines are scored against the tokens the request then emits, as
their verification would have scored them: the acceptance estimate the gate decides by follows
the text while nothing is verified (the budget's size and pauses, which limit what verification
costs, follow verifications only).

The drafters are deterministic: with the acceptance rule of the engine (a draft is kept iff the
token sampled at its position equals it) the output distribution is exactly the target's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from neuron_worker.speculation_gate import PAUSE_DECLINES

DraftMatch = Literal["text", "tokens"]
# Suffix lengths matched by default: tokens for `tokens`, bytes of text for `text`.
DEFAULT_SIZES: dict[DraftMatch, tuple[int, int]] = {"tokens": (1, 4), "text": (2, 64)}


@dataclass(frozen=True)
class DraftConfig:
    """Speculation settings (CLI: `--speculative`, `--num-draft-tokens`, `--draft-match`,
    `--ngram-min/max`, `--speculation-gate`, `--draft-pause-declines`)."""

    num_draft_tokens: int = 4
    # Most drafts of the grammar's forced bytes per row and step (after its forced tokens, or
    # after the drafter's own drafts: the next key after a closed JSON string). A key cut short
    # saves no pass, so this is room for the longest common one, not a guess.
    forced_drafts: int = 8
    match: DraftMatch = "text"
    # Shortest / longest suffix matched, in the unit of `match` (tokens or bytes of text).
    min_n: int = DEFAULT_SIZES["text"][0]
    max_n: int = DEFAULT_SIZES["text"][1]
    # Most tokens in one verification pass, all rows together (0 = no limit): drafts beyond it
    # are not proposed, but copies that close a string are not counted (`Speculator.plan`).
    pass_tokens: int = 0
    # Verify drafts only when the measured step costs say they pay (`speculation_gate`).
    gate: bool = True
    # The gate's declines in a row at a batch size before it pauses drafting there (0: never;
    # `speculation_gate.DraftPause`).
    pause_declines: int = PAUSE_DECLINES
    # Consecutive fully rejected proposals before drafting pauses.
    patience: int = 2
    # First pause, in steps (doubles per pause, capped at `max_cooldown`).
    cooldown: int = 4
    max_cooldown: int = 64

    @property
    def verify_width(self) -> int:
        """Logits rows per request in a verification pass: the token sampled after the drafts,
        the drafter's own drafts and the grammar's forced ones after them."""
        return 1 + self.num_draft_tokens + self.forced_drafts

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError("num_draft_tokens must be >= 1")
        if self.forced_drafts < 0:
            raise ValueError("forced_drafts must be >= 0")
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError("n-gram sizes must satisfy 1 <= min_n <= max_n")
        if self.pass_tokens < 0:
            raise ValueError("pass_tokens must be >= 0")
        if self.pause_declines < 0:
            raise ValueError("pause_declines must be >= 0")


class Drafter(Protocol):
    """Proposes drafts from one request's history (prompt + output), fed by `extend`."""

    def extend(self, tokens: Sequence[int], output: bool = True) -> None: ...
    def __len__(self) -> int: ...
    def propose(self, k: int) -> list[int]: ...


def new_drafter(
    config: DraftConfig,
    token_bytes: Callable[[int], bytes],
    encode: Callable[[str], list[int]],
) -> Drafter:
    """The drafter `config.match` names, for one request."""
    if config.match == "tokens":
        return NgramDrafter(config.min_n, config.max_n)
    return TextDrafter(token_bytes, encode, config.min_n, config.max_n)


class NgramDrafter:
    """Prompt lookup on token n-grams, for one request (module docstring)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: list[int] = []
        # (n-gram) -> index where its latest indexed occurrence's continuation starts.
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this index are in `_index`

    def extend(self, tokens: Sequence[int], output: bool = True) -> None:
        """Append tokens to the request's history (`output`: generated, not the prompt)."""
        self._tokens.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest matching
        suffix ([] when no suffix of `min_n` tokens or more occurred before)."""
        toks = self._tokens
        end = len(toks)
        if k <= 0 or end < self.min_n + 1:
            return []
        # Index every n-gram that ends before the last token (so it has a continuation): the
        # suffix itself is indexed only once it is no longer the suffix.
        for stop in range(self._indexed, end - 1):
            for n in range(self.min_n, self.max_n + 1):
                if stop + 1 >= n:
                    self._index[tuple(toks[stop + 1 - n : stop + 1])] = stop + 1
        self._indexed = max(self._indexed, end - 1)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            start = self._index.get(tuple(toks[end - n :]))
            if start is not None:
                return toks[start : start + k]
        return []


def _in_word(byte: int) -> bool:
    """Letters, digits and every byte of a multi-byte UTF-8 character."""
    return byte >= 0x80 or 48 <= byte <= 57 or 65 <= byte <= 90 or 97 <= byte <= 122


# Bytes that end a copied phrase: a value copied from a passage stops before them.
_PHRASE_ENDS = frozenset(b".,;:!?()[]{}\"'\n\r\t")


def _phrase_end(value: bytes, tail: bytes) -> int:
    """Where a quoted value that starts as `value` and continues as `tail` most likely ends: the
    index in `tail` of the first punctuation, or of the space before a lowercase word when
    every word so far is capitalized (a name: `Maria Gonzalez| is`), unless it is a short word
    between capitalized ones (`Museum of Modern Glass`); -1 when neither comes."""
    head = tail.split(b" ", 1)[0]  # the rest of the value's last word
    capitalized = all(_capitalized(w) for w in (value + head).split())
    for i, c in enumerate(tail):
        if c in _PHRASE_ENDS:
            return i
        if c == 0x20 and i + 1 < len(tail) and 97 <= tail[i + 1] <= 122:  # a lowercase word
            joins = _joins_names(tail, i + 1)
            if capitalized and not joins:
                return i
            capitalized = capitalized and joins
    return -1


def _capitalized(word: bytes) -> bool:
    """Whether the word's first letter or digit is not a lowercase ASCII letter (`"Maria`,
    `1990`, `Ødegaard`)."""
    first = next((c for c in word if _in_word(c)), None)
    return first is None or not 97 <= first <= 122


def _joins_names(tail: bytes, at: int) -> bool:
    """Whether the lowercase word at `tail[at]` is a short one followed by a capitalized word
    (`of`, `de`, `and` inside a name)."""
    space = tail.find(b" ", at)
    return 0 < space - at <= 3 and space + 1 < len(tail) and 65 <= tail[space + 1] <= 90


class TextDrafter:
    """Prompt lookup on text, for one request (module docstring).

    The suffix is the longest one of `min_n` to `max_n` bytes that occurred earlier; when no
    suffix longer than the partial word at the end of the text does, the partial word is
    matched at the start of an earlier word instead (`"Riv` finds ` Riverside`; `_copy_of`). The
    continuation (`lookahead` bytes after the match) is tokenized together with the partial
    word, and the drafts are the tokens after those that spell the partial word (none when the
    tokenization does not split there), without the last one, which the cut may have split.

    While the output has a quote open (`"` not closed yet, as in a JSON string value), the
    continuation ends where the copied phrase does (`_phrase_end`) and a closing `"` follows it.
    """

    def __init__(
        self,
        token_bytes: Callable[[int], bytes],
        encode: Callable[[str], list[int]],
        min_n: int,
        max_n: int,
        lookahead: int = 48,
    ) -> None:
        self._token_bytes = token_bytes
        self._encode = encode
        self.min_n = min_n
        self.max_n = max_n
        self.lookahead = lookahead
        self._text = bytearray()
        self._count = 0
        self._quote = -1  # where the output's open quoted string starts (-1: none open)
        self._escaped = False  # the output's last byte is a backslash inside that string

    def extend(self, tokens: Sequence[int], output: bool = True) -> None:
        """Append tokens to the request's history (`output`: generated, not the prompt)."""
        for t in tokens:
            b = self._token_bytes(t)
            if output:
                self._track_quotes(b, len(self._text))
            self._text += b
        self._count += len(tokens)

    def _track_quotes(self, b: bytes, at: int) -> None:
        for i, c in enumerate(b):
            if self._escaped:
                self._escaped = False
            elif c == 0x5C and self._quote >= 0:
                self._escaped = True
            elif c == 0x22:
                self._quote = -1 if self._quote >= 0 else at + i + 1

    def __len__(self) -> int:
        return self._count

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that continue the text as its latest earlier match did."""
        text = self._text
        end = len(text)
        if k <= 0 or end < 2:
            return []
        start = end
        while start > 0 and end - start < self.max_n and _in_word(text[start - 1]):
            start -= 1
        word = bytes(text[start:end])
        n, at = self._longest_suffix(end)
        if n > len(word) and n >= self.min_n:
            cont = at + n
        elif word:
            cont = self._copy_of(word, end)
            if cont < 0:
                return []
        else:
            return []
        tail = bytes(text[cont : cont + self.lookahead])
        closed = False
        if self._quote >= 0:
            cut = _phrase_end(bytes(text[self._quote : end]), tail)
            if cut >= 0:
                tail, closed = tail[:cut] + b'"', True
        try:
            spelled = (word + tail).decode()
        except UnicodeDecodeError:  # a cut inside a character: retry without its bytes
            spelled = (word + tail).decode(errors="ignore")
            if not spelled.encode().startswith(word):
                return []
        tokens = self._encode(spelled)
        covered = b""
        i = 0
        while len(covered) < len(word) and i < len(tokens):
            covered += self._token_bytes(tokens[i])
            i += 1
        if covered != word:
            return []
        whole = closed or cont + self.lookahead >= end
        return tokens[i : len(tokens) if whole else len(tokens) - 1][:k]

    def _longest_suffix(self, end: int) -> tuple[int, int]:
        """(length, start of its latest earlier occurrence) of the longest suffix of at most
        `max_n` bytes that also occurs ending before the last byte; (0, -1) when none does.
        A suffix that occurs earlier has shorter ones that do too: binary search."""
        text = self._text
        lo, at = 0, -1
        hi = min(self.max_n, end - 1)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            p = text.rfind(text[end - mid :], 0, end - 1)
            if p >= 0:
                lo, at = mid, p
            else:
                hi = mid - 1
        return lo, at

    def _copy_of(self, word: bytes, end: int) -> int:
        """Where the text continues after an earlier word that starts with the partial `word`
        (-1: none): the latest one; inside a quoted value, the one whose phrase runs longest (a
        passage names `Maria Gonzalez` first and `Maria` after), the latest among equals. A
        word copied at the start of a value may change the case of its first letter (`"Arch`
        for ` architect`): that is tried when no earlier word starts with `word` as written."""
        conts = self._word_starts(word, end)
        if not conts and word[:1].isalpha():
            conts = self._word_starts(word[:1].swapcase() + word[1:], end)
        if not conts:
            return -1
        if self._quote < 0:
            return conts[0]
        value = bytes(self._text[self._quote : end])

        def phrase(cont: int) -> int:
            cut = _phrase_end(value, bytes(self._text[cont : cont + self.lookahead]))
            return cut if cut >= 0 else self.lookahead

        return max(conts, key=phrase)

    def _word_starts(self, word: bytes, end: int, most: int = 16) -> list[int]:
        """Where the text continues after each earlier word that starts with `word`, latest
        first (the `most` latest)."""
        text = self._text
        out: list[int] = []
        limit = end - 1
        while len(out) < most:
            p = text.rfind(word, 0, limit)
            if p < 0:
                break
            if p == 0 or not _in_word(text[p - 1]):
                out.append(p + len(word))
            limit = p + len(word) - 1
        return out


# The weight of a request's previous verification against its latest in its acceptance estimate.
RECENT = 0.7


@dataclass
class DraftBudget:
    """How many drafts one request gets per step (module docstring)."""

    config: DraftConfig
    k: int = 0
    misses: int = 0
    paused: int = 0  # steps left without drafting
    pauses: int = 0
    proposed: int = field(default=0)
    accepted: int = field(default=0)
    # Accepted drafts and rejections (verifications that stopped at a rejected draft), each
    # verification's counts weighted `RECENT` times the one before: copies come in runs.
    recent_accepted: float = field(default=0.0)
    recent_rejections: float = field(default=0.0)
    # Declined drafts not scored yet, and the output index the first of them was proposed for.
    _declined: tuple[list[int], int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.k <= 0:
            self.k = self.config.num_draft_tokens

    def want(self) -> int:
        """Drafts to ask the drafter for this step (0 while paused; counts the pause down)."""
        if self.paused > 0:
            self.paused -= 1
            return 0
        return self.k

    def acceptance(self) -> float:
        """The chance that a draft is accepted given the ones before it were: recent accepted
        drafts over recent accepted drafts and rejections, from a prior of one of each."""
        return (self.recent_accepted + 1) / (self.recent_accepted + self.recent_rejections + 2)

    def _estimate(self, proposed: int, accepted: int) -> None:
        """`acceptance`'s counts after `accepted` of `proposed` drafts were (or would have been)
        accepted."""
        self.recent_accepted = RECENT * self.recent_accepted + accepted
        self.recent_rejections = RECENT * self.recent_rejections + (accepted < proposed)

    def declined(self, drafts: Sequence[int], at: int) -> None:
        """Drafts the gate declined, proposed for the output from index `at`: `score_declined`
        scores them once the output shows how far they would have been accepted (one
        proposal at a time: later ones are dropped while it waits)."""
        if self._declined is None and drafts:
            self._declined = (list(drafts), at)

    def score_declined(self, output: Sequence[int]) -> None:
        """Count the declined drafts (`declined`) in the acceptance estimate, once `output`
        shows a token that differs from its draft or every draft's token. Verification keeps a
        draft while it equals the token drawn at its position, and a plain step draws that
        position's token with the same random number, so this is the outcome verification
        would have had (bar a forced token the grammar inserts before them). Unlike a
        verification it leaves the budget's size and pauses alone: declined drafts cost no
        pass, and a paused budget would miss the next copy."""
        if self._declined is None:
            return
        drafts, at = self._declined
        seen = output[at : at + len(drafts)]
        a = accepted_prefix(seen, drafts)
        if a < len(seen) or a == len(drafts):
            self._declined = None
            self._estimate(len(drafts), a)

    def record(self, proposed: int, accepted: int) -> None:
        """The outcome of a verification: `proposed` drafts reached the forward pass and the
        model agreed with the first `accepted` of them."""
        if proposed <= 0:
            return
        self.proposed += proposed
        self.accepted += accepted
        self._estimate(proposed, accepted)
        c = self.config
        if accepted == proposed:
            self.k = min(c.num_draft_tokens, self.k + 1)
            self.misses = 0
        elif accepted == 0:
            self.k = max(1, self.k // 2)
            self.misses += 1
            if self.misses >= c.patience:
                self.paused = min(c.cooldown << self.pauses, c.max_cooldown)
                self.pauses += 1
                self.misses = 0
        else:
            self.k = max(1, accepted + 1)
            self.misses = 0


def accepted_prefix(drawn: Sequence[int], drafts: Sequence[int], forced: range = range(0)) -> int:
    """How many leading drafts verification keeps: `drawn[j]` is the token the sampler drew
    (masked, from the target's distribution) at draft `j`'s position; a draft is kept while it
    equals the draw. With greedy rows that is "the masked argmax equals the draft"; with
    sampling it is exact speculative sampling for a deterministic drafter (a draft `d` survives
    with probability p(d), and the draw that replaces a rejected one follows p restricted to
    tokens other than `d`, the residual distribution). A draft the grammar forces (its index in
    `forced`) is kept whatever was drawn, as a jump-forward token is. The caller emits the
    first `a + 1` positions: the draft at a forced one, the draw at the others."""
    for j, d in enumerate(drafts):
        if j not in forced and (j >= len(drawn) or drawn[j] != d):
            return j
    return len(drafts)
