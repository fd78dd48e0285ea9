"""The two Triton kernels behind ``attention_triton.py``, which imports this module when it first launches one.

``triton.jit`` picks the compiler or the CPU interpreter from ``TRITON_INTERPRET`` when a function is
decorated, and triton's own library functions (``tl.max``, ``tl.cdiv``...) are decorated when triton
is imported. So the variable must be set before triton is first imported; importing ``attention_triton``
does not import triton, and ``attention_triton`` says so clearly when the modes disagree.

Terms: a *row* is one query row; a *split* is one contiguous slice of the row's visible
positions (prefix first, then extras) that one program reads; *log2 units*: scores are scaled
by ``scale * log2(e)`` so the softmax uses ``exp2``, and the running maxima are in those units.
"""
import triton
import triton.language as tl


@triton.jit
def split_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, row_group_ptr, prefix_len_ptr, extra_slots_ptr, extra_len_ptr,
        out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
        stride_qn, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_table, stride_extra,
        stride_on, stride_oh, scale_log2, head_dim,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        TILE: tl.constexpr, SPLITS: tl.constexpr, DIRECT: tl.constexpr, DOT_F32: tl.constexpr,
        PRECISION: tl.constexpr):
    """Program (row, kv head, split): online softmax of the kv head's G query heads over one slice of positions.
    Long because a Triton program is one function: its loads, softmax and stores cannot call helpers cheaply.

    grid (N, KVH, SPLITS). With ``DIRECT`` (SPLITS == 1) the normalized result goes straight to ``out``;
    otherwise the unnormalized accumulator and its (max, sum) go to the partial buffers for ``combine_kernel``:
    part_acc [N, H, SPLITS, D] f32, part_max / part_sum [N, H, SPLITS] f32.
    ``DOT_F32`` upcasts q, K and V before the dot products: set under the interpreter only, whose ``tl.dot``
    multiplies bf16 bit patterns as integers. ``PRECISION`` is "ieee" for float32 inputs (no TF32 rounding).
    """
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    group = tl.load(row_group_ptr + row).to(tl.int64)
    n_prefix = tl.load(prefix_len_ptr + row).to(tl.int32)
    n_total = n_prefix + tl.load(extra_len_ptr + row).to(tl.int32)
    # each split takes whole tiles, so only a split's last tile is partial; splits past the end read nothing
    per_split = tl.cdiv(tl.cdiv(n_total, SPLITS), TILE) * TILE
    start = split * per_split
    end = tl.minimum(start + per_split, n_total)

    g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + g
    d = tl.arange(0, DIM_PAD)
    head_ok = g < GROUP
    dim_ok = d < head_dim
    q = tl.load(q_ptr + row.to(tl.int64) * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)  # [GROUP_PAD, DIM_PAD]
    if DOT_F32:
        q = q.to(tl.float32)
    run_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    run_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    # a while loop, not range(start, end, TILE): Triton 3.6's interpreter turns range bounds into ints with
    # int() of a 1-element numpy array, which numpy 2.4 rejects; the compiled kernel takes either form
    tile = start
    while tile < end:
        pos = tile + tl.arange(0, TILE)
        ok = pos < end
        in_prefix = pos < n_prefix
        # prefix positions go through the block table, the rest are the row's extra slots
        block = tl.load(tables_ptr + group * stride_table + pos // BLOCK_SIZE, mask=ok & in_prefix, other=0)
        extra = tl.load(extra_slots_ptr + row.to(tl.int64) * stride_extra + (pos - n_prefix),
                        mask=ok & ~in_prefix, other=0)
        slot = tl.where(in_prefix, block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE, extra.to(tl.int64))
        kv_mask = ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [GROUP_PAD, TILE]
        scores = tl.where(ok[None, :], scores, float("-inf"))
        # every tile has a visible position, so new_max is finite and exp2 never sees inf - inf
        new_max = tl.maximum(run_max, tl.max(scores, 1))
        rescale = tl.exp2(run_max - new_max)
        p = tl.exp2(scores - new_max[:, None])
        run_sum = run_sum * rescale + tl.sum(p, 1)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            v = v.to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        run_max = new_max
        tile += TILE

    store_mask = head_ok[:, None] & dim_ok[None, :]
    if DIRECT:
        result = acc / tl.where(run_sum > 0, run_sum, 1.0)[:, None]  # a ghost row: acc = 0, sum = 0 -> 0
        tl.store(out_ptr + row.to(tl.int64) * stride_on + heads[:, None] * stride_oh + d[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        part = (row.to(tl.int64) * GROUP * tl.num_programs(1) + heads) * SPLITS + split  # [GROUP_PAD]
        tl.store(part_acc_ptr + part[:, None] * head_dim + d[None, :], acc, mask=store_mask)
        tl.store(part_max_ptr + part, run_max, mask=head_ok)
        tl.store(part_sum_ptr + part, run_sum, mask=head_ok)


@triton.jit
def combine_kernel(part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, stride_on, stride_oh, head_dim,
                   SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
    """Program (row, head): merge the SPLITS partial softmaxes of one query head into its output.

    grid (N, H). Each split's accumulator is rescaled by exp2(its max - the overall max); empty
    splits carry max -inf and sum 0, and a row with no visible position at all writes 0.
    """
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    base = (row.to(tl.int64) * tl.num_programs(1) + head) * SPLITS
    split_ok = s < SPLITS
    maxima = tl.load(part_max_ptr + base + s, mask=split_ok, other=float("-inf"))
    sums = tl.load(part_sum_ptr + base + s, mask=split_ok, other=0.0)
    top = tl.max(maxima, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp2(maxima - top)  # [SPLITS_PAD]; 0 for empty splits
    acc = tl.load(part_acc_ptr + (base + s)[:, None] * head_dim + d[None, :],
                  mask=split_ok[:, None] & (d < head_dim)[None, :], other=0.0)
    total = tl.sum(weights * sums, 0)
    result = tl.sum(weights[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row.to(tl.int64) * stride_on + head * stride_oh + d, result.to(out_ptr.dtype.element_ty),
             mask=d < head_dim)
