"""The serving stages of a sharded worker that name vocabulary columns: logprobs over slices equal
the whole row's, and penalties applied slice by slice with localized inputs equal the whole
row's. Every rank is simulated in one process (the all-gather is a stack)."""

from __future__ import annotations

import pytest
import torch

from maskwire.bitmask import words_per_row
from neuron_worker.logprobs import TOP_WIDTH, token_logprobs
from neuron_worker.parallel import shard_mask_words, vocab_shards
from neuron_worker.parallel.logprobs import combine_logprobs, local_logprob_parts
from neuron_worker.parallel.serving import localize_rows
from neuron_worker.penalties import OccurrenceTable, PenaltyTensors, apply_penalties
from neuron_worker.sampling_rows import SamplingRow, SamplingRows

VOCAB = 300  # the tokenizer's
LOGITS = 320  # the model's row: 20 padded columns never count


def _inputs(rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(rows, LOGITS, generator=g) * 3
    bits = torch.randint(-(2**31), 2**31, (rows, words_per_row(VOCAB)), generator=g)
    return {
        "raw": raw,
        "processed": raw + torch.randn(rows, LOGITS, generator=g),
        "mask": bits.to(torch.int32),
        "temperature": torch.tensor([0.0, 0.7, 1.0, 1.5] * (rows // 4)),
        "raw_mode": torch.tensor([False, False, True, False] * (rows // 4)),
    }


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_logprobs_equal_the_whole_row(world: int) -> None:
    x = _inputs(8)
    full = token_logprobs(
        x["raw"],
        x["processed"],
        x["mask"],
        x["temperature"],
        torch.zeros(8, dtype=torch.int64),  # replaced below per row
        x["raw_mode"],
        vocab_size=VOCAB,
    )
    # A sampled token per row: its best allowed alternative (another rank's slice for some rows).
    tokens = full[1][:, 0].clone()
    tokens[1] = full[1][1, 3]
    chosen, top_ids, top_lp = token_logprobs(
        x["raw"],
        x["processed"],
        x["mask"],
        x["temperature"],
        tokens,
        x["raw_mode"],
        vocab_size=VOCAB,
    )
    parts = [
        local_logprob_parts(
            x["raw"][:, s.start : s.stop],
            x["processed"][:, s.start : s.stop],
            shard_mask_words(x["mask"], s),
            x["temperature"],
            tokens,
            x["raw_mode"],
            shard=s,
            vocab_size=VOCAB,
        )
        for s in vocab_shards(LOGITS, world)
    ]
    got = combine_logprobs(torch.stack(parts), k=min(TOP_WIDTH, VOCAB))
    assert torch.allclose(got[0], chosen, atol=1e-5)
    assert torch.equal(got[1], top_ids)
    assert torch.allclose(got[2], top_lp, atol=1e-5)
    assert (got[1] < VOCAB).all()  # padded model columns are never an alternative


def _penalised(table: OccurrenceTable, logits: torch.Tensor, e: SamplingRows) -> torch.Tensor:
    for slot, prompt in e.reset:
        table.reset(slot, prompt)
    table.add(e.count)
    counts, seen = table.rows(torch.tensor([r.slot for r in e.rows]))
    t = PenaltyTensors.build(
        presence=[r.presence for r in e.rows],
        frequency=[r.frequency for r in e.rows],
        repetition=[r.repetition for r in e.rows],
        logit_bias=[r.logit_bias for r in e.rows],
        n_rows=logits.shape[0],
    )
    return apply_penalties(
        logits, counts, seen, t.presence, t.frequency, t.repetition, t.bias_ids, t.bias_values
    )


@pytest.mark.parametrize("world", [2, 3])
def test_penalties_slice_by_slice_equal_the_whole_row(world: int) -> None:
    extras = SamplingRows(
        [
            SamplingRow(
                presence=0.5,
                frequency=0.3,
                repetition=1.2,
                logit_bias={5: 3.0, 250: -100.0, 319: 7.0},
                slot=0,
            ),
            SamplingRow(slot=3),
            SamplingRow(presence=1.0, repetition=1.5, logit_bias={120: 2.5, 299: -1.0}, slot=2),
        ],
        count=[(0, 5), (0, 5), (0, 250), (2, 7), (2, 260), (2, 119)],
        reset=[(0, [1, 2, 3, 250, 251]), (2, [100, 101, 299])],
        any_penalty=True,
    )
    logits = torch.randn(3, LOGITS, generator=torch.Generator().manual_seed(5))
    whole = _penalised(OccurrenceTable(slots=4, logits_size=LOGITS, device="cpu"), logits, extras)
    parts = []
    for s in vocab_shards(LOGITS, world):
        local = localize_rows(extras, s)
        assert all(0 <= t < s.width for _, t in local.count)
        table = OccurrenceTable(slots=4, logits_size=s.width, device="cpu")
        parts.append(_penalised(table, logits[:, s.start : s.stop], local))
    assert torch.allclose(torch.cat(parts, dim=1), whole)
    assert not torch.allclose(whole, logits)  # the penalties did something
