// The embedding gradient's kernels of src/kernels/embedding.cu on the CPU
// (see shim.h), launched as layers/embedding.rs launches them but with the
// grid capped so that the grid-stride loops run: the order is the rows
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
    // One id for every row: a single sum over all of them.
    std::vector<unsigned> same(600, 3u);
    expect(embedding_test<float, unsigned>(same, vocab, 33, 5, 9), "embedding backward, one id for 600 rows");
    printf("the embedding gradient on the CPU: %s\n", failures ? "FAILED" : "ok");
    return failures ? 1 : 0;
}
