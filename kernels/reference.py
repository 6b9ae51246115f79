"""Plain PyTorch twins of the engine's kernels: slow, obviously correct, used as test oracles (and, for the
sampler's exponential race, as the path of devices without the C++ kernels).

Layout (vLLM's paged KV cache): one tensor per layer, ``kv_cache: [2, num_blocks, block_size,
num_kv_heads, head_size]`` (index 0 = K, 1 = V). The slot of a token is
``block_id * block_size + offset``. A sequence's block table maps its logical block ``i``
(positions ``i * block_size .. (i + 1) * block_size - 1``) to a physical block id.

This module imports nothing of batchinfer's, so kernels can be tested on their own.
"""

from __future__ import annotations

import itertools

import torch

# Largest magnitude each quantized KV element type stores, and its torch storage dtype.
KV_QUANT_MAX = {"int8": 127.0, "fp8_e4m3": 448.0}
KV_STORAGE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
KV_SCALE_GROUP_SIZE = 32
"""Channels per scale of an int8 K/V row (:func:`quantize_kv`): two scales a head at ``head_size`` 64."""
KV_GROUPED_SCALE_DTYPES = ("int8",)
"""The cache dtypes with a scale per :data:`KV_SCALE_GROUP_SIZE` channels; float8 keeps one scale a head: e4m3
spends its bits on an exponent, so a small channel keeps its relative precision beside an outlier. On SmolLM2
(64 x 128 teacher-forced, one Intel Xeon) groups took int8 from 99.43% to 99.60% and fp8 from 98.01% to 97.92%,
under its 98% bound."""
KV_INT4_GROUP_SIZE = 32
KV_INT4_LEVELS = 15  # codes 0 .. 15


def kv_group_size(head_size: int, group_size: int = KV_SCALE_GROUP_SIZE) -> int:
    """Channels per group of a quantized K/V row of ``head_size``: ``group_size``, or the whole head when it is
    smaller.

    Raises:
        ValueError: when ``head_size`` is not a multiple of the group.
    """
    size = min(group_size, head_size)
    if head_size % size:
        raise ValueError(f"a quantized KV cache needs a head_size divisible by {size}, got {head_size}")
    return size


def kv_num_scale_groups(head_size: int, kv_cache_dtype: str) -> int:
    """Scales per (token, KV head) of an int8 or float8 cache: ``head_size // kv_group_size(head_size)`` for
    :data:`KV_GROUPED_SCALE_DTYPES`, else 1.

    Raises:
        ValueError: for a grouped dtype, on a ``head_size`` the group does not divide.
    """
    return head_size // kv_group_size(head_size) if kv_cache_dtype in KV_GROUPED_SCALE_DTYPES else 1


def quantize_kv(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantization of K or V rows, one scale per (token, KV head, group of channels)
    (:func:`kv_num_scale_groups`: int8 in groups of :func:`kv_group_size`, fp8 one group a head; KIVI-style
    per-token scales, Liu et al. 2024, split into channel groups as its values are; vLLM's fp8 cache uses one
    per-tensor scale instead).

    ``scale = max|x| / q_max`` over the group's values (``q_max`` 127 for int8, 448 for float8 e4m3, its
    largest finite value); an all-zero group gets scale 1. int8 rounds half away from zero
    (``floor(|y| + 0.5)``, as the Triton store does), fp8 rounds to nearest even (torch's cast).
    ``dequantize_kv`` gives back ``element * scale``.

    Args:
        x: ``[..., head_size]`` floating point.
        kv_cache_dtype: ``"int8"`` or ``"fp8_e4m3"``.

    Returns:
        ``(data, scales)``: ``data`` like ``x`` in ``KV_STORAGE_DTYPES[kv_cache_dtype]``; float32 ``scales``
        ``[..., num_groups]`` (:func:`kv_num_scale_groups`), group ``i`` covering channels
        ``i * group_size .. (i + 1) * group_size - 1``.

    Raises:
        ValueError: on a ``head_size`` the group does not divide.
    """
    q_max = KV_QUANT_MAX[kv_cache_dtype]
    head_size = x.shape[-1]
    groups = x.float().view(*x.shape[:-1], kv_num_scale_groups(head_size, kv_cache_dtype), -1)
    amax = groups.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / q_max, torch.ones_like(amax))
    y = (groups / scales.unsqueeze(-1)).clamp(-q_max, q_max).flatten(-2)
    if kv_cache_dtype == "int8":
        y = torch.floor(y.abs() + 0.5).copysign(y)
    return y.to(KV_STORAGE_DTYPES[kv_cache_dtype]), scales


def dequantize_kv(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``element * scale`` of its group: the values quantized ``[..., head_size]`` rows stand for
    (``scales: [..., num_groups]``, :func:`quantize_kv`)."""
    groups = data.float().view(*data.shape[:-1], scales.shape[-1], -1)
    values: torch.Tensor = (groups * scales.unsqueeze(-1)).flatten(-2)
    return values


def kv_int4_group_size(head_size: int) -> int:
    """Channels per int4 group for a head of ``head_size``: :func:`kv_group_size` with
    :data:`KV_INT4_GROUP_SIZE`.

    Raises:
        ValueError: when ``head_size`` is odd or not a multiple of the group.
    """
    if head_size % 2:
        raise ValueError(f"an int4 KV cache needs an even head_size, got {head_size}")
    return kv_group_size(head_size, KV_INT4_GROUP_SIZE)


def quantize_kv_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 quantization of K or V rows in groups of channels (KIVI's per-token value groups, Liu et
    al. 2024, used for keys too: a paged cache fills a block one token at a time, so keys get per-channel
    smoothing instead of per-channel groups, :mod:`worker.engine.executor.kv_calibration`).

    Per group of :func:`kv_int4_group_size` channels: ``scale = (max - min) / 15`` (1 when the group is
    constant), ``zero = min``, code ``floor((x - zero) / scale + 0.5)`` clamped to ``0 .. 15``; two codes per
    byte, element ``2i`` in the low nibble.

    Args:
        x: ``[..., head_size]`` floating point.

    Returns:
        ``(data, params)``: uint8 ``[..., head_size // 2]``; float32 ``[..., 2 * num_groups]``, each group's
        ``(scale, zero)`` in turn. :func:`dequantize_kv_int4` gives back ``code * scale + zero``.
    """
    head_size = x.shape[-1]
    group_size = kv_int4_group_size(head_size)
    groups = x.float().view(*x.shape[:-1], head_size // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = (high - low) / KV_INT4_LEVELS
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.floor((groups - low.unsqueeze(-1)) / scale.unsqueeze(-1) + 0.5).clamp(0, KV_INT4_LEVELS)
    codes = codes.to(torch.uint8).flatten(-2)
    data = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return data, torch.stack([scale, low], dim=-1).flatten(-2)


def dequantize_kv_int4(data: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., 2 * data.shape[-1]]``: the values int4 rows (:func:`quantize_kv_int4`) stand for."""
    codes = torch.stack([data & 0xF, data >> 4], dim=-1).flatten(-2).float()
    scale, zero = params.view(*params.shape[:-1], -1, 2).unbind(-1)
    groups = codes.view(*codes.shape[:-1], scale.shape[-1], -1)
    values: torch.Tensor = (groups * scale.unsqueeze(-1) + zero.unsqueeze(-1)).flatten(-2)
    return values


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store each new token's K and V at its slot, one token at a time (vLLM's ``reshape_and_cache``).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_size]``, same dtype as ``kv_cache``.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]``; mutated in place.
        slot_mapping: ``[num_tokens]`` integer slots, each in ``[0, num_blocks * block_size)``.
    """
    block_size = kv_cache.shape[2]
    for token_idx, slot in enumerate(slot_mapping.tolist()):
        block_id, offset = divmod(slot, block_size)
        kv_cache[0, block_id, offset] = key[token_idx]
        kv_cache[1, block_id, offset] = value[token_idx]


def copy_blocks(kv_cache: torch.Tensor, src_block_ids: torch.Tensor, dst_block_ids: torch.Tensor) -> None:
    """Copy-on-write block copies: block ``dst_block_ids[i]`` becomes block ``src_block_ids[i]`` (K and V).

    All copies read the cache as it was before the call (vLLM's ``copy_blocks``; Kwon et al. 2023, section 4.4).

    Args:
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]``; mutated in place.
        src_block_ids, dst_block_ids: integer ``[num_pairs]``; every destination distinct.
    """
    sources = kv_cache[:, src_block_ids.long()].clone()
    for pair_idx, dst in enumerate(dst_block_ids.tolist()):
        kv_cache[:, dst] = sources[:, pair_idx]


def paged_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    lse_out: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    kv_scales: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached context, one sequence at a time.

    Sequence ``s`` owns query rows ``query_start_loc[s] : query_start_loc[s + 1]``; they are the last
    ``query_len`` positions of its context of ``seq_lens[s]`` tokens, so query row ``i`` sits at position
    ``seq_lens[s] - query_len + i`` and sees keys at positions ``0 ..`` that position (causal). The context
    (including this step's tokens, which must already be in the cache) is read through the block table.
    Grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
    Scores and softmax are computed in float32 (scaled dot-product attention, Vaswani et al. 2017).
    With ``sliding_window`` a query at position ``p`` sees only keys at ``p - sliding_window < k <= p`` (the
    last ``sliding_window`` positions, itself included: Hugging Face's ``sliding_window_overlay``; Beltagy et
    al. 2020, Longformer). With ``logits_soft_cap`` each scaled score ``s`` becomes ``cap * tanh(s / cap)``
    before the mask and softmax (Gemma 2's attention soft-capping).

    Args:
        query: ``[num_tokens, num_heads, head_size]``.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]``.
        query_start_loc: ``[num_seqs + 1]`` integer prefix sums of the query lengths.
        seq_lens: ``[num_seqs]`` context lengths including this step's tokens.
        block_tables: ``[num_seqs, max_num_blocks_per_seq]`` physical block ids (padding ignored).
        scale: multiplier of ``q . k``, usually ``head_size ** -0.5``.
        lse_out: optional float32 ``[num_tokens, num_heads]``, filled with each row's log-sum-exp of
            its scaled (masked) scores.
        sliding_window: keys each query sees (``>= 1``), or None for the whole causal context.
        logits_soft_cap: the soft-cap ``cap > 0``, or None for none.
        kv_scales: float32 ``[2, num_blocks, block_size, num_kv_heads, num_groups]`` when ``kv_cache`` is
            quantized (:func:`quantize_kv`): each element stands for ``element * scale`` of its channel group;
            None for a float cache.
        tree_mask: int64 ``[num_tokens]`` or None (every row causal). A row whose value is 0 is causal; a
            nonzero value is a bit set over its sequence's query rows (``query_len <= 64``): bit ``j`` set
            lets the row see query row ``j``'s key, and every position before the query stays visible. This
            is the token-tree mask of speculative verification (Miao et al. 2023, "SpecInfer", section 4):
            a tree node sees the cached context, the sequence's last token (query row 0) and its ancestors.
            Rows may only see earlier rows and themselves (parents precede children), and not with
            ``sliding_window``.

    Returns:
        ``[num_tokens, num_heads, head_size]`` in ``query.dtype``.
    """
    num_heads = query.shape[1]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    num_queries_per_kv = num_heads // num_kv_heads
    output = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for seq_idx, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[seq_idx], starts[seq_idx + 1]
        query_len = end - start
        # Positions before the first query's window are never read (their blocks may be freed).
        first = 0 if sliding_window is None else max(0, seq_len - query_len - sliding_window + 1)
        positions = torch.arange(first, seq_len, device=kv_cache.device)
        block_ids = block_tables[seq_idx].long()[positions // block_size]
        offsets = positions % block_size
        keys = kv_cache[0][block_ids, offsets].float()  # [seq_len - first, num_kv_heads, head_size]
        values = kv_cache[1][block_ids, offsets].float()
        if kv_scales is not None:
            keys = dequantize_kv(keys, kv_scales[0][block_ids, offsets])
            values = dequantize_kv(values, kv_scales[1][block_ids, offsets])
        keys = keys.repeat_interleave(num_queries_per_kv, dim=1)
        values = values.repeat_interleave(num_queries_per_kv, dim=1)
        q = query[start:end].float()
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        if logits_soft_cap is not None:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        query_positions = torch.arange(seq_len - query_len, seq_len, device=kv_cache.device)
        visible = positions[None, :] <= query_positions[:, None]  # [query_len, seq_len - first]
        if sliding_window is not None:
            visible &= positions[None, :] > query_positions[:, None] - sliding_window
        if tree_mask is not None:
            bits = tree_mask[start:end].long()
            row_bit = (bits[:, None] >> (positions[None, :] - (seq_len - query_len)).clamp(0, 63)) & 1
            in_query = positions[None, :] >= seq_len - query_len
            visible &= (bits[:, None] == 0) | ~in_query | (row_bit == 1)
        scores = scores.masked_fill(~visible, float("-inf"))
        if lse_out is not None:
            lse_out[start:end] = torch.logsumexp(scores, dim=-1).T
        probs = torch.softmax(scores, dim=-1)
        output[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)
    return output


_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def linear_bf16_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """bfloat16 ``x @ weight.T + bias`` computed exactly as a float32 accumulator would: the bfloat16 inputs
    widened to float32, the float32 matmul (plus the bias in float32), rounded to bfloat16 once.

    ``x: [..., K]``, ``weight: [N, K]`` bfloat16, ``bias: [N]`` or None -> bfloat16 ``[..., N]``.
    """
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(torch.bfloat16)


def varlen_attention_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Bidirectional attention of each packed sequence over its own tokens, one sequence at a time.

    Twin of :func:`kernels.cpu_attention.varlen_attention_cpu`: sequence ``s`` owns rows
    ``cu_seqlens[s] : cu_seqlens[s + 1]`` of ``query``, ``key`` and ``value`` (``[num_tokens, num_heads,
    head_size]``) and every one of its rows attends to all of them (no causal mask), never to another
    sequence's. Softmax in float32 over ``scale * q . k``.

    Returns:
        ``[num_tokens, num_heads, head_size]`` in ``query``'s dtype.
    """
    out = torch.empty_like(query)
    bounds = cu_seqlens.tolist()
    for start, end in itertools.pairwise(bounds):
        q, k, v = (x[start:end].transpose(0, 1).float() for x in (query, key, value))  # [heads, L, head]
        weights = torch.softmax(scale * (q @ k.transpose(1, 2)), dim=-1)
        out[start:end] = (weights @ v).transpose(0, 1).to(query.dtype)
    return out


def _int64(value: int) -> int:
    """The int64 with the bits of the unsigned 64-bit ``value`` (tensors hold signed int64; products wrap)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(z: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 bits (``>>`` on int64 is arithmetic; mask the sign copies away)."""
    return (z >> shift) & ((1 << (64 - shift)) - 1)


def splitmix64_at(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Output ``index`` (0-based) of the SplitMix64 stream seeded with ``seed`` (Steele, Lea & Flood 2014),
    elementwise over broadcast int64 tensors, as the int64 with the same bits."""
    z = seed + (index + 1) * _int64(_GAMMA)
    z = (z ^ _shift_right(z, 30)) * _int64(_MIX1)
    z = (z ^ _shift_right(z, 27)) * _int64(_MIX2)
    return z ^ _shift_right(z, 31)


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' 32-bit integer hash "lowbias32" (a bijection) of int64 tensors holding values in [0, 2^32)."""
    mask = (1 << 32) - 1
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & mask
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & mask
    return x ^ (x >> 16)


def exponential_race_reference(logits: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Twin of :func:`kernels.cpu_sampling.exponential_race_cpu` on any device: the same counter-based
    uniforms bit for bit, logarithms by ``torch.log`` (so a score may differ in the last bits, and the token
    only where two scores nearly tie), no pruning.

    Args:
        logits: float32 ``[num_rows, vocab_size]``; ``-inf`` excludes a token.
        keys, counters: int64 ``[num_rows]`` on ``logits``' device.

    Returns:
        int64 ``[num_rows]`` token ids (lowest id on an exact tie).
    """
    state = splitmix64_at(keys, counters)[:, None]
    lo, hi = state & ((1 << 32) - 1), _shift_right(state, 32)
    tokens = torch.arange(logits.shape[1], dtype=torch.long, device=logits.device)[None, :]
    bits = lowbias32(lowbias32(tokens ^ lo) ^ hi)
    uniform = ((bits >> 9).float() + 0.5) * 2.0**-23
    return (logits - torch.log(-torch.log(uniform))).argmax(dim=-1)


def dequantize_gguf_blocks(blocks: torch.Tensor, block_type: int) -> torch.Tensor:
    """Plain torch dequantization of GGUF blocks (ggml's ``dequantize_row_q4_0`` / ``_q4_1`` / ``_q8_0``).

    Args:
        blocks: uint8 ``[rows, num_blocks * block_bytes]`` in ggml's layout: per block of 32 weights a float16
            scale ``d``, for Q4_1 a float16 minimum ``m``, then the quants (Q4: 16 bytes, weight ``j`` in the
            low nibble of byte ``j`` and weight ``j + 16`` in its high nibble; Q8_0: 32 int8).
        block_type: ggml type id: 2 (Q4_0, ``w = d (q - 8)``), 3 (Q4_1, ``w = d q + m``), 8 (Q8_0, ``w = d q``).

    Returns:
        float32 ``[rows, num_blocks * 32]``.

    Raises:
        ValueError: on another block type.
    """
    sizes = {2: 18, 3: 20, 8: 34}
    if block_type not in sizes:
        raise ValueError(f"GGUF block type {block_type} is not served (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 are)")
    rows = blocks.shape[0]
    raw = blocks.reshape(rows, -1, sizes[block_type])
    d = raw[..., :2].contiguous().view(torch.float16).float()
    if block_type == 8:
        q = raw[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(rows, -1)
    qs = raw[..., 4:] if block_type == 3 else raw[..., 2:]
    q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()
    if block_type == 3:
        m = raw[..., 2:4].contiguous().view(torch.float16).float()
        return torch.addcmul(m, d, q).reshape(rows, -1)
    return (d * (q - 8)).reshape(rows, -1)


def quantize_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """Quantize a float weight to GGUF Q4_1 blocks (llama.cpp's ``quantize_row_q4_1_ref``), for HF checkpoints
    served with ``quantization="q4"``.

    Per block of 32 weights along ``in_features``: ``m = min``, ``d = (max - min) / 15``,
    ``q = clamp(round((x - m) / d), 0, 15)``; ``d`` and ``m`` stored as float16.

    Args:
        weight: float ``[out_features, in_features]``, ``in_features`` a multiple of 32.

    Returns:
        uint8 ``[out_features, in_features / 32 * 20]`` for :func:`dequantize_gguf_blocks` (type 3).

    Raises:
        ValueError: when ``in_features`` is not a multiple of 32.
    """
    rows, cols = weight.shape
    if cols % 32:
        raise ValueError(f"Q4_1 needs in_features to be a multiple of 32, got {cols}")
    w = weight.detach().float().reshape(rows, -1, 32)
    lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    d = (hi - lo) / 15
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round((w - lo) * inv).clamp(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    scales = torch.cat((d.half().view(torch.uint8), lo.half().view(torch.uint8)), dim=-1)
    return torch.cat((scales, packed), dim=-1).reshape(rows, -1).contiguous()


def quantize_activations_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Twin of the C++ activation quantizer of :func:`kernels.cpu_q4.linear_gguf` (llama.cpp's Q8_1).

    Args:
        x: float32 ``[rows, in_features]``, ``in_features`` a multiple of 32.

    Returns:
        ``(q, d, s)``: ``q`` float32 ``[rows, in_features]`` holding int8 values ``round_half_even(x / d)``,
        ``d = max|x| / 127`` per block and ``s = d * sum(q)`` per block, float32 ``[rows, in_features / 32]``.
    """
    blocks = x.float().reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(dim=-1) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None])
    return q.reshape(x.shape[0], -1), d, d * q.sum(dim=-1)


def linear_gguf_reference(
    x: torch.Tensor,
    blocks: torch.Tensor,
    block_type: int,
    bias: torch.Tensor | None = None,
    quantize_activations: bool = False,
) -> torch.Tensor:
    """Twin of :func:`kernels.cpu_q4.linear_gguf`: dequantize the weight (and, with ``quantize_activations``,
    the per-block int8 activations), then a plain float32 linear.

    Args:
        x: float32 ``[rows, in_features]``; blocks, block_type: as :func:`dequantize_gguf_blocks`; bias:
            optional float32 ``[out_features]``.

    Returns:
        float32 ``[rows, out_features]``.
    """
    weight = dequantize_gguf_blocks(blocks, block_type)
    if quantize_activations:
        q, d, _ = quantize_activations_q8(x)
        x = (q.reshape(x.shape[0], -1, 32) * d[..., None]).reshape(x.shape[0], -1)
    return torch.nn.functional.linear(x, weight, bias)


GGUF_BF16_EXACT_ROWS = 24  # calls of up to this many rows: exact Q4 weights in linear_gguf_bf16 (kDirectRows)


def linear_gguf_bf16_reference(
    x: torch.Tensor,
    blocks: torch.Tensor,
    block_type: int,
    bias: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Twin of :func:`kernels.cpu_q4.linear_gguf_bf16`: the bfloat16 activations and the weight in float64, the
    float64 linear plus the bias, rounded to bfloat16 once. The weight is the Q4 weight (``d q + m``, from its
    float16 ``d`` and ``m``) exactly for up to ``GGUF_BF16_EXACT_ROWS`` rows or with ``batch_invariant``, and
    :func:`dequantize_gguf_blocks` rounded to bfloat16 (the kernel's dequantized weights) otherwise. The kernel's
    float32 sums differ from it by float32 rounding only.

    Args:
        x: bfloat16 ``[rows, in_features]``; blocks, block_type: as :func:`dequantize_gguf_blocks` (Q4_0 or Q4_1);
            bias: optional ``[out_features]``; batch_invariant: as the kernel's (exact weights at every height).

    Returns:
        bfloat16 ``[rows, out_features]``.
    """
    if x.shape[0] > GGUF_BF16_EXACT_ROWS and not batch_invariant:
        weight = dequantize_gguf_blocks(blocks, block_type).bfloat16().double()
    else:
        sizes = {2: 18, 3: 20}
        rows = blocks.shape[0]
        raw = blocks.reshape(rows, -1, sizes[block_type])
        d = raw[..., :2].contiguous().view(torch.float16).double()
        qs = raw[..., 4:] if block_type == 3 else raw[..., 2:]
        q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).double()
        offset = raw[..., 2:4].contiguous().view(torch.float16).double() if block_type == 3 else -8 * d
        weight = (d * q + offset).reshape(rows, -1)
    out = x.double() @ weight.T
    if bias is not None:
        out = out + bias.double()
    return out.to(torch.bfloat16)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """Quantize a float weight to GGUF Q8_0 blocks (llama.cpp's ``quantize_row_q8_0_ref``): int8 with one scale
    per group of 32 weights along ``in_features``, ``d = max|x| / 127``, ``q = round(x / d)``, ``d`` float16.

    Args:
        weight: float ``[out_features, in_features]``, ``in_features`` a multiple of 32.

    Returns:
        uint8 ``[out_features, in_features / 32 * 34]`` for :func:`dequantize_gguf_blocks` (type 8).

    Raises:
        ValueError: when ``in_features`` is not a multiple of 32.
    """
    rows, cols = weight.shape
    if cols % 32:
        raise ValueError(f"Q8_0 needs in_features to be a multiple of 32, got {cols}")
    w = weight.detach().float().reshape(rows, -1, 32)
    d = w.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(w * inv).to(torch.int8)
    return torch.cat((d.half().view(torch.uint8), q.view(torch.uint8)), dim=-1).reshape(rows, -1).contiguous()
