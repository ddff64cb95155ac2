"""Stage 1 of a model-runner step: a `SchedulerOutput` as plain host lists (`StepInputs`).

Token layout of a step: the scheduled sequences in scheduled order (the scheduler puts decodes
first); for each, its known tokens from `num_computed_tokens` on, then its speculative proposals
(which are not part of the request yet). A sequence with one new token that samples is a decode
(`decode_tables`, `decode_lens`); anything else is a prefill chunk (`prefills`). The rows whose
hidden states are read after the run: `sample_rows` (a sampling sequence's last token),
`spec_rows` (the last known token and each proposal) and `prompt_rows` (prompt logprobs).

LoRA: `lora_slots` holds each token's adapter slot (-1: base model) only when some scheduled
sequence runs with an adapter (`Request.lora_slot`); it stays empty otherwise, so a step without
adapter tokens is exactly what it was. A step with adapter tokens never replays a CUDA graph.

Nothing here touches a device: stage 2 (`runner_backend.py`) turns these lists into tensors and
attention metadata. `decode_batch` is the same stage for a step that replays a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .cuda_graphs import DecodeBatch
from .prompt_logprobs import PromptRows, rows_for
from .request import Request
from .sched_output import ScheduledSeq, SchedulerOutput


@dataclass(slots=True)
class PrefillSpan:
    """One prefill chunk on the host: where its queries sit and which blocks hold its context."""

    start: int  # tokens of the sequence already in the cache before this step
    query_start: int  # offset of the chunk's first token in the step's token layout
    num_new: int
    context_len: int  # start + num_new
    block_table: list[int]  # the blocks that hold context_len tokens


@dataclass(slots=True)
class SpecRows:
    """The logits rows of one request's speculative proposals: its last known token, then each proposal."""

    request_id: str
    first: int
    num: int


@dataclass(slots=True)
class StepInputs:
    """A step as host lists, one entry per token (ids, positions, slots) or per sequence (the rest)."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # flat KV cache slot of each new token
    decode_tables: list[list[int]] = field(default_factory=list)
    decode_lens: list[int] = field(default_factory=list)  # context length after this step
    prefills: list[PrefillSpan] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sample_requests: list[Request] = field(default_factory=list)
    spec_rows: list[SpecRows] = field(default_factory=list)
    prompt_rows: list[PromptRows] = field(default_factory=list)
    lora_slots: list[int] = field(default_factory=list)  # per token, only when some token has an adapter

    def add(self, seq: ScheduledSeq, block_size: int, with_prompt_logprobs: bool) -> None:
        """Append one scheduled sequence's tokens and rows."""
        start, num_new = seq.num_computed_tokens, seq.num_new_tokens
        context_len = start + num_new
        query_start = len(self.input_ids)
        rows = rows_for(seq, query_start) if with_prompt_logprobs else None
        if rows is not None:
            self.prompt_rows.append(rows)
        num_known = context_len - len(seq.spec_token_ids)
        lora_slot = seq.request.lora_slot
        if lora_slot is not None and not self.lora_slots:
            self.lora_slots.extend([-1] * query_start)  # the base-model tokens before the first adapter token
        if self.lora_slots or lora_slot is not None:
            self.lora_slots.extend([-1 if lora_slot is None else lora_slot] * num_new)
        self.input_ids.extend(seq.request.token_ids_slice(start, num_known))
        self.input_ids.extend(seq.spec_token_ids)
        blocks = seq.block_ids
        for pos in range(start, context_len):
            self.positions.append(pos)
            self.slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        table = blocks[: -(-context_len // block_size)]
        if num_new == 1 and seq.needs_sample:
            self.decode_tables.append(table)
            self.decode_lens.append(context_len)
        else:
            self.prefills.append(PrefillSpan(start, query_start, num_new, context_len, table))
        if seq.needs_sample and seq.spec_token_ids:
            num_rows = len(seq.spec_token_ids) + 1
            self.spec_rows.append(SpecRows(seq.request.request_id, len(self.input_ids) - num_rows, num_rows))
        elif seq.needs_sample:
            self.sample_rows.append(len(self.input_ids) - 1)
            self.sample_requests.append(seq.request)


def prepare_inputs(
    sched_out: SchedulerOutput, block_size: int, with_prompt_logprobs: bool, with_lora: bool = True
) -> StepInputs:
    """Stage 1: the step's host lists (`with_prompt_logprobs`: False for a draft's runner, nobody reads them;
    `with_lora`: False for a runner whose model holds no adapters, e.g. a speculative draft's)."""
    inputs = StepInputs()
    for seq in sched_out.scheduled:
        inputs.add(seq, block_size, with_prompt_logprobs)
    if not with_lora:
        inputs.lora_slots = []
    return inputs


def whole_prompt_inputs(token_ids: list[int], block_size: int) -> StepInputs:
    """One prompt prefilled from scratch into blocks 0, 1, ... (scoring through the paged path)."""
    num_tokens = len(token_ids)
    table = list(range(-(-num_tokens // block_size)))
    span = PrefillSpan(0, 0, num_tokens, num_tokens, table)
    return StepInputs(list(token_ids), list(range(num_tokens)), list(range(num_tokens)), prefills=[span])


def decode_batch(
    sched_out: SchedulerOutput, block_size: int, with_lora: bool = True
) -> tuple[DecodeBatch, list[Request]] | None:
    """The step as a `DecodeBatch` when it is decode-only (one new token, sampled, no proposals) and, `with_lora`,
    has no adapter token (the graphs hold no LoRA); else None."""
    batch = DecodeBatch([], [], [], [], [])
    for seq in sched_out.scheduled:
        if seq.num_new_tokens != 1 or not seq.needs_sample or seq.spec_token_ids:
            return None
        if with_lora and seq.request.lora_slot is not None:
            return None
        pos = seq.num_computed_tokens
        blocks = seq.block_ids
        batch.input_ids.append(seq.request.token_ids_slice(pos, pos + 1)[0])
        batch.positions.append(pos)
        batch.slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        batch.seq_lens.append(pos + 1)
        batch.block_tables.append(blocks[: -(-(pos + 1) // block_size)])
    return batch, [seq.request for seq in sched_out.scheduled]
