"""The Triton kernel of the accelerator's pass (`accelerator_adam`, which says how it holds to the host's
bits), imported at its first call. Each function mirrors its namesake in the core crate's
`kernel/adam.rs`, `kernel/elem.rs`, `kernel/part.rs` and `checksum.rs`; `crc32c_kernel` sums the
parameters as the host pass does where they are the master weights (`master_in_params`)."""

import triton
import triton.language as tl


@triton.jit
def widen(x, KIND: tl.constexpr):
    """fp32 from a loaded element (bf16 and fp16 as their int16 bits), exactly (`Elem::widen`)."""
    if KIND == 0:
        out = x
    elif KIND == 1:
        out = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        out = _widen_half(x.to(tl.uint16, bitcast=True).to(tl.uint32))
    return out


@triton.jit
def _widen_half(h):
    """fp32 from fp16's bits `h` (as uint32), exactly."""
    sign = (h & 0x8000) << 16
    exp = (h >> 10) & 0x1F
    man = h & 0x3FF
    normal = sign | ((exp + 112) << 23) | (man << 13)
    special = tl.where(man == 0, sign | 0x7F800000, sign | 0x7FC00000 | (man << 13))
    bits = tl.where(exp == 0x1F, special, normal)
    # A subnormal half is `man x 2^-24`, a normal float: the product is exact.
    tiny = (man.to(tl.float32) * 5.9604644775390625e-08).to(tl.uint32, bitcast=True) | sign
    bits = tl.where(exp == 0, tiny, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def narrow(x, KIND: tl.constexpr, BF16_NAN: tl.constexpr):
    """`x` rounded to nearest even into KIND, as bits (int16) where it is half precision
    (`Elem::narrow`; a bf16 NaN becomes BF16_NAN: torch's 0xffff, CPU Adam's 0x7fc0). One return at
    the end: Triton's compiler goes on past a `return` inside an `if`."""
    if KIND == 0:
        out = x
    elif KIND == 1:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = tl.where(x != x, BF16_NAN, rounded).to(tl.uint16).to(tl.int16, bitcast=True)
    else:
        out = _narrow_half(x)
    return out


@triton.jit
def _narrow_half(x):
    """`x` rounded to nearest even into fp16, as its bits (int16)."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 16) & 0x8000
    exp = ((bits >> 23) & 0xFF).to(tl.int32)
    man = bits & 0x7FFFFF
    nan = tl.where(man != 0, 0x0200 | (man >> 13), 0)
    special = sign | 0x7C00 | nan
    e = tl.where(exp == 0, -126, exp - 127)
    significand = tl.where(exp == 0, man, man | 0x800000)
    drop = tl.where(e >= -14, 13, 13 - 14 - e)
    # Past 24 bits the value rounds to zero; the clamp keeps every shift below 32.
    drop = tl.minimum(drop, 25).to(tl.uint32)
    kept = significand >> drop
    rest = significand & ((tl.full(drop.shape, 1, tl.uint32) << drop) - 1)
    half = tl.full(drop.shape, 1, tl.uint32) << (drop - 1)
    up = (rest > half) | ((rest == half) & ((kept & 1) == 1))
    rounded = kept + up.to(tl.uint32)
    value = tl.where(e >= -14, ((e + 15).to(tl.uint32) << 10) + rounded - 0x400, rounded)
    value = tl.minimum(value, 0x7C00)
    out = tl.where(exp == 0xFF, special, tl.where(e > 15, sign | 0x7C00, sign | value))
    return out.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def product_sum(a, b, c, FUSED: tl.constexpr):
    if FUSED:
        out = tl.fma(a, b, c)
    else:
        out = a * b + c
    return out


@triton.jit
def moment(old, beta, grad, one_minus, HOW: tl.constexpr):
    if HOW == 0:
        out = tl.fma(grad, one_minus, old * beta)
    elif HOW == 1:
        out = tl.fma(old, beta, grad * one_minus)
    else:
        out = grad * one_minus + old * beta
    return out


@triton.jit
def adam(
    p,
    g,
    m,
    v,
    k_ptr,
    DECAY: tl.constexpr,
    MOMENTUM: tl.constexpr,
    VARIANCE: tl.constexpr,
    OTHERS: tl.constexpr,
):
    """`adam_element`: the new parameter and moments."""
    beta1 = tl.load(k_ptr + 0)
    beta2 = tl.load(k_ptr + 1)
    one_minus_beta1 = tl.load(k_ptr + 2)
    one_minus_beta2 = tl.load(k_ptr + 3)
    bias_correction2 = tl.load(k_ptr + 4)
    eps = tl.load(k_ptr + 5)
    step_size = tl.load(k_ptr + 6)
    decay = tl.load(k_ptr + 7)
    if DECAY == 1:
        g = product_sum(p, decay, g, OTHERS)
    m = moment(m, beta1, g, one_minus_beta1, MOMENTUM)
    v = moment(v, beta2, g * g, one_minus_beta2, VARIANCE)
    denominator = product_sum(tl.sqrt_rn(v), bias_correction2, eps, OTHERS)
    update = tl.div_rn(m, denominator)
    if DECAY == 2:
        p = product_sum(p, decay, p, OTHERS)
    return product_sum(update, step_size, p, OTHERS), m, v


@triton.jit
def adam_kernel(
    p_ptr,
    m_ptr,
    v_ptr,
    g_ptr,
    o_ptr,
    k_ptr,
    n,
    vector_end,
    MASTER: tl.constexpr,
    MOMENTS: tl.constexpr,
    GRAD: tl.constexpr,
    PARAMS: tl.constexpr,
    WRITES_PARAMS: tl.constexpr,
    DECAY: tl.constexpr,
    MOMENTUM: tl.constexpr,
    VARIANCE: tl.constexpr,
    OTHERS: tl.constexpr,
    HALF_STATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = at < n
    scale = tl.load(k_ptr + 8)
    p = widen(tl.load(p_ptr + at, mask=inside, other=0), MASTER)
    m = widen(tl.load(m_ptr + at, mask=inside, other=0), MOMENTS)
    v = widen(tl.load(v_ptr + at, mask=inside, other=0), MOMENTS)
    g = widen(tl.load(g_ptr + at, mask=inside, other=0), GRAD) * scale
    if HALF_STATE:
        # DeepSpeed's `mul_` of its half-precision gradient: torch rounds the product.
        g = widen(narrow(g, GRAD, 0xFFFF), GRAD)
    # DeepSpeed's vector code's fusing below `vector_end`, its scalar loop's past it.
    pv, mv, vv = adam(p, g, m, v, k_ptr, DECAY, 0, 0, True)
    pt, mt, vt = adam(p, g, m, v, k_ptr, DECAY, MOMENTUM, VARIANCE, OTHERS)
    vector = at < vector_end
    p = tl.where(vector, pv, pt)
    m = tl.where(vector, mv, mt)
    v = tl.where(vector, vv, vt)
    if HALF_STATE:
        # Each result stored as CPU Adam stores it; the parameters are the master weights' bits.
        master = narrow(p, MASTER, 0x7FC0)
        tl.store(p_ptr + at, master, mask=inside)
        tl.store(m_ptr + at, narrow(m, MOMENTS, 0x7FC0), mask=inside)
        tl.store(v_ptr + at, narrow(v, MOMENTS, 0x7FC0), mask=inside)
        if WRITES_PARAMS:
            tl.store(o_ptr + at, master, mask=inside)
    else:
        tl.store(p_ptr + at, p, mask=inside)
        tl.store(m_ptr + at, m, mask=inside)
        tl.store(v_ptr + at, v, mask=inside)
        if WRITES_PARAMS:
            tl.store(o_ptr + at, narrow(p, PARAMS, 0xFFFF), mask=inside)


@triton.jit
def mul_mod_p(a, b):
    """a(x) b(x) mod P(x), CRC32C's polynomial, both reflected, element by element (`checksum.rs`'s
    `mul_mod_p`: bit 31 is x^0)."""
    product = b * 0
    for bit in tl.static_range(32):
        product = tl.where(((a >> (31 - bit)) & 1) != 0, product ^ b, product)
        b = tl.where((b & 1) != 0, (b >> 1) ^ 0x82F63B78, b >> 1)
    return product


@triton.jit
def xor_all(x, HALVINGS: tl.constexpr):
    """The XOR of a block's elements (2^HALVINGS of them), as a block of one: its halves' XOR in turn.
    Not Triton's `xor_sum` (nor `sum`): its interpreter reduces with a combining function one element
    at a time, and those functions, made when Triton was imported, do not run interpreted where a
    process imported Triton before it set `TRITON_INTERPRET`."""
    for _ in tl.static_range(HALVINGS):
        a, b = tl.split(tl.reshape(x, [x.shape[0] // 2, 2]))
        x = a ^ b
    return x


@triton.jit
def crc32c_kernel(
    x_ptr,
    out_ptr,
    row_shifts_ptr,
    block_shifts_ptr,
    n,
    zeros_crc,
    ROWS: tl.constexpr,
    RUN: tl.constexpr,
    HALVINGS: tl.constexpr,
):
    """The CRC32C of `n` 16-bit elements' bytes, XOR-ed into `out_ptr` (`accelerator_adam.crc32c_into`).
    Without its all-ones start and end a CRC is linear in the bytes, and a part's, carried over the bytes
    after it (times x^(8 bytes) mod P), XOR-ed with the others' is the whole's (as `crc32c_combine` takes
    two). So program `b` takes the `b`-th ROWS * RUN (ROWS = 2^HALVINGS) elements from the end, in rows of
    RUN after one another; each row runs the register over its elements from zero (elements before the
    first add nothing), is carried over the rows after it in the block (`row_shifts_ptr[r]`: x^(16 RUN r))
    and the block over the blocks after it (`block_shifts_ptr[b]`: x^(16 RUN ROWS b)). The start and end
    are `n` zero elements' CRC32C (`zeros_crc`, as int32 bits), XOR-ed in by the first program."""
    b = tl.program_id(0)
    rows = tl.arange(0, ROWS)
    # Each row's last element.
    last = n - 1 - (b * ROWS + rows) * RUN
    c = (rows * 0).to(tl.uint32)
    for k in tl.static_range(RUN):
        at = last - (RUN - 1 - k)
        h = tl.load(x_ptr + at, mask=at >= 0, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
        # Both bytes at once (the register's low byte takes the first).
        c = c ^ h
        for _ in tl.static_range(16):
            c = tl.where((c & 1) != 0, (c >> 1) ^ 0x82F63B78, c >> 1)
    carried = mul_mod_p(tl.load(row_shifts_ptr + rows).to(tl.uint32, bitcast=True), c)
    one = tl.arange(0, 1)
    block_shift = tl.load(block_shifts_ptr + b + one).to(tl.uint32, bitcast=True)
    total = mul_mod_p(block_shift, xor_all(carried, HALVINGS))
    total = total ^ (zeros_crc.to(tl.uint32, bitcast=True) * (b == 0).to(tl.uint32))
    tl.atomic_xor(out_ptr + one, total.to(tl.int32, bitcast=True))
