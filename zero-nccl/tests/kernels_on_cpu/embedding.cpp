// The embedding kernels of src/kernels/embedding.cu on the CPU (see shim.h),
// launched as layers/embedding.rs launches them but with the grid capped so
// that the grid-stride loops run. The lookup, launched once per stretch of
// a table cut at arbitrary elements (rows split over stretches), copies
// every row exactly and makes the rows of ids outside the vocabulary NaN.
// The gradient: the order is the rows
// sorted by (id, row), and each occurring id's row of the table is exactly
// the f32 sum of its rows in order, rounded once (what the kernel promises,
// so the comparison is bitwise), for f32, bf16 and f16 storage and u32 and
// i64 ids, ids outside the vocabulary skipped, rows of absent ids untouched.
// Exits non-zero on any failure.
#include "shim.h"
#include "layers.cu"
#include "embedding.cu"
#include <cstdio>
#include <random>
#include <algorithm>

static int failures = 0;
static void expect(bool ok, const char* what) {
    if (!ok) {
        printf("FAIL %s\n", what);
        failures++;
    }
}

template <class T> static unsigned bits_of(T v) { unsigned b = 0; memcpy(&b, &v, sizeof v); return b; }

// `ids` of a lookup of `n` rows into a `vocab`-row table of width `dim`:
// whether the kernels' order and table are right.
template <class T, class I>
static bool embedding_test(const std::vector<I>& ids, unsigned vocab, int dim, unsigned cap, unsigned seed) {
    const long long n = (long long)ids.size();
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0, 1);
    std::vector<T> grad(n * dim), table(vocab * dim, from_f32<T>(7.f));
    for (auto& g : grad) g = from_f32<T>(nd(rng));
    std::vector<unsigned> order(n, ~0u);
    launch({std::min<unsigned>((n + EMB_THREADS - 1) / EMB_THREADS, cap), 1, 1}, {EMB_THREADS, 1, 1},
           [&] { embedding_order<I>(ids.data(), order.data(), n, vocab); });
    launch({std::min<unsigned>(n, cap), (unsigned)((dim + EMB_THREADS - 1) / EMB_THREADS), 1}, {EMB_THREADS, 1, 1},
           [&] { embedding_backward<T, I>(ids.data(), order.data(), grad.data(), table.data(), n, dim, vocab); });
    auto row_of = [&](long long i) {
        long long id = (long long)ids[i];
        return id >= 0 && id < (long long)vocab ? (unsigned)id : vocab;
    };
    std::vector<unsigned> want(n);
    for (long long i = 0; i < n; i++) want[i] = (unsigned)i;
    std::stable_sort(want.begin(), want.end(), [&](unsigned a, unsigned b) { return row_of(a) < row_of(b); });
    bool ok = want == order;
    for (unsigned r = 0; r < vocab; r++) {
        bool occurs = false;
        for (long long i = 0; i < n; i++) occurs |= row_of(i) == r;
        for (int c = 0; c < dim; c++) {
            float sum = 0.f;
            for (long long i = 0; i < n; i++)
                if (row_of(i) == r) sum += to_f32(grad[i * dim + c]);
            const T expected = from_f32<T>(occurs ? sum : 7.f);
            ok &= bits_of(table[(long long)r * dim + c]) == bits_of(expected);
        }
    }
    return ok;
}

// The lookup of `ids` in a `vocab`-row table of width `dim`, launched once
// per stretch between the element boundaries `cuts` (0, ..., vocab * dim):
// whether every row is the table's, bitwise, or NaN for an id outside.
template <class T, class I>
static bool lookup_test(const std::vector<I>& ids, unsigned vocab, int dim, const std::vector<long long>& cuts,
                        unsigned cap, unsigned seed) {
    const long long n = (long long)ids.size();
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0, 1);
    std::vector<T> table((long long)vocab * dim), out(n * dim, from_f32<T>(7.f));
    for (auto& v : table) v = from_f32<T>(nd(rng));
    // The stretches in a shuffled order: a launch writing outside its own
    // is not overwritten by the right one after it.
    std::vector<size_t> stretches(cuts.size() - 1);
    for (size_t k = 0; k < stretches.size(); k++) stretches[k] = k;
    std::shuffle(stretches.begin(), stretches.end(), rng);
    for (size_t k : stretches) {
        const long long first = cuts[k], len = cuts[k + 1] - cuts[k];
        // The stretch as a piece holds it: a buffer of its own.
        std::vector<T> part(table.begin() + first, table.begin() + first + len);
        launch({std::min<unsigned>(n, cap), (unsigned)((dim + EMB_THREADS - 1) / EMB_THREADS), 1},
               {EMB_THREADS, 1, 1},
               [&] { embedding_lookup<T, I>(ids.data(), part.data(), out.data(), n, dim, first, len, vocab); });
    }
    bool ok = true;
    for (long long i = 0; i < n; i++) {
        const long long id = (long long)ids[i];
        const bool valid = id >= 0 && id < (long long)vocab;
        for (int c = 0; c < dim; c++) {
            const T got = out[i * dim + c];
            ok &= valid ? bits_of(got) == bits_of(table[id * dim + c]) : to_f32(got) != to_f32(got);
        }
    }
    return ok;
}

// Element boundaries of a `total`-element table in `pieces` stretches at
// random places (so rows are split), from 0 to `total`.
static std::vector<long long> random_cuts(long long total, int pieces, unsigned seed) {
    std::mt19937 rng(seed);
    std::vector<long long> cuts = {0, total};
    for (int k = 1; k < pieces; k++) cuts.push_back(std::uniform_int_distribution<long long>(0, total)(rng));
    std::sort(cuts.begin(), cuts.end());
    return cuts;
}

template <class I> static std::vector<I> random_ids(long long n, long long vocab, bool outside, unsigned seed) {
    std::mt19937 rng(seed);
    // Skewed, as text is: a few ids take most rows.
    std::geometric_distribution<long long> pick(4.0 / (double)vocab);
    std::vector<I> ids(n);
    for (auto& id : ids) id = (I)(pick(rng) % vocab);
    if (outside && n > 2) {
        ids[1] = (I)vocab;
        ids[n - 1] = (I)(vocab + 5);
    }
    return ids;
}

int main() {
    char what[200];
    const unsigned vocab = 40;
    for (long long n : {1LL, 7LL, 256LL, 300LL, 513LL})
        for (int dim : {1, 5, 300})
            for (unsigned cap : {3u, 17u}) {
                const unsigned seed = (unsigned)(n * dim + cap);
                const bool outside = n % 2 == 1;
                auto u = random_ids<unsigned>(n, vocab, outside, seed);
                auto l = random_ids<long long>(n, vocab, outside, seed + 1);
                if (outside && n > 3) l[2] = -3;
                const bool ok = embedding_test<float, unsigned>(u, vocab, dim, cap, seed) &&
                                embedding_test<bf16, long long>(l, vocab, dim, cap, seed + 2) &&
                                embedding_test<f16, unsigned>(u, vocab, dim, cap, seed + 3) &&
                                embedding_test<float, long long>(l, vocab, dim, cap, seed + 4);
                snprintf(what, sizeof what, "embedding backward, %lld ids, dim %d, cap %u, ids outside %d", n,
                         dim, cap, outside);
                expect(ok, what);
            }
    // The lookup has no barrier: few launches keep the harness's threads few.
    for (long long n : {7LL, 300LL})
        for (int dim : {1, 300})
            for (int pieces : {1, 7}) {
                const unsigned seed = (unsigned)(n * dim + pieces * 31), cap = 3;
                auto u = random_ids<unsigned>(n, vocab, true, seed);
                auto l = random_ids<long long>(n, vocab, true, seed + 1);
                l[2] = -3;
                const auto cuts = random_cuts((long long)vocab * dim, pieces, seed + 2);
                const bool ok = lookup_test<float, unsigned>(u, vocab, dim, cuts, cap, seed) &&
                                lookup_test<bf16, long long>(l, vocab, dim, cuts, cap, seed + 3) &&
                                lookup_test<f16, unsigned>(u, vocab, dim, cuts, cap, seed + 4);
                snprintf(what, sizeof what, "embedding lookup, %lld ids (some outside), dim %d, %d pieces", n,
                         dim, pieces);
                expect(ok, what);
            }
    // One id for every row: a single sum over all of them.
    std::vector<unsigned> same(600, 3u);
    expect(embedding_test<float, unsigned>(same, vocab, 33, 5, 9), "embedding backward, one id for 600 rows");
    printf("the embedding lookup and gradient on the CPU: %s\n", failures ? "FAILED" : "ok");
    return failures ? 1 : 0;
}
