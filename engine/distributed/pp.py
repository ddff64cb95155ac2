"""Pipeline stages: one rank's slice of the model, and micro-batches through the pipeline.

`StageModel` keeps the contiguous decoder layers of its stage (sharded for TP when tp > 1),
the embedding on the first stage, the final norm and LM head on the last; the rest of the
loaded model is dropped. Its `forward` runs one scheduled step:

- The step's sequences are split into up to `num_micro_batches` (default pp; the environment
  variable TIDEPOOL_PP_MICRO_BATCHES overrides it, identically on every node) contiguous groups balanced by
  tokens (`split_micro_batches`; a sequence is never cut, so each group's attention metadata
  is the step's metadata restricted and re-based). Stage s receives micro-batch i from stage
  s-1 (hidden and residual stacked in one [2, tokens, hidden] message), runs its layers, sends
  it on with a non-blocking send and starts micro-batch i+1: while stage s+1 works on i,
  stage s works on i+1, so with M micro-batches a step's bubble is (pp-1)/(M+pp-1) instead of
  (pp-1)/pp. Steps themselves stay sequential (the next step's decodes need this step's
  tokens); vLLM's several batches in flight across steps is the next step, not done here.
- All ranks derive the same split from the same metadata, so message shapes never need a
  handshake. Metadata this module does not know how to split (a field added later) falls back
  to one micro-batch: correct, just without the overlap.
- With TP inside a stage every TP rank holds the full hidden state after the all-reduce, so
  TP rank r of stage s sends to TP rank r of stage s+1.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..layers.attention_metadata import AttentionMetadata
from ..models.llama import LlamaForCausalLM
from .parallel_state import RankInfo
from .tp import VocabShard, shard_layer, vocab_parallel_embedding

# Fields `split_micro_batches` knows how to restrict to a group of sequences.
_SPLITTABLE = frozenset(
    {
        "slot_mapping",
        "num_decode_seqs",
        "decode_block_tables",
        "decode_mask",
        "decode_kv_scratch",
        "prefills",
        "block_tables",
        "seq_lens",
        "cu_seqlens_q",
    }
)


@dataclass(slots=True)
class MicroBatch:
    token_start: int
    token_stop: int
    meta: AttentionMetadata


def split_micro_batches(meta: AttentionMetadata, num_tokens: int, max_micro_batches: int) -> list[MicroBatch]:
    """Contiguous groups of whole sequences (decodes then prefill chunks), balanced by token count."""
    whole = [MicroBatch(0, num_tokens, meta)]
    if max_micro_batches <= 1:
        return whole
    if any(f.name not in _SPLITTABLE and not _is_unset(getattr(meta, f.name), f) for f in dataclasses.fields(meta)):
        return whole
    units = [(i, 1) for i in range(meta.num_decode_seqs)]
    units += [(c.query_start, c.num_query_tokens) for c in meta.prefills]
    expected = 0
    for start, count in units:
        if start != expected:
            return whole  # not the documented layout: do not guess
        expected += count
    if expected != num_tokens or len(units) < 2:
        return whole
    bounds: list[int] = []
    seen = 0
    for index, (_, count) in enumerate(units[:-1]):
        seen += count
        if len(bounds) < max_micro_batches - 1 and seen * max_micro_batches >= (len(bounds) + 1) * num_tokens:
            bounds.append(index + 1)
    edges = [0, *bounds, len(units)]
    return [_restrict(meta, units, lo, hi) for lo, hi in itertools.pairwise(edges)]


def _is_unset(value: object, field: dataclasses.Field) -> bool:
    if value is None or (isinstance(value, list | tuple) and not value):
        return True
    return not isinstance(value, torch.Tensor) and field.default is not dataclasses.MISSING and value == field.default


def _restrict(meta: AttentionMetadata, units: list[tuple[int, int]], lo: int, hi: int) -> MicroBatch:
    t0 = units[lo][0]
    t1 = units[hi - 1][0] + units[hi - 1][1]
    num_decode = meta.num_decode_seqs
    d0, d1 = min(lo, num_decode), min(hi, num_decode)
    p0, p1 = max(lo - num_decode, 0), max(hi - num_decode, 0)
    scratch = meta.decode_kv_scratch
    if scratch is not None:
        rows = (d1 - d0) * meta.decode_block_tables.shape[1]
        scratch = (scratch[0][:rows], scratch[1][:rows])  # micro-batches run one after another: reuse
    cu = meta.cu_seqlens_q
    sub = dataclasses.replace(
        meta,
        slot_mapping=meta.slot_mapping[t0:t1],
        num_decode_seqs=d1 - d0,
        decode_block_tables=meta.decode_block_tables[d0:d1],
        decode_mask=None if meta.decode_mask is None or d1 == d0 else meta.decode_mask[d0:d1],
        decode_kv_scratch=scratch if d1 > d0 else None,
        prefills=[dataclasses.replace(c, query_start=c.query_start - t0) for c in meta.prefills[p0:p1]],
        block_tables=None if meta.block_tables is None else meta.block_tables[lo:hi],
        seq_lens=None if meta.seq_lens is None else meta.seq_lens[lo:hi],
        cu_seqlens_q=None if cu is None else cu[lo : hi + 1] - cu[lo],
    )
    return MicroBatch(t0, t1, sub)


class StageModel(nn.Module):
    def __init__(
        self,
        model: LlamaForCausalLM,
        info: RankInfo,
        layer_range: range,
        tp_group: dist.ProcessGroup | None,
        num_micro_batches: int,
    ) -> None:
        super().__init__()
        config = model.config
        self.config = config
        self.info = info
        self.tp_group = tp_group
        self.num_micro_batches = num_micro_batches if info.pp_size > 1 else 1
        self.hidden_size = config.hidden_size
        self.num_split_steps = 0  # steps that ran as more than one micro-batch (observability, tests)
        self.rotary = model.rotary
        self.layers = nn.ModuleList(model.layers[i] for i in layer_range)
        tp = info.tp_size
        if tp > 1:
            for layer in self.layers:
                shard_layer(layer, tp, info.tp_rank, tp_group)
        self.vocab = VocabShard.of(config.vocab_size, tp, info.tp_rank)
        self.embed_tokens: nn.Parameter | None = None
        self.lm_head: nn.Parameter | None = None
        self.norm = model.norm if info.is_last_stage else None
        if info.is_first_stage:
            self.embed_tokens = self._vocab_param(model.embed_tokens.data)
        if info.is_last_stage:
            tied_here = model.lm_head is None and self.embed_tokens is not None
            self.lm_head = self.embed_tokens if tied_here else self._vocab_param(model.lm_head_weight.data)

    def _vocab_param(self, weight: torch.Tensor) -> nn.Parameter:
        shard = weight if self.info.tp_size == 1 else self.vocab.slice_weight(weight)
        return nn.Parameter(shard, requires_grad=False)

    @property
    def num_local_layers(self) -> int:
        return len(self.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        lora_slots: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Run this stage over the step; the last stage returns final-norm hidden states [tokens, hidden].
        `lora_slots`: each token's LoRA slot (int32, -1: base model), only for a step with adapter tokens."""
        info = self.info
        dtype = self.config.torch_dtype
        outputs: list[torch.Tensor] = []
        sends: list[tuple[dist.Work | None, torch.Tensor]] = []
        micro_batches = split_micro_batches(meta, input_ids.shape[0], self.num_micro_batches)
        self.num_split_steps += len(micro_batches) > 1
        for mb in micro_batches:
            ids = input_ids[mb.token_start : mb.token_stop]
            num = ids.shape[0]
            if info.is_first_stage:
                x, residual = self._embed(ids), None
            else:
                buf = torch.empty(2, num, self.hidden_size, dtype=dtype, device=input_ids.device)
                dist.recv(buf, info.prev_rank)
                x, residual = buf[0], buf[1]
            cos_sin = self.rotary.cos_sin(positions[mb.token_start : mb.token_stop], x.dtype)
            mb_slots = None if lora_slots is None else lora_slots[mb.token_start : mb.token_stop]
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, cos_sin, kv_cache, mb.meta, mb_slots)
            if info.is_last_stage:
                outputs.append(self.norm(x, residual)[0])
            else:
                message = torch.stack((x, residual))
                sends.append((dist.isend(message, info.next_rank), message))  # keep the buffer alive
        for work, _ in sends:
            if work is not None:
                work.wait()
        if not info.is_last_stage:
            return None
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.info.tp_size == 1:
            return F.embedding(ids, self.embed_tokens)
        return vocab_parallel_embedding(ids, self.embed_tokens, self.vocab, self.tp_group)

    def shard_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary shard of the logits, [rows, shard width], in the model dtype."""
        return F.linear(hidden, self.lm_head)
