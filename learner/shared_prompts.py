"""One sequence per prompt group: the prompt once, its responses after it.

The ``n`` samples of a GRPO group share their prompt. Run as ``n`` rows, the prompt's ``p``
tokens go through the model ``n`` times. Packed, the rows of a group that share a prompt
become one sequence

    prompt, response_1, ..., response_k

with position ids ``0..p-1`` for the prompt and ``p..p+l_i-1`` for every response (they
restart after the prompt), and a block attention mask: a prompt token attends causally to
the prompt; a response token attends to the whole prompt and causally to its own response.
Every logit is then computed from the same tokens at the same positions as in the row
layout, and the gradient reaching a shared prompt position is the sum over the group's
responses, as it is across rows: the update is the same (up to float summation order) for
``p (k - 1)`` fewer tokens a group. This is the shared-prefix forward of Prefix Grouper
(Liu et al., 2025, arXiv:2506.05433).

``pack`` builds the packed inputs of a pass; ``PackedRows.row_logits`` maps the packed
logits back onto the row layout ``(B, L, V)``, so log-probs, entropies and losses are
computed exactly as before.
"""

from __future__ import annotations

import msgspec
import torch

from learner.batch import TrainBatch

# attention implementations that take an arbitrary 4D mask: boolean for SDPA (True attends),
# additive float for eager
PACKABLE_ATTENTION = ("sdpa", "eager")


class PackedRows(msgspec.Struct, frozen=True):
    """Packed inputs of a pass: S sequences of length Lp, for B rows of length L."""

    input_ids: torch.Tensor  # (S, Lp) long
    position_ids: torch.Tensor  # (S, Lp) long
    attend: torch.Tensor  # (S, 1, Lp, Lp) bool: query q may attend to key k
    source: torch.Tensor  # (B, L) long: flat index into (S * Lp) of each row position

    def attention_mask(self, implementation: str) -> torch.Tensor:
        """The 4D mask in the form ``implementation`` expects: SDPA's boolean, or eager's
        additive float32 (added to any compute dtype's scores, it promotes them)."""
        if implementation == "sdpa":
            return self.attend
        return torch.zeros(self.attend.shape).masked_fill(~self.attend,
                                                          torch.finfo(torch.float32).min)

    def row_logits(self, packed_logits: torch.Tensor) -> torch.Tensor:
        """(S, Lp, V) packed logits -> (B, L, V) in the row layout (padding positions of a
        row read an arbitrary logit of its sequence; nothing reads them)."""
        flat = packed_logits.reshape(-1, packed_logits.shape[-1])
        return flat[self.source]


def pack(batch: TrainBatch) -> PackedRows:
    """Pack the rows of ``batch``: rows of one group with identical prompt tokens share a
    sequence; any other row gets a sequence of its own."""
    total = batch.attention_mask.sum(-1).tolist()
    response = batch.response_lengths.tolist()
    prompts = [t - r for t, r in zip(total, response)]
    sequences: dict[tuple, list[int]] = {}
    for row, (group, p) in enumerate(zip(batch.group_ids.tolist(), prompts)):
        key = (group, tuple(batch.input_ids[row, :p].tolist()))
        sequences.setdefault(key, []).append(row)
    lengths = [prompts[rows[0]] + sum(response[r] for r in rows) for rows in sequences.values()]
    count, width = len(sequences), max(lengths)
    rows, row_width = batch.attention_mask.shape
    input_ids = torch.zeros((count, width), dtype=torch.long)
    position_ids = torch.zeros((count, width), dtype=torch.long)
    segment = torch.full((count, width), -1, dtype=torch.long)  # 0 prompt, i response i
    source = torch.zeros((rows, row_width), dtype=torch.long)
    for index, members in enumerate(sequences.values()):
        p = prompts[members[0]]
        base = index * width
        input_ids[index, :p] = batch.input_ids[members[0], :p]
        position_ids[index, :p] = torch.arange(p)
        segment[index, :p] = 0
        offset = p
        for number, row in enumerate(members, start=1):
            length = response[row]
            end = offset + length
            input_ids[index, offset:end] = batch.input_ids[row, p:p + length]
            position_ids[index, offset:end] = torch.arange(p, p + length)
            segment[index, offset:end] = number
            source[row, :p] = base + torch.arange(p)
            source[row, p:p + length] = base + torch.arange(offset, end)
            source[row, p + length:] = base
            offset = end
    return PackedRows(input_ids=input_ids, position_ids=position_ids,
                      attend=_block_mask(segment), source=source)


def _block_mask(segment: torch.Tensor) -> torch.Tensor:
    """(S, Lp) segment ids (0 prompt, i > 0 response i, -1 padding) -> (S, 1, Lp, Lp):
    causal, within the prompt or the query's own segment; padding attends to itself."""
    width = segment.shape[1]
    causal = torch.ones((width, width), dtype=torch.bool).tril()
    query, key = segment[:, :, None], segment[:, None, :]
    padding = query < 0
    attend = causal & ~padding & (key >= 0) & ((key == 0) | (key == query))
    attend |= torch.eye(width, dtype=torch.bool) & padding
    return attend[:, None]
