"""Log-probabilities of sampled tokens and the top alternatives, on the device.

:func:`token_logprobs` is pure and static-shape: the top alternatives always have width
:data:`TOP_WIDTH` (OpenAI's most ``top_logprobs``), whatever a request asked for; the host keeps
the first ``top_logprobs`` of them. Per row it reads either

* the **processed** distribution (the default): the distribution the token was drawn from, i.e.
  the penalised and biased logits, grammar mask applied, divided by the temperature (greedy rows:
  temperature 1). top-k / top-p truncation is not applied; or
* the **raw** distribution: the model's logits as they came out of the forward pass.
"""

from __future__ import annotations

import torch
from torch import Tensor

from neuron_worker.masks import unpack_mask

__all__ = ["TOP_WIDTH", "token_logprobs"]

TOP_WIDTH = 20
"""Top alternatives computed per row (OpenAI allows ``top_logprobs`` up to 20)."""


def token_logprobs(
    raw: Tensor,
    processed: Tensor,
    packed_mask: Tensor | None,
    temperature: Tensor,
    tokens: Tensor,
    raw_mode: Tensor,
    *,
    vocab_size: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(chosen [N], top_ids [N, K], top_logprobs [N, K])``, K = ``min(TOP_WIDTH, vocab)``.

    ``raw`` / ``processed``: float ``[N, L]`` logits before / after penalties and bias;
    ``packed_mask`` int32 ``[N, W]`` or None; ``temperature`` float ``[N]``; ``tokens`` int64
    ``[N]`` as sampled (negative for a row without a token: its ``chosen`` is meaningless);
    ``raw_mode`` bool ``[N]``. Forbidden tokens have logprob ``-inf`` in the processed
    distribution and sort last among the alternatives.
    """
    width = min(vocab_size, raw.shape[1])
    r = raw[:, :width].float()
    p = processed[:, :width].float()
    if packed_mask is not None:
        p = torch.where(unpack_mask(packed_mask, width), p, float("-inf"))
    t = torch.where(temperature > 0, temperature, 1.0).unsqueeze(1)
    dist = torch.where(raw_mode.unsqueeze(1), r, p / t)
    lp = torch.log_softmax(dist, dim=-1)
    chosen = lp.gather(1, tokens.clamp(min=0, max=width - 1).unsqueeze(1)).squeeze(1)
    top_lp, top_ids = lp.topk(min(TOP_WIDTH, width), dim=-1)
    return chosen, top_ids, top_lp
