"""MLA + DeepSeek sparse attention + MoE family: GLM-MoE-DSA (the GLM-5.2 layout).

State per position and layer: one row of MLA's compressed KV latent (after ``kv_a_layernorm``, ``kv_lora_rank``
values) and the shared rope key (``qk_rope_head_dim``) side by side, and on layers that run their own DSA indexer,
the indexer key (``index_head_dim``). Attention runs in MLA's absorbed form — ``q_nope·(W_uk c) = (W_ukᵀ q_nope)·c``
and ``p·(W_uv c) = W_uv (p·c)`` — so the prefix latent is read as it is stored and never expanded per head: the
attention core's op with one KV head whose keys and values are the stored rows.

DSA, from its definition: query t scores every visible key s with ``Σ_h w_h(t)·relu(q_h(t)·k(s))·scale`` and
attends only to its ``index_topk`` best keys (all of them while t has fewer). Ties are broken towards earlier
positions (a stable sort), so a position's selection — and its logits — do not depend on where a prefix/branch
split falls. ("shared" layers reuse the selection of the previous full-indexer layer, as in transformers.) The
selection is discrete: as in transformers the indexer gets no gradient from the language-model loss.
transformers 5.24's own DSA paths disagree with each other when ``index_topk`` < context; parity with it is
tested only where ``index_topk`` >= context, and causal consistency everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from longstraw_agents.attention import Attention, KVBlock, merge, selected_partial, sparse_attend
from longstraw_agents.kernels import dsa_kernels_on
from longstraw_agents.models.base import (
    DecoderLayer,
    FamilyAdapter,
    HFModule,
    LayerWork,
    Mixer,
    MixerInput,
    MixerOutput,
    UnsupportedModelError,
    bound_norm,
    causal_pairs,
    compute_dtype,
    norm_eps,
    rms_norm,
)
from longstraw_agents.models.batch import (
    BlockTensors,
    DecodeInput,
    PositionedBlock,
    cascade_attention,
    write_session,
)
from longstraw_agents.models.grouped import Groups, Routing, grouped_linear
from longstraw_agents.models.lora import base_module, effective_weight, low_rank_factors

SELECTION_KEY = "dsa_selection"
Selection = tuple[Tensor, Tensor]
"""A decode batch's DSA selection: positions ``[B, k]`` and which of them are real keys ``[B, k]``."""


def rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """DeepSeek/GLM interleaved RoPE on ``x [n, H, D]``: pairs (x0, x1), (x2, x3)…, output de-interleaved
    (rotated evens, then rotated odds), exactly as transformers' ``apply_rotary_pos_emb_interleave``."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def stable_topk(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` best scores of each row of ``scores [n, c]`` and their columns, best first, ties to the earlier
    column: exactly ``torch.sort(scores, dim=1, descending=True, stable=True)`` cut to ``k`` columns (scores without
    NaN), at the cost of one ``topk`` over each row and a sort of ``k`` — sorting whole rows of thousands of keys is
    several times slower. On CUDA it reads nothing on the host (a decoding step is captured in a CUDA graph)."""
    if scores.shape[1] <= k or scores.device.type == "meta":  # short rows; meta (the memory planner): no values
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
        return scores.gather(1, order), order
    values, columns = scores.topk(k, dim=1, sorted=False)
    cut = values.amin(dim=1, keepdim=True)  # each row's k-th best score
    # topk keeps an arbitrary few of the scores equal to the cut: where a row has more of them, take its earliest
    # (off the CPU always, which changes nothing where no tie straddles the cut: the check would wait for the device)
    if not ties_checked_on_host(scores) or bool(((scores == cut).sum(dim=1) > (values == cut).sum(dim=1)).any()):
        columns = _earliest_at_cut(scores, cut, k)
    columns = columns.sort(dim=1).values  # column order, so that the stable sort by score breaks ties by column
    values = scores.gather(1, columns)
    order = torch.sort(values, dim=1, descending=True, stable=True).indices
    return values.gather(1, order), columns.gather(1, order)


def ties_checked_on_host(scores: Tensor) -> bool:
    """``stable_topk`` first checks whether ties straddle the cut (a read on the host, free on CPU); elsewhere it
    breaks them whether or not they do, on the device alone."""
    return scores.device.type == "cpu"


def _earliest_at_cut(scores: Tensor, cut: Tensor, k: int) -> Tensor:
    """Columns ``[n, k]`` (ascending) of each row's scores above ``cut [n, 1]`` and, filling the row to ``k``, of its
    earliest scores equal to it."""
    above = scores > cut
    at_cut = scores == cut
    room = k - above.sum(dim=1, keepdim=True)
    chosen = above | (at_cut & (at_cut.cumsum(dim=1) <= room))  # exactly k a row: the cut is the k-th best score
    earlier_first = torch.arange(scores.shape[1], 0, -1, device=scores.device)  # every chosen column above 0
    return (chosen * earlier_first).topk(k, dim=1).indices.sort(dim=1).values


class BestKeys:
    """The best ``k`` (score, position) pairs of each query over keys scored piece by piece, best first, ties to the
    earlier position.

    Pieces must come in position order (after the running best, if one is given: earlier positions). They are held
    until their scores reach ``budget`` elements and then reduced with one ``stable_topk`` over all of them: the
    same selection as reducing after every piece (ranking by score, then position, does not depend on how the
    candidates are grouped), in fewer, larger selections."""

    def __init__(self, k: int, budget: int, running: tuple[Tensor, Tensor] | None = None):
        self.k, self.budget = k, budget
        self.running = running  # scores and positions [n, <= k], best first
        self.scores: list[Tensor] = []  # pieces [n, m]
        self.positions: list[Tensor] = []  # their keys' positions [m]

    def add(self, scores: Tensor, positions: Tensor) -> None:
        self.scores.append(scores)
        self.positions.append(positions)
        if sum(s.numel() for s in self.scores) >= self.budget:
            self._reduce()

    def result(self) -> tuple[Tensor, Tensor] | None:
        """The best ``k`` so far (fewer while fewer keys were seen; None before any)."""
        if self.scores:
            self._reduce()
        return self.running

    def _reduce(self) -> None:
        held = [] if self.running is None else [self.running[0]]
        scores, columns = stable_topk(torch.cat([*held, *self.scores], dim=1), self.k)
        offset = held[0].shape[1] if held else 0  # the running best come first
        positions = torch.cat(self.positions)[(columns - offset).clamp(min=0)]
        if self.running is not None:
            earlier = self.running[1].gather(1, columns.clamp(max=offset - 1))
            positions = torch.where(columns < offset, earlier, positions)
        self.running = (scores, positions)
        self.scores, self.positions = [], []


def index_kernel_applies(q: Tensor) -> bool:
    """The indexer's Triton kernel runs here: CUDA tensors, Triton installed, the DSA kernels not switched off."""
    return q.is_cuda and dsa_kernels_on()


class DSAIndexer:
    """The lightning indexer of one layer: produces index keys for the state and top-k selections."""

    def __init__(self, indexer: HFModule, topk: int):
        self.mod = indexer
        self.topk = topk
        self.heads, self.dim = indexer.n_heads, indexer.head_dim
        self.rope_dim = indexer.qk_rope_head_dim

    def keys(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        k = self.mod.k_norm(self.mod.wk(x)).unsqueeze(1)  # [n, 1, Di]
        k_rot, k_pass = k.split([self.rope_dim, self.dim - self.rope_dim], dim=-1)
        return torch.cat([rope_interleaved(k_rot, *rope), k_pass], dim=-1)[:, 0]

    def select(
        self,
        x: Tensor,
        q_resid: Tensor,
        rope: tuple[Tensor, Tensor],
        past: list[Tensor],
        own: Tensor,
        start: int,
        attention: Attention,
        past_starts: list[int] | None = None,
    ) -> Tensor | None:
        """Global positions ``[n, topk]`` each query attends to, or None when every query may see all keys.

        past_starts: the position of each past block's first key (default: back to back from 0); ``attention``:
        the score budget (``max_score_elements``), the products' precision, and the shards (the other ranks holding
        the rest of the keys: their best candidates merge into the global top-k)."""
        n = x.shape[0]
        if start + n <= self.topk:
            return None
        q, w = self._queries(x, q_resid, rope)
        starts = (
            past_starts if past_starts is not None else [sum(k.shape[0] for k in past[:i]) for i in range(len(past))]
        )
        budget, shards = attention.max_score_elements, attention.shards
        fast = own.dtype in (torch.bfloat16, torch.float16) and not attention.exact_products
        best = self._score_keys(q, w, past, starts, budget, fast)
        hidden = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)  # later own positions
        own_scores = self._scores(q, w, own, fast).masked_fill(hidden, float("-inf"))
        if shards is not None:  # every rank's best candidates, merged
            best = BestKeys(self.topk, budget, shards.merge_topk(best.result(), n, self.topk, own_scores))
        best.add(own_scores, torch.arange(start, start + n, device=x.device))
        selected = best.result()
        assert selected is not None  # the own keys were just added
        return selected[1]

    def select_batch(self, x: Tensor, q_resid: Tensor, inp: DecodeInput, session_keys: Tensor) -> Selection | None:
        """Decoding: member b's ``index_topk`` positions ``[B, k]`` and which of them are real keys (a member that
        sees fewer than k keys has padding), or None while every member sees all its keys. Each group's queries
        score its blocks together (one einsum per piece of keys); session keys (``[B, L, D]``, the new one included)
        are scored padded to the longest. With context parallelism every rank's best candidates among its blocks
        are merged before the session's join. Ties go to earlier positions, exactly as in ``select``."""
        batch, ctx = inp.batch, inp.context
        if batch.regime == 0:  # (no member sees more than topk keys: MLAAdapter.decode_regime)
            return None
        q, w = self._queries(x, q_resid, inp.rope)
        scores = torch.full((batch.size, self.topk), float("-inf"), dtype=q.dtype, device=x.device)
        positions = torch.full((batch.size, self.topk), -1, dtype=torch.long, device=x.device)
        budget = inp.attention.max_score_elements
        for group, blocks in zip(batch.groups, ctx.blocks, strict=True):
            if blocks:  # (with context parallelism this rank may hold none of them)
                rows = group.rows
                keys, starts = [block[1] for _, block in blocks], [start for start, _ in blocks]
                running = (scores[rows], positions[rows])  # a row's earlier groups hold its earlier positions
                fast = keys[0].dtype in (torch.bfloat16, torch.float16) and not inp.attention.exact_products
                found = self._score_keys(q[rows], w[rows], keys, starts, budget, fast, running).result()
                assert found is not None  # (the running best was given)
                scores[rows], positions[rows] = found
        if inp.attention.shards is not None:
            merged = inp.attention.shards.merge_topk((scores, positions), batch.size, self.topk, scores)
            assert merged is not None  # (this rank's candidates were given)
            scores, positions = merged
        dots = torch.matmul(q, session_keys.to(q.dtype).transpose(1, 2))  # [B, heads, L]
        session = torch.matmul(w.unsqueeze(1), self._relu_scores(dots))[:, 0] + 0.0
        session = session.masked_fill(~batch.session_mask, float("-inf"))
        session_positions = batch.session_start.unsqueeze(1) + torch.arange(session_keys.shape[1], device=x.device)
        top_scores, top = stable_topk(torch.cat([scores, session], 1), self.topk)  # (on the device alone)
        return torch.cat([positions, session_positions], 1).gather(1, top), top_scores > float("-inf")

    def _score_keys(
        self,
        q: Tensor,
        w: Tensor,
        blocks: list[Tensor],
        starts: list[int],
        budget: int,
        fast: bool,
        running: tuple[Tensor, Tensor] | None = None,
    ) -> BestKeys:
        """The best keys of ``blocks`` (index keys starting at positions ``starts``) for queries ``q``, scored in
        pieces whose scores stay within ``budget`` elements, after the ``running`` best (earlier keys')."""
        best = BestKeys(self.topk, budget, running)
        step = max(1, budget // q.shape[0])
        for keys, offset in zip(blocks, starts, strict=True):
            for lo in range(0, keys.shape[0], step):
                positions = torch.arange(offset + lo, offset + min(lo + step, keys.shape[0]), device=q.device)
                best.add(self._scores(q, w, keys[lo : lo + step], fast), positions)
        return best

    def _queries(self, x: Tensor, q_resid: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """The indexer's queries ``[n, heads, dim]`` and head weights ``[n, heads]``, in compute precision."""
        n = x.shape[0]
        dt = compute_dtype(x.dtype)
        q = self.mod.wq_b(q_resid).view(n, self.heads, self.dim)
        q_rot, q_pass = q.split([self.rope_dim, self.dim - self.rope_dim], dim=-1)
        q = torch.cat([rope_interleaved(q_rot, *rope), q_pass], dim=-1).to(dt)
        w = self.mod.weights_proj(x.to(self.mod.weights_proj.weight.dtype)).to(dt) * self.heads**-0.5
        return q, w

    def _relu_scores(self, dots: Tensor) -> Tensor:
        return F.relu(dots * self.mod.softmax_scale)

    def _scores(self, q: Tensor, w: Tensor, keys: Tensor, fast: bool = False) -> Tensor:
        """``[n, m] = sum_h w_h relu(q_h . k * scale)``, the heads added one after another into one ``[n, m]`` (no
        per-head ``[n, heads, m]``): on a GPU one Triton kernel (``kernels.index_scores``; ``fast``: bf16 tensor
        cores, for the keys of a half-precision model: bf16 values), else a matmul per head."""
        scale = float(self.mod.softmax_scale)
        if index_kernel_applies(q):
            from longstraw_agents.kernels.index_scores import index_scores

            return index_scores(q, w, keys, scale, fast)
        keys_t = keys.to(q.dtype).t()
        # from +0.0: a negative weight times relu's zero adds -0.0, which leaves it +0.0, so exact-zero ties compare
        # equal
        scores = torch.zeros(q.shape[0], keys.shape[0], dtype=q.dtype, device=q.device)
        for h in range(self.heads):
            scores += w[:, h : h + 1] * F.relu(torch.matmul(q[:, h], keys_t) * scale)
        return scores


class MLAMixer(Mixer):
    """Multi-head latent attention over the state's rows (compressed latent and rope key side by side, plus the DSA
    indexer key on layers with their own indexer), dense or DSA-sparse.

    Absorbed form: a query becomes ``[W_ukᵀ q_nope ; q_rope]`` and every row ``[latent ; rope key]`` serves as its key
    and — the same row — as its value, so the attention core runs it with one KV head and no copy of the state; the
    rope columns of the output are dropped and ``W_uv`` maps the latent output to the heads."""

    grows = True

    def __init__(self, attn: HFModule, config: Any):
        self.attn = attn
        self.heads = config.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
        self.rank = attn.kv_lora_rank
        self.scale = float(attn.scaling)
        self.indexer = DSAIndexer(attn.indexer, config.index_topk) if attn.indexer is not None else None
        self.q_norm = bound_norm(rms_norm, attn.q_a_layernorm)
        self.kv_norm = bound_norm(rms_norm, attn.kv_a_layernorm)

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        rows = ((self.rank + self.rope_dim),)
        return (rows, (self.indexer.dim,)) if self.indexer is not None else (rows,)

    def _project(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """The query's low-rank residual (the indexer reads it), the absorbed queries ``[n, H, rank + rope]`` and the
        new rows ``[n, rank + rope]`` (each a key and a value at once)."""
        attn, n = self.attn, x.shape[0]
        q_resid = self.q_norm(attn.q_a_proj(x))
        q = attn.q_b_proj(q_resid).view(n, self.heads, self.nope + self.rope_dim)
        q_nope, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        w_uk = self._up_weights()[0]
        q_rows = torch.cat([torch.einsum("nhd,hdr->nhr", q_nope, w_uk), rope_interleaved(q_rot, *rope)], dim=-1)
        return q_resid, q_rows, self._rows(x, rope)

    def _rows(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        """The new rows ``[n, rank + rope]``: normed latent and rotated rope key."""
        kv_pass, k_rot = self.attn.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        k_rot = rope_interleaved(k_rot.unsqueeze(1), *rope)[:, 0]
        return torch.cat([self.kv_norm(kv_pass), k_rot], dim=-1)

    def _up_weights(self) -> tuple[Tensor, Tensor]:
        """``W_uk [H, nope, rank]`` and ``W_uv [H, v, rank]`` of the up-projection (a LoRA adapter's included)."""
        w_kv = effective_weight(self.attn.kv_b_proj).view(self.heads, self.nope + self.v_dim, self.rank)
        return w_kv[:, : self.nope], w_kv[:, self.nope :]

    def _output(self, out: Tensor) -> Tensor:
        latent_out = out[..., : self.rank]  # [n, H, rank]: the rope columns are not values
        w_uv = self._up_weights()[1]
        return self.attn.o_proj(torch.einsum("nhr,hvr->nhv", latent_out, w_uv).reshape(out.shape[0], -1))

    def forward(self, inp: MixerInput) -> MixerOutput:
        x = inp.x
        q_resid, q_rows, rows = self._project(x, inp.rope)
        new: tuple[Tensor, ...] = (rows,)
        if self.indexer is not None:
            index_keys = self.indexer.keys(x, inp.rope)
            new = (rows, index_keys)
            with torch.no_grad():
                past_keys, starts = [b.tensors[1] for b in inp.past], [b.start for b in inp.past]
                selected = self.indexer.select(
                    x, q_resid, inp.rope, past_keys, index_keys, inp.start, inp.attention, starts
                )
            inp.shared[SELECTION_KEY] = selected
        else:
            selected = self._shared_selection(inp.shared)
        if selected is None:
            blocks = [KVBlock(b.tensors[0][:, None], b.tensors[0][:, None], *2 * [_heads(b.grad(0))]) for b in inp.past]
            own = rows[:, None]
            out = inp.attention(q_rows, blocks, own, own, self.scale)
        else:
            out = sparse_attend(
                q_rows, [b.tensors[0] for b in inp.past], [b.grad(0) for b in inp.past], rows, selected,
                inp.start, self.scale, [b.start for b in inp.past], inp.attention,
            )  # fmt: skip
        return MixerOutput(y=self._output(out), new=new)

    def state_entries(self, inp: MixerInput) -> tuple[Tensor, ...]:
        """The rows (and index keys) alone: no queries, no selection, no attention."""
        rows = self._rows(inp.x, inp.rope)
        return (rows, self.indexer.keys(inp.x, inp.rope)) if self.indexer is not None else (rows,)

    def decode(self, inp: DecodeInput) -> MixerOutput:
        """Dense: the cascade over the rows (one KV head). DSA: each member's selected rows, gathered from its
        group's prefix and its own rows (``sparse_decode``)."""
        x = inp.x
        q_resid, q_rows, rows = self._project(x, inp.rope)
        selection: Selection | None
        if self.indexer is not None:
            session_rows, session_keys = write_session(inp, (rows, self.indexer.keys(x, inp.rope)))
            with torch.no_grad():
                selection = self.indexer.select_batch(x, q_resid, inp, session_keys)
            inp.shared[SELECTION_KEY] = selection
        else:
            (session_rows,) = write_session(inp, (rows,))
            selection = self._shared_selection(inp.shared)
        if selection is None:
            session = session_rows[:, :, None]  # one KV head
            out = cascade_attention(q_rows, session, session, inp, self.scale, kv_of=_rows_as_kv)
        else:
            out = sparse_decode(q_rows, session_rows, inp, selection, self.scale)
        return MixerOutput(y=self._output(out), new=())

    @staticmethod
    def _shared_selection(shared: dict[str, Any]) -> Any:
        """A "shared" layer's selection: the previous full-indexer layer's (None: every key visible)."""
        if SELECTION_KEY not in shared:
            raise UnsupportedModelError("a 'shared' DSA layer needs an earlier layer with its own indexer")
        return shared[SELECTION_KEY]


def _rows_as_kv(block: BlockTensors) -> tuple[Tensor, Tensor]:
    """A block's rows ``[M, W]`` as the keys and the values of one KV head (views)."""
    rows = block[0][:, None]
    return rows, rows


def sparse_decode(q: Tensor, session_rows: Tensor, inp: DecodeInput, selection: Selection, scale: float) -> Tensor:
    """DSA attention of a decode step: member b's query ``q[b] [H, W]`` over its selected rows, gathered from its
    groups' blocks and its session rows ``session_rows[b] [L, W]`` (``write_session``'s buffer). With context
    parallelism the rows of the blocks held here give a partial result merged over the ranks, and the session's,
    which every rank holds, join it once. Forward only. Returns ``[B, H, W]``."""
    selected, valid = selection
    batch = inp.batch
    gathered = session_rows.new_zeros((*selected.shape, session_rows.shape[-1]))  # [B, k, W]
    here = torch.zeros_like(selected, dtype=torch.bool)
    for group, blocks in zip(batch.groups, inp.context.blocks, strict=True):
        rows, found = _gather_blocks(gathered[group.rows], blocks, selected[group.rows])
        gathered[group.rows], here[group.rows] = rows, here[group.rows] | found
    earlier = selected_partial(q, gathered, valid & here, scale)
    if inp.attention.shards is not None:
        earlier = inp.attention.shards.merge_partials(earlier, tuple(earlier[0].shape), earlier[1])
    relative = selected - batch.session_start.unsqueeze(1)
    index = relative.clamp(0, session_rows.shape[1] - 1).unsqueeze(-1).expand(-1, -1, session_rows.shape[-1])
    out, _ = merge(earlier, *selected_partial(q, session_rows.gather(1, index), valid & (relative >= 0), scale))
    return out.to(q.dtype)


def _gather_blocks(gathered: Tensor, blocks: list[PositionedBlock], selected: Tensor) -> tuple[Tensor, Tensor]:
    """``gathered [g, k, W]`` with the selected positions that fall in ``blocks`` filled in, and which slots they
    filled."""
    found = torch.zeros_like(selected, dtype=torch.bool)
    for start, block in blocks:
        rows = block[0]
        relative = selected - start
        inside = (relative >= 0) & (relative < rows.shape[0])
        gathered = torch.where(inside.unsqueeze(-1), rows[relative.clamp(0, rows.shape[0] - 1)], gathered)
        found |= inside
    return gathered, found


def _heads(t: Tensor | None) -> Tensor | None:
    """Rows ``[M, W]`` as one KV head ``[M, 1, W]`` (a view)."""
    return None if t is None else t[:, None]


class MoE:
    """GLM/DeepSeek-V3 MoE: sigmoid router with group-limited top-k + routed experts + shared experts.

    The router runs in compute precision (transformers forces fp32, which would cap fp64 gradient checks). The routed
    experts run as grouped matmuls (``models.grouped``): the tokens' slots sorted by expert on the device, one
    grouped GEMM per projection (``gate_up_proj``, ``down_proj``) forward and backward, and each token's outputs added
    slot after slot in expert order — what transformers' eager experts (a loop over the chosen experts in id order)
    add, in the same order, with no host sync on Hopper's grouped kernel or for decoding's small batches, so that
    decoding can be captured in a CUDA graph. ``routed`` computes the routed experts' sum for the tokens: ``local``
    (every expert here), or what parallel code puts in its place (``parallel.experts``: each rank its own experts,
    the sums combined over the ranks) — the model holds no parallelism of its own.

    LoRA (``models.lora``): the router's weight is read with its adapter, and the routed experts' adapters (PEFT's
    ``target_parameters`` on ``gate_up_proj`` / ``down_proj``) run as two grouped low-rank products per projection.
    """

    def __init__(self, moe: HFModule):
        self.moe = moe
        # the transformers modules (their settings and weights), beneath PEFT's wrappers where it adapted them
        self.gate, self.experts = base_module(moe.gate), base_module(moe.experts)
        self.routed: Callable[[Tensor, Tensor, Tensor], Tensor] = self.local

    @property
    def num_experts(self) -> int:
        return int(self.gate.num_experts)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        gate = self.gate
        dt = compute_dtype(x.dtype)
        scores = F.linear(x.to(dt), effective_weight(self.moe.gate).to(dt)).sigmoid()
        choice = scores + gate.e_score_correction_bias.to(dt)
        per_group = gate.num_experts // gate.num_group
        group_scores = choice.view(-1, gate.num_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=gate.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
        expert_mask = group_mask.unsqueeze(-1).expand(-1, gate.num_group, per_group).reshape(-1, gate.num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
        top_idx = torch.topk(choice, k=gate.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, top_idx)
        if gate.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return top_idx, weights * gate.routed_scaling_factor

    def __call__(self, x: Tensor) -> Tensor:
        top_idx, weights = self.route(x)
        return self.routed(x, top_idx, weights) + self.moe.shared_experts(x)

    def local(self, x: Tensor, top_idx: Tensor, weights: Tensor) -> Tensor:
        """Every routed expert, from the model's own weights (and their LoRA adapters)."""
        experts = self.moe.experts
        adapters = (low_rank_factors(experts, "gate_up_proj"), low_rank_factors(experts, "down_proj"))
        return self.experts_of(x, top_idx, weights, self.experts.gate_up_proj, self.experts.down_proj, 0, adapters)

    def experts_of(
        self,
        x: Tensor,
        top_idx: Tensor,
        weights: Tensor,
        gate_up: Tensor,
        down: Tensor,
        first: int = 0,
        adapters: tuple[LowRank, LowRank] | None = None,
    ) -> Tensor:
        """The sum over each token's chosen experts among ``first .. first + len(gate_up)`` (whose weights are
        ``gate_up`` and ``down``, stacked by expert) of its routing weight times the expert's output, added in expert
        order; zeros for a token that chose none of them. The slots of other experts sort last and take no part in
        the products (``Groups.partial``). On the meta device (the memory planner) it allocates what the grouped
        kernel does, whatever the routing. ``adapters``: each projection's LoRA factors (``lora.low_rank_factors``:
        every expert's, so only with every expert here)."""
        held = gate_up.shape[0]
        routing = Routing.of(top_idx, first, held, others=held < self.num_experts)
        gate_up_adapters, down_adapters = adapters if adapters is not None else ([], [])
        hidden = expert_product(routing.rows(x), gate_up, gate_up_adapters, routing.groups)
        g, u = hidden.chunk(2, dim=-1)
        out = expert_product(self.experts.act_fn(g) * u, down, down_adapters, routing.groups)
        return routing.combine(out, weights, x.dtype)


LowRank = list[tuple[Tensor, Tensor, float]]
"""A stacked projection's LoRA adapters: ``(B [E, out, r], A [E, r, in], scale)`` each (``lora.low_rank_factors``)."""


def expert_product(rows: Tensor, weight: Tensor, adapters: LowRank, groups: Groups) -> Tensor:
    """Each row ``x`` of group ``e`` through expert ``e``'s stacked ``weight``, plus ``Σ s·B_e A_e x`` over its LoRA
    adapters (two grouped products each). Its operands are arguments, so that nothing outlives the product where no
    graph keeps it (the planner's capture working set)."""
    out = grouped_linear(rows, weight, groups)
    for lhs, rhs, scale in adapters:
        if lhs.shape[0] != groups.count:
            raise ValueError("LoRA adapters on routed experts need every expert here (not with expert parallelism)")
        out = out + grouped_linear(grouped_linear(rows, rhs, groups), lhs, groups) * scale
    return out


class MLAAdapter(FamilyAdapter):
    family = "mla"
    model_types = ("glm_moe_dsa",)

    def decode_regime(self, reach: int) -> int:
        """1 once a member sees more keys than DSA's top-k (its selection is sparse), else 0 (every key visible)."""
        return int(reach > self.config.index_topk)

    @classmethod
    def check_config(cls, config: Any) -> None:
        if config.indexer_types and config.indexer_types[0] != "full":
            raise UnsupportedModelError("glm_moe_dsa: the first layer must run its own DSA indexer ('full')")

    def build_layers(self) -> list[DecoderLayer]:
        layers = []
        for hf_layer in self.backbone.layers:
            mlp = hf_layer.mlp
            layers.append(
                DecoderLayer.from_hf(
                    hf_layer,
                    MLAMixer(hf_layer.self_attn, self.config),
                    rms_norm,
                    MoE(mlp) if hasattr(mlp, "experts") else None,
                )
            )
        return layers

    def final_norm(self, h: Tensor) -> Tensor:
        return rms_norm(h, self.backbone.norm.weight, norm_eps(self.backbone.norm))

    @classmethod
    def layer_state_bytes(cls, config: Any, itemsize: int) -> list[tuple[int, int]]:
        sizes = []
        for i in range(config.num_hidden_layers):
            width = config.kv_lora_rank + config.qk_rope_head_dim
            if config.indexer_types[i] == "full":
                width += config.index_head_dim
            sizes.append((width * itemsize, 0))
        return sizes

    @classmethod
    def layer_work(cls, config: Any, new: int, earlier: int, itemsize: int) -> list[LayerWork]:
        """Absorbed MLA: a pair is a score and a weighted value of width ``kv_lora_rank + qk_rope_head_dim`` per
        head. Once a chunk reaches past ``index_topk`` positions, each query attends to ``index_topk`` rows gathered
        for it, and a layer with its own indexer scores the whole block of (query, key) pairs (the masked triangle
        included) and takes their top-k. A MoE layer's routed experts are one step: the routing's sort and one
        grouped GEMM per projection, however many experts its tokens chose (``MoE.experts_of``)."""
        width = config.kv_lora_rank + config.qk_rope_head_dim
        pair = 4 * config.num_attention_heads * width
        sparse = earlier + new > config.index_topk
        pairs = new * config.index_topk if sparse else causal_pairs(new, earlier)
        gathered = new * config.index_topk * width * itemsize if sparse else 0
        work = []
        for i in range(config.num_hidden_layers):
            scores = new * (earlier + new) if sparse and config.indexer_types[i] == "full" else 0
            steps = 1 if config.mlp_layer_types[i] == "sparse" else 0
            work.append(LayerWork(attention=pair * pairs, selection=scores, gathered=gathered, steps=steps))
        return work

    @classmethod
    def state_parameters(cls, config: Any) -> tuple[str, ...]:
        rows = ("self_attn.kv_a_proj_with_mqa.weight",)
        full = config.indexer_types[config.num_hidden_layers - 1] == "full"
        return (*rows, "self_attn.indexer.wk.weight") if full else rows

    @classmethod
    def active_fraction(cls, config: Any, name: str) -> float:
        return config.num_experts_per_tok / config.n_routed_experts if ".experts." in f".{name}" else 1.0
