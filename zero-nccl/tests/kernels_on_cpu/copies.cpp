// The table-driven copies of src/kernels/source.cu on the CPU (see shim.h):
// gathers of pieces into a flat buffer (copy, add, widening from bf16 and
// f16, widening add) and scatters back (copy, narrowing to bf16 and f16),
// each launch's table of up to PIECES_PER_LAUNCH pieces passed by value as
// kernels/mod.rs passes it, on grids smaller than the pieces so that both
// grid-stride loops run (the conversions' four-at-a-time loops too, with
// pieces at multiples of four elements and lengths that leave a tail).
// Every element of the flat buffer or of a piece is checked bitwise:
// copied or added where a piece covers it, untouched elsewhere; the bf16
// rounding against an independent round-to-nearest-even.
// Exits non-zero on any failure.
#include "shim.h"
#include "source.cu"
#include <algorithm>
#include <cstdio>
#include <random>

static int failures = 0;
static void expect(bool ok, const char* what) {
    if (!ok) {
        printf("FAIL %s\n", what);
        failures++;
    }
}

static unsigned bits(float f) { return __float_as_uint(f); }

// Round to nearest, ties to even, as the `half` crate does; a NaN stays a
// quiet NaN of its sign.
static unsigned short bf16_ref(float f) {
    const unsigned x = bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (unsigned short)((x >> 16) | 0x40u);
    return (unsigned short)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

// Pieces of random lengths (some empty) at disjoint random offsets of a
// flat buffer of `flat_len` elements: (offset, len), in a shuffled order.
// With `quads`, every offset is a multiple of four elements, so that the
// conversions take their four-at-a-time path on every piece (the pieces'
// own buffers are fresh allocations, aligned); without, some do by chance.
static std::vector<std::pair<size_t, size_t>> layout(std::mt19937& rng, int n, size_t& flat_len,
                                                     bool quads = false) {
    std::vector<std::pair<size_t, size_t>> pieces;
    size_t at = 0;
    for (int p = 0; p < n; p++) {
        size_t gap = rng() % 5;
        const size_t len = p % 7 == 3 ? 0 : 1 + rng() % 700;
        if (quads) gap += (4 - (at + gap) % 4) % 4;
        pieces.push_back({at + gap, len});
        at += gap + len;
    }
    flat_len = at + 3;
    std::shuffle(pieces.begin(), pieces.end(), rng);
    return pieces;
}

// One launch of `kernel` over `pieces` (at most PIECES_PER_LAUNCH) with the
// table holding each piece's address `ptr(p)`, grid (x, y).
template <class K, class P>
static void launch_table(K kernel, const std::vector<std::pair<size_t, size_t>>& pieces, P ptr,
                         unsigned x, unsigned y) {
    Pieces table{};
    unsigned n = 0;
    for (size_t p = 0; p < pieces.size(); p++) {
        if (pieces[p].second == 0) continue;  // skipped, as piece_launches does
        table.e[3 * n] = (u64)ptr(p);
        table.e[3 * n + 1] = pieces[p].first;
        table.e[3 * n + 2] = pieces[p].second;
        n++;
    }
    launch({x, y, 1}, {256, 1, 1}, [&] { kernel(table, n); });
}

// Float values with NaN, infinities, ties of the bf16 rounding and
// subnormals among them.
static float value(std::mt19937& rng) {
    switch (rng() % 16) {
    case 0: return __uint_as_float(0x7FC00001u);
    case 1: return -INFINITY;
    case 2: return __uint_as_float(0x3F808000u);  // a tie, even below
    case 3: return __uint_as_float(0x3F818000u);  // a tie, odd below
    case 4: return __uint_as_float(0x00000123u);
    default: return std::normal_distribution<float>(0, 3)(rng);
    }
}

template <class W>  // W: unsigned int (b32) or unsigned long long (b64) or unsigned short (b16)
static void copies_of_width(std::mt19937& rng, const char* what) {
    size_t flat_len = 0;
    const auto pieces = layout(rng, PIECES_PER_LAUNCH, flat_len);
    std::vector<std::vector<W>> srcs;
    for (auto [at, len] : pieces) {
        std::vector<W> v(len);
        for (auto& e : v) e = (W)rng();
        srcs.push_back(v);
    }
    const W canary = (W)0xA5A5A5A5A5A5A5A5ull;
    std::vector<W> flat(flat_len, canary), want(flat_len, canary);
    for (size_t p = 0; p < pieces.size(); p++)
        for (size_t i = 0; i < pieces[p].second; i++) want[pieces[p].first + i] = srcs[p][i];
    auto gather = [&](Pieces t, unsigned n) {
        if constexpr (sizeof(W) == 2) gather_pieces_b16(t, n, flat.data());
        else if constexpr (sizeof(W) == 4) gather_pieces_b32(t, n, flat.data());
        else gather_pieces_b64(t, n, flat.data());
    };
    launch_table(gather, pieces, [&](size_t p) { return srcs[p].data(); }, 2, 5);
    expect(flat == want, what);
    // And back: each piece from the flat buffer, past its end untouched.
    std::vector<std::vector<W>> outs;
    for (auto [at, len] : pieces) outs.push_back(std::vector<W>(len + 1, canary));
    auto scatter = [&](Pieces t, unsigned n) {
        if constexpr (sizeof(W) == 2) scatter_pieces_b16(t, n, flat.data());
        else if constexpr (sizeof(W) == 4) scatter_pieces_b32(t, n, flat.data());
        else scatter_pieces_b64(t, n, flat.data());
    };
    launch_table(scatter, pieces, [&](size_t p) { return outs[p].data(); }, 1, 7);
    bool back = true;
    for (size_t p = 0; p < pieces.size(); p++) {
        for (size_t i = 0; i < pieces[p].second; i++) back &= outs[p][i] == srcs[p][i];
        back &= outs[p][pieces[p].second] == canary;
    }
    expect(back, what);
}

// The f32 flat buffer against 16-bit pieces: widening gather, widening add,
// narrowing scatter; and the f32 add.
static void conversions(std::mt19937& rng, bool bf, bool quads) {
    const char* name = bf ? (quads ? "bf16, pieces at multiples of 4" : "bf16")
                          : (quads ? "f16, pieces at multiples of 4" : "f16");
    size_t flat_len = 0;
    const auto pieces = layout(rng, 40, flat_len, quads);
    auto widen_ref = [&](unsigned short h) { return bf ? __uint_as_float((unsigned)h << 16) : half_to_float(h); };
    auto narrow_ref = [&](float f) { return bf ? bf16_ref(f) : float_to_half(f); };
    std::vector<std::vector<unsigned short>> srcs;
    for (auto [at, len] : pieces) {
        std::vector<unsigned short> v(len);
        for (auto& e : v) e = narrow_ref(value(rng));
        srcs.push_back(v);
    }
    const float canary = -7.25f;
    std::vector<float> flat(flat_len, canary), want(flat_len, canary);
    for (size_t p = 0; p < pieces.size(); p++)
        for (size_t i = 0; i < pieces[p].second; i++) want[pieces[p].first + i] = widen_ref(srcs[p][i]);
    auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
        for (size_t i = 0; i < a.size(); i++)
            if (bits(a[i]) != bits(b[i])) return false;
        return true;
    };
    auto src_of = [&](size_t p) { return srcs[p].data(); };
    launch_table([&](Pieces t, unsigned n) { (bf ? gather_widen_bf16 : gather_widen_f16)(t, n, flat.data()); },
                 pieces, src_of, 3, 4);
    expect(same(flat, want), name);
    // Added onto values already there (an accumulated gradient).
    for (size_t i = 0; i < flat_len; i++) flat[i] = want[i] = value(rng);
    for (size_t p = 0; p < pieces.size(); p++)
        for (size_t i = 0; i < pieces[p].second; i++) want[pieces[p].first + i] += widen_ref(srcs[p][i]);
    launch_table([&](Pieces t, unsigned n) { (bf ? gather_add_widen_bf16 : gather_add_widen_f16)(t, n, flat.data()); },
                 pieces, src_of, 2, 64);
    expect(same(flat, want), name);
    // Narrowed back into the pieces (rounded: ties to even, NaN quiet).
    std::vector<std::vector<unsigned short>> outs;
    for (auto [at, len] : pieces) outs.push_back(std::vector<unsigned short>(len + 1, 0xBEEF));
    launch_table([&](Pieces t, unsigned n) { (bf ? scatter_narrow_bf16 : scatter_narrow_f16)(t, n, flat.data()); },
                 pieces, [&](size_t p) { return outs[p].data(); }, 1, 3);
    bool back = true;
    for (size_t p = 0; p < pieces.size(); p++) {
        for (size_t i = 0; i < pieces[p].second; i++) back &= outs[p][i] == narrow_ref(flat[pieces[p].first + i]);
        back &= outs[p][pieces[p].second] == 0xBEEF;
    }
    expect(back, name);
    if (!bf) return;
    // The f32 accumulating gather, over the same layout.
    std::vector<std::vector<float>> f32s;
    for (auto [at, len] : pieces) {
        std::vector<float> v(len);
        for (auto& e : v) e = value(rng);
        f32s.push_back(v);
    }
    want = flat;
    for (size_t p = 0; p < pieces.size(); p++)
        for (size_t i = 0; i < pieces[p].second; i++) want[pieces[p].first + i] += f32s[p][i];
    launch_table([&](Pieces t, unsigned n) { gather_add_pieces_f32(t, n, flat.data()); }, pieces,
                 [&](size_t p) { return f32s[p].data(); }, 2, 9);
    expect(same(flat, want), "f32 add");
}

int main() {
    std::mt19937 rng(20261130);
    for (int round = 0; round < 3; round++) {
        copies_of_width<unsigned short>(rng, "b16 copies");
        copies_of_width<unsigned int>(rng, "b32 copies");
        copies_of_width<unsigned long long>(rng, "b64 copies");
        for (bool quads : {false, true}) {
            conversions(rng, true, quads);
            conversions(rng, false, quads);
        }
    }
    printf("table-driven copies on the CPU: %s\n", failures ? "FAILED" : "ok");
    return failures ? 1 : 0;
}
