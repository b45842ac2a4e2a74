from __future__ import annotations

from grammar_service.reasoning import ReasoningGate

VOCAB = {0: b"Hmm", 1: b" </", 2: b"think", 3: b">", 4: b"{", 5: b"</think>", 6: b">\n{"}


def tb(t: int) -> bytes:
    return VOCAB[t]


def test_marker_split_over_tokens_and_calls() -> None:
    g = ReasoningGate(b"</think>")
    assert g.feed([0, 1], tb) == 2 and not g.done
    assert g.would_end([2, 3, 4], tb) == 1
    assert g.feed([2, 3, 4], tb) == 2 and g.done  # token 4 is for the grammar
    assert g.feed([4], tb) == 0


def test_single_token_marker_and_marker_mid_token() -> None:
    g = ReasoningGate(b"</think>")
    assert g.feed([0, 5, 4], tb) == 2 and g.done
    g = ReasoningGate(b"</think>")
    # The marker ends inside token 6: its trailing bytes are not fed to the grammar.
    assert g.feed([1, 2, 6, 4], tb) == 3 and g.done


def test_empty_marker_means_constrained_from_the_start() -> None:
    assert ReasoningGate(b"").done
