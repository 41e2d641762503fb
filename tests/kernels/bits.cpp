// The native kernels' outputs on fixed pseudo-random inputs, written as raw float32 to a file:
// what tests/unit/test_kernel_builds.py compares between builds for different instruction sets
// (AVX-512, AVX2, ARM's NEON under qemu, none). It needs no Python, so a build for another
// processor runs it under an emulator.
//
// Products: every weight format the kernels hold (4, 5, 6 and 8 bits with float16, float32 and
// K-quant factored params, offsets or none, bfloat16) at 1, 3, 8 and 11 rows. Forwards: a tiny
// Llama-shaped model (two layers, head_dim from argv: 64 or 128; a vocabulary of 96, not a
// whole tile) over a pool of 32-position blocks: two prefills, then one forward of both
// sequences, a tree of five rows on one and a chain of three on the other.
//
// Usage: bits OUT [head_dim]
#include "forward.cpp"

#include <stdio.h>

#include <vector>

static uint64_t state = 0x9e3779b97f4a7c15ull;

static uint32_t next() {  // xorshift64*: the same numbers on every processor
  state ^= state >> 12;
  state ^= state << 25;
  state ^= state >> 27;
  return (uint32_t)((state * 0x2545f4914f6cdd1dull) >> 32);
}

static float uniform() { return (float)(next() >> 8) / 16777216.0f * 2.0f - 1.0f; }  // [-1, 1)

static uint16_t half_bits(int lo_exp, int hi_exp) {  // a float16 of exponent in [lo, hi]
  uint32_t e = (uint32_t)(lo_exp + (int)(next() % (uint32_t)(hi_exp - lo_exp + 1)));
  return (uint16_t)((next() & 0x8000u) | (e << 10) | (next() & 0x3ffu));
}

// A weight of n outputs and k inputs held as qmm.cpp holds it, its contents random.
struct Weight {
  std::vector<uint8_t> q, scale, offset;
  QW w;
  Weight(int64_t n, int64_t k, int bits, int gs, int params, bool offsets) {
    int64_t units = 2 * ((n + 63) / 64), groups = k / gs;
    int64_t qbytes = bits == 16 ? units * 2 * (k / 2) * 64 : units * 2 * groups * block_bytes(bits, gs);
    q.resize(qbytes);
    if (bits == 16) {  // bfloat16 pairs of moderate exponent
      for (int64_t i = 0; i + 1 < qbytes; i += 2) {
        uint16_t h = (uint16_t)((next() & 0x8000u) | ((118u + next() % 8u) << 7) | (next() & 0x7fu));
        memcpy(&q[i], &h, 2);
      }
    } else {
      for (auto& b : q) b = (uint8_t)next();
    }
    auto params_of = [&](std::vector<uint8_t>& out) {
      if (params == 2) {
        int64_t supers = groups * gs / 256, per = supers * 64 + groups * 32;
        out.resize(units * per);
        for (int64_t u = 0; u < units; u++) {
          for (int64_t i = 0; i < supers * 32; i++) {
            uint16_t h = half_bits(7, 11);
            memcpy(&out[u * per + 2 * i], &h, 2);
          }
          for (int64_t i = 0; i < groups * 32; i++) out[u * per + supers * 64 + i] = (uint8_t)next();
        }
      } else if (params == 1) {
        out.resize(units * groups * 32 * 4);
        for (size_t i = 0; i < out.size(); i += 4) {
          float f = uniform() * 0.05f;
          memcpy(&out[i], &f, 4);
        }
      } else {
        out.resize(units * groups * 32 * 2);
        for (size_t i = 0; i < out.size(); i += 2) {
          uint16_t h = half_bits(9, 13);
          memcpy(&out[i], &h, 2);
        }
      }
    };
    if (bits != 16) {
      params_of(scale);
      if (offsets) params_of(offset);
    }
    w = QW{q.data(), scale.empty() ? nullptr : scale.data(),
           offset.empty() ? nullptr : offset.data(), nullptr, n, k, bits, gs, params, 0};
  }
};

static std::vector<float> randoms(int64_t n, float spread, float centre = 0.0f) {
  std::vector<float> v(n);
  for (auto& x : v) x = centre + spread * uniform();
  return v;
}

static void put(FILE* out, const float* x, int64_t n) { fwrite(x, sizeof(float), n, out); }

static void products(FILE* out) {
  const int64_t K = 512, N = 80;
  struct Case { int bits, gs, params; bool offsets; };
  const Case cases[] = {{4, 32, 0, true},  {8, 32, 0, false}, {4, 32, 1, true},
                        {4, 32, 2, true},  {8, 16, 2, false}, {16, 0, 0, false},
                        {5, 32, 0, true},  {5, 32, 2, true},  {6, 16, 2, false}};
  for (const Case& c : cases) {
    Weight w(N, K, c.bits, c.gs, c.params, c.offsets);
    std::vector<float> bias = randoms(N, 0.1f);
    for (int64_t M : {1, 3, 8, 11}) {
      std::vector<float> x = randoms(M * K, 2.0f), y(M * N);
      as_qmm(x.data(), M, K, N, w.w.q, c.bits, c.gs, w.w.scale, w.w.offset, c.params,
             M == 3 ? bias.data() : nullptr, y.data(), 2);
      put(out, y.data(), M * N);
    }
  }
}

static void forwards(FILE* out, int64_t dim) {
  const int64_t layers = 2, heads = 2, kv_heads = 1, hidden = heads * dim, inter = 256;
  const int64_t vocab = 96, block = 32, blocks = 8, positions = 128;
  int64_t half = as_kv_half(dim);
  std::vector<Weight> weights;
  weights.reserve(layers * 7 + 1);
  std::vector<std::vector<float>> norms;
  std::vector<Layer> layer(layers);
  for (int64_t l = 0; l < layers; l++) {
    Layer& L = layer[l];
    const int64_t shapes[7][2] = {{heads * dim, hidden}, {kv_heads * dim, hidden},
                                  {kv_heads * dim, hidden}, {hidden, heads * dim},
                                  {inter, hidden}, {inter, hidden}, {hidden, inter}};
    QW* slots[7] = {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down};
    const int bits[7] = {4, 8, 5, 4, 6, 5, 8};  // q, k, v, o, gate, up, down
    for (int i = 0; i < 7; i++) {
      weights.emplace_back(shapes[i][0], shapes[i][1], bits[i], bits[i] == 6 ? 16 : 32, 0,
                           bits[i] == 4 || bits[i] == 5);
      *slots[i] = weights.back().w;
    }
    norms.push_back(randoms(hidden, 0.2f, 1.0f));
    norms.push_back(randoms(hidden, 0.2f, 1.0f));
    L.norm_in = norms[norms.size() - 2].data();
    L.norm_mlp = norms.back().data();
    L.norm_q = L.norm_k = nullptr;
  }
  weights.emplace_back(vocab, hidden, 8, 32, 0, false);  // the embedding, and the tied head
  QW& table = weights.back().w;
  std::vector<float> norm = randoms(hidden, 0.2f, 1.0f);
  std::vector<float> cos = randoms(positions * dim, 1.0f), sin = randoms(positions * dim, 1.0f);
  Model m{layers, hidden, heads, kv_heads, dim, inter, vocab, block, half,
          1e-5f, 1.0f / sqrtf((float)dim), layer.data(), norm.data(), &table, &table,
          cos.data(), sin.data()};
  size_t per_layer = (size_t)blocks * kv_heads * block * dim * (half ? 2 : 4);
  std::vector<std::vector<uint8_t>> kbuf(layers, std::vector<uint8_t>(per_layer)),
      vbuf(layers, std::vector<uint8_t>(per_layer));
  std::vector<float*> keys(layers), values(layers);
  for (int64_t l = 0; l < layers; l++) keys[l] = (float*)kbuf[l].data(), values[l] = (float*)vbuf[l].data();
  const int64_t tables[2][4] = {{0, 1, 2, 3}, {7, 5, 6, 4}};  // each sequence's blocks
  // One forward of rows over members; each row: (member, parent row or -1, token).
  struct Row { int64_t member, parent, id; };
  auto forward = [&](const std::vector<Row>& rows, const int64_t* kv) {
    int64_t n = (int64_t)rows.size(), members = 2;
    std::vector<int64_t> ids, pos, member, index, nrows(members, 0), table_at, tabs, anc_at;
    std::vector<uint8_t> anc;
    std::vector<int64_t> depth(n, 0), local(n);
    for (int64_t r = 0; r < n; r++) {
      local[r] = nrows[rows[r].member]++;
      depth[r] = rows[r].parent < 0 ? 0 : depth[rows[r].parent] + 1;
    }
    for (int64_t mem = 0; mem < members; mem++) {
      table_at.push_back((int64_t)tabs.size());
      tabs.insert(tabs.end(), tables[mem], tables[mem] + 4);
      anc_at.push_back((int64_t)anc.size());
      std::vector<int64_t> mine;
      for (int64_t r = 0; r < n; r++)
        if (rows[r].member == mem) mine.push_back(r);
      for (int64_t a : mine)
        for (int64_t b : mine) {  // b an ancestor of a, or a itself
          int64_t at = a;
          while (at >= 0 && at != b) at = rows[at].parent;
          anc.push_back(at == b ? 1 : 0);
        }
    }
    for (int64_t r = 0; r < n; r++) {
      ids.push_back(rows[r].id);
      pos.push_back(kv[rows[r].member] + depth[r]);
      member.push_back(rows[r].member);
      index.push_back(local[r]);
    }
    std::vector<int64_t> logit_rows(n);
    for (int64_t r = 0; r < n; r++) logit_rows[r] = r;
    Batch b{n, ids.data(), pos.data(), member.data(), index.data(), kv, nrows.data(),
            table_at.data(), tabs.data(), anc_at.data(), anc.data(), n, logit_rows.data(),
            keys.data(), values.data()};
    std::vector<float> logits(n * vocab);
    as_forward(&m, &b, logits.data(), nullptr, 2);
    put(out, logits.data(), n * vocab);
  };
  // Rows of a member must be contiguous: a prefill of 37 rows on sequence 0, of 20 on 1.
  std::vector<Row> first, second, step;
  for (int64_t i = 0; i < 37; i++) first.push_back({0, i - 1, (int64_t)(next() % vocab)});
  for (int64_t i = 0; i < 20; i++) second.push_back({1, i - 1, (int64_t)(next() % vocab)});
  const int64_t none[2] = {0, 0}, after_first[2] = {37, 0}, after_both[2] = {37, 20};
  forward(first, none);
  forward(second, after_first);
  // A tree on sequence 0 (rows 0-4: 1 and 2 children of 0, 3 of 1, 4 of 3), a chain on 1.
  const int64_t parents[5] = {-1, 0, 0, 1, 3};
  for (int64_t i = 0; i < 5; i++) step.push_back({0, parents[i], (int64_t)(next() % vocab)});
  for (int64_t i = 0; i < 3; i++) step.push_back({1, i == 0 ? -1 : 5 + i - 1, (int64_t)(next() % vocab)});
  forward(step, after_both);
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s OUT [head_dim]\n", argv[0]);
    return 2;
  }
  FILE* out = fopen(argv[1], "wb");
  if (!out) {
    perror(argv[1]);
    return 1;
  }
  products(out);
  forwards(out, argc > 2 ? atoll(argv[2]) : 64);
  fclose(out);
  printf("lanes %d kv_half %d\n", as_lanes(), as_kv_half(argc > 2 ? atoll(argv[2]) : 64));
  return 0;
}
