// agentspec's native forward of a Llama-like decoder over a GGUF's weights as stored, on the
// engine's KV pool: one call a forward, every layer's norms, products, rotary embedding, KV
// writes, attention and MLP inside it.
//
// Row invariance: a row's bits depend on nothing but its own token, position and the keys it
// sees. Each operation below computes a row (and a (row, head) of attention) alone, in a fixed
// order: the products (qmm.cpp) quantize a row's inputs alone (16 bits a group of 32) and sum
// each (row, output) in exact integers a group and in float32 over the groups in order (over
// bfloat16 weights: two fma chains per (row, output) over its float32 inputs); every
// other reduction (a norm's sum of squares, a dot product over a head, attention's sums over
// the keys) in sixteen partial sums by index modulo sixteen, added in one fixed order. A row
// reads its keys in slot order, from slot 0: the committed positions, then the forward's rows
// it sees (its ancestors); a slot it does not see adds exact zeros, so the keys of other rows of
// its forward (or their absence) change nothing. No row is padded: the forward runs exactly
// its rows, whatever their number.
//
// exp is one fixed polynomial (exp_fixed), the same on every path, not the C library's.
#include "qmm.cpp"

struct QW {
  const uint8_t* q;
  const void* scale;
  const void* offset;
  const float* bias;
  int64_t n, k;
  int32_t bits, gs, params, pad;
};

struct Layer {
  QW q, k, v, o, gate, up, down;
  const float* norm_in;
  const float* norm_mlp;
  const float* norm_q;  // Qwen3's RMSNorm over each query / key head (null: none)
  const float* norm_k;
};

struct Model {
  int64_t layers, hidden, heads, kv_heads, dim, inter, vocab, block, kv_half;
  float eps, scale;
  const Layer* layer;
  const float* norm;
  const QW* head;
  const QW* embed;
  const float* cos;  // [positions, dim]
  const float* sin;
};

struct Batch {
  int64_t rows;
  const int64_t* ids;       // [rows]
  const int64_t* pos;       // [rows] rotary positions
  const int64_t* member;    // [rows] the member a row belongs to
  const int64_t* index;     // [rows] the row's index within its member
  const int64_t* kv;        // [members] committed length
  const int64_t* nrows;     // [members] rows in this forward
  const int64_t* table_at;  // [members] offset of the member's block table in tables
  const int64_t* tables;
  const int64_t* anc_at;    // [members] offset of the member's ancestor matrix in anc
  const uint8_t* anc;       // row-major [nrows][nrows] per member
  int64_t logit_count;
  const int64_t* logit_rows;
  float* const* keys;       // [layers] pool buffers [blocks, kv_heads, block, dim]
  float* const* values;
};

// Sixteen partial sums of a[i] * b[i] by i modulo sixteen (n a multiple of 16), added in a
// fixed tree.
static inline float dot16(const float* a, const float* b, int64_t n) {
  float part[16] = {0};
  for (int64_t i = 0; i < n; i += 16)
    for (int l = 0; l < 16; l++) part[l] = fmaf(a[i + l], b[i + l], part[l]);
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; l++) part[l] = part[l] + part[l + w];
  return part[0];
}

static void rmsnorm(const float* x, int64_t rows, int64_t dim, const float* w, float eps,
                    float* out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows > 8) schedule(static)
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = x + r * dim;
    float var = dot16(xr, xr, dim) / (float)dim;
    float inv = 1.0f / sqrtf(var + eps);
    for (int64_t i = 0; i < dim; i++) out[r * dim + i] = w[i] * (xr[i] * inv);
  }
}

// The product of a weight into out (+ add), output rows ldo apart, as a qmm.cpp Job.
static inline Job job(const QW& w, const float* add, float* out, int64_t ldo) {
  return Job{w.n, w.q, w.bits, w.gs, w.params, w.scale, w.offset, w.bias, add, out, ldo};
}

// out = add + x @ w^T from float rows x[rows][w.k] no other product reads.
static void product(const float* x, int64_t rows, const QW& w, const float* add, float* out,
                    int64_t ldo, int nthreads) {
  Rows in(x, rows, w.k, nthreads);
  Job j = job(w, add, out, ldo);
  products(in, &j, 1);
}

// Rotary embedding of heads [0, heads) of each row of x ([rows][stride], heads of dim at the
// start of a row), rotate-half form: x * cos + rotate_half(x) * sin.
static void rope(float* x, int64_t rows, int64_t stride, int64_t heads, int64_t dim,
                 const int64_t* pos, const float* cos, const float* sin) {
  int64_t half = dim / 2;
  for (int64_t r = 0; r < rows; r++) {
    const float* c = cos + pos[r] * dim;
    const float* s = sin + pos[r] * dim;
    for (int64_t h = 0; h < heads; h++) {
      float* v = x + r * stride + h * dim;
      for (int64_t i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * c[i] + (-b) * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
}

static inline int64_t slot_at(const Model* m, const Batch* b, int64_t mem, int64_t slot,
                              int64_t head) {
  int64_t block = b->tables[b->table_at[mem] + slot / m->block];
  return ((block * m->kv_heads + head) * m->block + slot % m->block) * m->dim;
}

// Each row's keys and values into the pool at slot kv + index.
static void write_kv(const Model* m, const Batch* b, const float* qkv, int64_t stride,
                     float* keys, float* values) {
  int64_t qw = m->heads * m->dim, kw = m->kv_heads * m->dim;
  for (int64_t r = 0; r < b->rows; r++) {
    int64_t mem = b->member[r], slot = b->kv[mem] + b->index[r];
    for (int64_t h = 0; h < m->kv_heads; h++) {
      int64_t at = slot_at(m, b, mem, slot, h);
      const float* k = qkv + r * stride + qw + h * m->dim;
      const float* v = qkv + r * stride + qw + kw + h * m->dim;
#ifdef AS_VEC
      if (m->kv_half) {  // float16, rounded to nearest: half the bytes attention reads; a key
        // in its run of 16 positions' keys transposed ([dim][16], the pool's key_lanes 16)
        int64_t lane = slot % 16;  // blocks hold whole runs: the run starts lane rows back
        uint16_t* kh = (uint16_t*)keys + at - lane * m->dim + lane;
        uint16_t* vh = (uint16_t*)values + at;
        for (int64_t c = 0; c < m->dim; c += LANES) {
          uint16_t kc[LANES];
          vf_store_half(kc, vf_load(k + c));
          for (int l = 0; l < LANES; l++) kh[(c + l) * 16] = kc[l];
          vf_store_half(vh + c, vf_load(v + c));
        }
        continue;
      }
#endif
      memcpy(keys + at, k, m->dim * sizeof(float));
      memcpy(values + at, v, m->dim * sizeof(float));
    }
  }
}

// out[r][h] = softmax(q . K / sqrt) V over the keys row r sees, per query head; the query
// heads sharing a key/value head are one task, each key read once for them.
static void attention_portable(const Model* m, const Batch* b, const float* qkv, int64_t stride,
                      const float* keys, const float* values, float* out, int nthreads) {
  int64_t heads = m->heads, dim = m->dim, group = m->heads / m->kv_heads, B = m->block;
  int64_t most = 0;
  for (int64_t r = 0; r < b->rows; r++) {
    int64_t mem = b->member[r];
    int64_t len = b->kv[mem] + b->nrows[mem];
    if (len > most) most = len;
  }
#pragma omp parallel num_threads(nthreads)
  {
    float* score = (float*)malloc((size_t)group * (most + 16) * sizeof(float));
    float* acc = (float*)malloc((size_t)group * dim * sizeof(float));
#pragma omp for schedule(static)
    for (int64_t task = 0; task < b->rows * m->kv_heads; task++) {
      int64_t r = task / m->kv_heads, kvh = task % m->kv_heads;
      int64_t mem = b->member[r], kv = b->kv[mem], n = b->nrows[mem], i = b->index[r];
      const uint8_t* sees = b->anc + b->anc_at[mem] + i * n;
      const int64_t* table = b->tables + b->table_at[mem];
      const float* q = qkv + r * stride + kvh * group * dim;  // the group's query heads
      int64_t len = kv + n;
      float top[64];
      for (int64_t g = 0; g < group; g++) top[g] = -INFINITY;
      for (int64_t j0 = 0; j0 < len; j0 += B) {
        const float* kb = keys + (table[j0 / B] * m->kv_heads + kvh) * B * dim;
        int64_t j1 = j0 + B < len ? j0 + B : len;
        for (int64_t j = j0; j < j1; j++) {
          if (j >= kv && !sees[j - kv]) continue;
          const float* k = kb + (j - j0) * dim;
          for (int64_t g = 0; g < group; g++) {
            float s = dot16(q + g * dim, k, dim) * m->scale;
            score[g * most + j] = s;
            if (s > top[g]) top[g] = s;
          }
        }
      }
      float part[64][16];
      for (int64_t g = 0; g < group; g++) {
        for (int l = 0; l < 16; l++) part[g][l] = 0.0f;
        for (int64_t d = 0; d < dim; d++) acc[g * dim + d] = 0.0f;
      }
      for (int64_t j0 = 0; j0 < len; j0 += B) {
        const float* vb = values + (table[j0 / B] * m->kv_heads + kvh) * B * dim;
        int64_t j1 = j0 + B < len ? j0 + B : len;
        for (int64_t j = j0; j < j1; j++) {
          if (j >= kv && !sees[j - kv]) continue;
          const float* v = vb + (j - j0) * dim;
          for (int64_t g = 0; g < group; g++) {
            float p = exp_fixed(score[g * most + j] - top[g]);
            part[g][j % 16] += p;
            float* a = acc + g * dim;
            for (int64_t d = 0; d < dim; d++) a[d] = fmaf(p, v[d], a[d]);
          }
        }
      }
      for (int64_t g = 0; g < group; g++) {
        for (int w = 8; w >= 1; w /= 2)
          for (int l = 0; l < w; l++) part[g][l] = part[g][l] + part[g][l + w];
        float* o = out + r * heads * dim + (kvh * group + g) * dim;
        for (int64_t d = 0; d < dim; d++) o[d] = acc[g * dim + d] / part[g][0];
      }
    }
    free(score);
    free(acc);
  }
}

#ifdef AS_VEC
// Vectors a run of 16 keys takes, and a value tile's dims (4 * LANES); vec.h says how many
// runs a score tile covers (TILE_RUNS) and how many queries a value tile takes.
static const int RUN = 16 / LANES;
static const int VALUE_VECS = 4;

// T queries' scores for C runs of sixteen keys (kc[c]: a run as the pool keeps it, float16
// [dim][16], lane = key): per (query, key) one fma chain over the head's dims in order, so a
// query's score for a key is the same whatever T, C and LANES are.
template <int T, int C>
static inline void scores_tile(const float* const* qg, const uint16_t* const* kc, int64_t dim,
                               vf* out) {
  vf a[T][C * RUN];
  for (int t = 0; t < T; t++)
    for (int i = 0; i < C * RUN; i++) a[t][i] = vf_zero();
  for (int64_t d = 0; d < dim; d++) {
    vf k[C * RUN];
    for (int i = 0; i < C * RUN; i++) k[i] = vf_half(kc[i / RUN] + d * 16 + (i % RUN) * LANES);
    for (int t = 0; t < T; t++) {
      vf q = vf_set(qg[t][d]);
      for (int i = 0; i < C * RUN; i++) a[t][i] = vf_fma(q, k[i], a[t][i]);
    }
  }
  for (int t = 0; t < T; t++)
    for (int i = 0; i < C * RUN; i++) out[t * C * RUN + i] = a[t][i];
}

// scores_tile for tn (1 to 4) queries.
template <int C>
static inline void scores_tiles(int64_t tn, const float* const* qg, const uint16_t* const* kc,
                                int64_t dim, vf* out) {
  switch (tn) {
    case 1: scores_tile<1, C>(qg, kc, dim, out); break;
    case 2: scores_tile<2, C>(qg, kc, dim, out); break;
    case 3: scores_tile<3, C>(qg, kc, dim, out); break;
    default: scores_tile<4, C>(qg, kc, dim, out);
  }
}

// T queries' outputs, dims [d0, d0 + VALUE_VECS * LANES), over the keys [0, len) (p: their
// weights, [T] rows of the score buffer; values: the pool's float16 rows): per output element
// one fma chain in key order (a key a query does not see has p = 0 and adds exactly nothing:
// fma(0, v, acc) is acc, v finite and acc never -0), then divided by the query's total.
template <int DIM, int T>
static inline void values_tile(const float* const* p, const float* total, int64_t len,
                               const uint16_t* values, const int64_t* table, int64_t kvh,
                               int64_t kv_heads, int64_t B, int64_t d0, float* const* o) {
  const int64_t dim = DIM;
  vf a[T][VALUE_VECS];
  for (int t = 0; t < T; t++)
    for (int c = 0; c < VALUE_VECS; c++) a[t][c] = vf_zero();
  for (int64_t j0 = 0; j0 < len; j0 += 16) {
    const uint16_t* vr = values + ((table[j0 / B] * kv_heads + kvh) * B + j0 % B) * dim + d0;
    int64_t keys16 = len - j0 < 16 ? len - j0 : 16;
    for (int64_t l = 0; l < keys16; l++) {
      vf v[VALUE_VECS];
      for (int c = 0; c < VALUE_VECS; c++) v[c] = vf_half(vr + l * dim + c * LANES);
      for (int t = 0; t < T; t++) {
        vf w = vf_set(p[t][j0 + l]);
        for (int c = 0; c < VALUE_VECS; c++) a[t][c] = vf_fma(w, v[c], a[t][c]);
      }
    }
  }
  for (int t = 0; t < T; t++) {
    vf tv = vf_set(total[t]);
    for (int c = 0; c < VALUE_VECS; c++) vf_store(o[t] + d0 + c * LANES, vf_div(a[t][c], tv));
  }
}

// Attention with the keys in the lanes, over the pool's float16 keys in transposed runs of 16
// and float16 value rows: each run of up to eight rows of one member and one key/value head
// (or an equal slice of its queries, when there are few such tasks) is a task. Its queries' scores
// four queries and TILE_RUNS runs of keys a tile (each key vector read once for four queries,
// each query's q[d] once for the tile's keys), exp a vector of keys at a time, the weights' sum
// in sixteen partials by key modulo sixteen, the values VALUE_QUERIES queries and 4 * LANES
// dims a tile. What a query computes depends on its own keys only, not on the task it is in,
// the tiles or the lanes. DIM: the head's dims (64 or 128).
template <int DIM>
static void attention_keys(const Model* m, const Batch* b, const float* qkv, int64_t stride,
                           const float* keys, const float* values, float* out, int nthreads) {
  const int64_t dim = DIM, heads = m->heads, group = m->heads / m->kv_heads, B = m->block;
  int64_t* run = (int64_t*)malloc((size_t)(b->rows + 1) * sizeof(int64_t));
  int64_t runs = 0, most = 0;
  for (int64_t r = 0; r < b->rows; r++) {
    if (r == 0 || b->member[r] != b->member[r - 1] || r - run[runs - 1] == 8) run[runs++] = r;
    int64_t len = b->kv[b->member[r]] + b->nrows[b->member[r]];
    if (len > most) most = len;
  }
  run[runs] = b->rows;
  most = (most + 15) / 16 * 16;
  // Still few tasks (a step of a few rows): a run's queries of a key/value head, in (row, head)
  // order, split into equal slices, so every thread has work and the same work (each slice
  // reads the keys again).
  int64_t parts = 1;
  while (runs * m->kv_heads * parts < 2 * nthreads && parts < group) parts++;
  const uint16_t* kh = (const uint16_t*)keys;
  const uint16_t* vh = (const uint16_t*)values;
#pragma omp parallel num_threads(nthreads)
  {
    float* score = (float*)aligned_alloc(64, (size_t)8 * group * most * sizeof(float));
    float total[8 * 16];
#pragma omp for schedule(static)
    for (int64_t task = 0; task < runs * m->kv_heads * parts; task++) {
      int64_t ru = task / (m->kv_heads * parts), kvh = task / parts % m->kv_heads;
      int64_t r0 = run[ru], count = run[ru + 1] - r0, all = count * group;
      int64_t q0 = task % parts * all / parts, tq = (task % parts + 1) * all / parts - q0;
      int64_t mem = b->member[r0], kv = b->kv[mem], n = b->nrows[mem], len = kv + n;
      const int64_t* table = b->tables + b->table_at[mem];
      int64_t qis[8 * 16];
      const float* qs[8 * 16];
      for (int64_t t = 0; t < tq; t++) {
        int64_t ri = (q0 + t) / group, g = (q0 + t) % group;
        qis[t] = q0 + t;
        qs[t] = qkv + (r0 + ri) * stride + (kvh * group + g) * dim;
      }
      vf top[8 * 16];
      for (int64_t t = 0; t < tq; t++) top[t] = vf_set(-INFINITY);
      for (int64_t j0 = 0; j0 < len;) {
        int64_t chunks = (len - j0 + 15) / 16 >= TILE_RUNS ? TILE_RUNS : 1;
        const uint16_t* kc[TILE_RUNS];
        uint16_t seen[TILE_RUNS][8];
        for (int64_t c = 0; c < chunks; c++) {
          int64_t j = j0 + 16 * c;
          kc[c] = kh + ((table[j / B] * m->kv_heads + kvh) * B + j % B) * dim;
          for (int64_t ri = 0; ri < count; ri++) {
            const uint8_t* sees = b->anc + b->anc_at[mem] + b->index[r0 + ri] * n;
            uint16_t bits = 0;
            if (j + 16 <= kv) {
              bits = 0xffff;
            } else {
              for (int l = 0; l < 16; l++)
                if (j + l < len && (j + l < kv || sees[j + l - kv])) bits |= (uint16_t)(1u << l);
            }
            seen[c][ri] = bits;
          }
        }
        for (int64_t t0 = 0; t0 < tq; t0 += 4) {
          int64_t tn = tq - t0 < 4 ? tq - t0 : 4;
          vf sc[4 * TILE_RUNS * RUN];
          if (chunks == TILE_RUNS) scores_tiles<TILE_RUNS>(tn, qs + t0, kc, dim, sc);
          else scores_tiles<1>(tn, qs + t0, kc, dim, sc);
          for (int64_t t = 0; t < tn; t++)
            for (int64_t i = 0; i < chunks * RUN; i++) {
              int64_t qi = qis[t0 + t];
              unsigned bits = (seen[i / RUN][qi / group] >> ((i % RUN) * LANES)) & ((1u << LANES) - 1);
              vf s = vf_set(-INFINITY);
              if (bits) s = vf_pick(bits, vf_mul(sc[t * chunks * RUN + i], vf_set(m->scale)), s);
              vf_store(score + qi * most + j0 + i * LANES, s);
              top[t0 + t] = vf_max(top[t0 + t], s);
            }
        }
        j0 += 16 * chunks;
      }
      int64_t len16 = (len + 15) / 16 * 16;
      for (int64_t t = 0; t < tq; t++) {
        float* sq = score + qis[t] * most;
        vf tv = vf_set(vf_max_all(top[t])), sum[RUN];
        for (int i = 0; i < RUN; i++) sum[i] = vf_zero();
        for (int64_t j0 = 0; j0 < len16; j0 += LANES) {
          vf sv = vf_load(sq + j0);
          vf p = vf_unless_neg_inf(sv, vf_exp(vf_sub(sv, tv)));
          vf_store(sq + j0, p);
          sum[(j0 / LANES) % RUN] = vf_add(sum[(j0 / LANES) % RUN], p);
        }
        float part[16];
        for (int i = 0; i < RUN; i++) vf_store(part + i * LANES, sum[i]);
        for (int w = 8; w >= 1; w /= 2)
          for (int l = 0; l < w; l++) part[l] = part[l] + part[l + w];
        total[t] = part[0];
      }
      for (int64_t d0 = 0; d0 < dim; d0 += VALUE_VECS * LANES)
        for (int64_t t0 = 0; t0 < tq; t0 += VALUE_QUERIES) {
          int64_t tn = tq - t0 < VALUE_QUERIES ? tq - t0 : VALUE_QUERIES;
          const float* p[4];
          float* o[4];
          for (int64_t t = 0; t < tn; t++) {
            int64_t qi = qis[t0 + t], ri = qi / group, g = qi % group;
            p[t] = score + qi * most;
            o[t] = out + (r0 + ri) * heads * dim + (kvh * group + g) * dim;
          }
          switch (tn) {
            case 1: values_tile<DIM, 1>(p, total + t0, len, vh, table, kvh, m->kv_heads, B, d0, o); break;
            case 2: values_tile<DIM, 2>(p, total + t0, len, vh, table, kvh, m->kv_heads, B, d0, o); break;
            case 3: values_tile<DIM, 3>(p, total + t0, len, vh, table, kvh, m->kv_heads, B, d0, o); break;
            default: values_tile<DIM, 4>(p, total + t0, len, vh, table, kvh, m->kv_heads, B, d0, o);
          }
        }
    }
    free(score);
  }
  free(run);
}
#endif

static void attention(const Model* m, const Batch* b, const float* qkv, int64_t stride,
                      const float* keys, const float* values, float* out, int nthreads) {
#ifdef AS_VEC
  if (m->kv_half && m->dim == 64)
    return attention_keys<64>(m, b, qkv, stride, keys, values, out, nthreads);
  if (m->kv_half && m->dim == 128)
    return attention_keys<128>(m, b, qkv, stride, keys, values, out, nthreads);
#endif
  attention_portable(m, b, qkv, stride, keys, values, out, nthreads);
}

// act[r][i] = silu(gate) * up, gate_up [rows][2 * inter] (gate first).
static void silu_mul(const float* gate_up, int64_t rows, int64_t inter, float* act,
                     int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows > 8) schedule(static)
  for (int64_t r = 0; r < rows; r++) {
    const float* g = gate_up + r * 2 * inter;
    const float* u = g + inter;
    int64_t i = 0;
#ifdef AS_VEC
    for (; i + LANES <= inter; i += LANES) {
      vf gv = vf_load(g + i);
      vf silu = vf_div(gv, vf_add(vf_set(1.0f), vf_exp(vf_sub(vf_zero(), gv))));
      vf_store(act + r * inter + i, vf_mul(silu, vf_load(u + i)));
    }
#endif
    for (; i < inter; i++) act[r * inter + i] = g[i] / (1.0f + exp_fixed(-g[i])) * u[i];
  }
}

// Whether this build keeps a model of head_dim ``dim``'s KV in float16 (the key-lane attention
// of a vector build: AVX-512, AVX2 or NEON); else float32.
extern "C" int as_kv_half(int64_t dim) {
#ifdef AS_VEC
  return dim == 64 || dim == 128;
#else
  (void)dim;
  return 0;
#endif
}

// The lanes of this build's vectors (vec.h: 16 AVX-512, 8 AVX2, 4 NEON), 0 without (portable
// loops).
extern "C" int as_lanes() {
#ifdef AS_VEC
  return LANES;
#else
  return 0;
#endif
}

// Seconds spent in each part of the forwards so far (embed, norms, qkv, rope and KV writes,
// attention, output product, MLP products, activation, head), for the engine bench.
static double spent[9];

extern "C" void as_spent(double* out, int reset) {
  for (int i = 0; i < 9; i++) {
    out[i] = spent[i];
    if (reset) spent[i] = 0.0;
  }
}

extern "C" void as_forward(const Model* m, const Batch* b, float* logits, float* hidden_out,
                           int nthreads) {
  int64_t rows = b->rows, hid = m->hidden;
  int64_t qw = m->heads * m->dim, kw = m->kv_heads * m->dim, stride = qw + 2 * kw;
  float* res = (float*)malloc((size_t)rows * hid * sizeof(float));
  float* h = (float*)malloc((size_t)rows * (hid > qw ? hid : qw) * sizeof(float));
  float* qkv = (float*)malloc((size_t)rows * stride * sizeof(float));
  float* att = (float*)malloc((size_t)rows * qw * sizeof(float));
  float* gu = (float*)malloc((size_t)rows * 2 * m->inter * sizeof(float));
  float* act = (float*)malloc((size_t)rows * m->inter * sizeof(float));
  const QW& e = *m->embed;
  double t = omp_get_wtime(), now;
#define LAP(i) (now = omp_get_wtime(), spent[i] += now - t, t = now)
  as_qrows(b->ids, rows, e.k, e.q, e.bits, e.gs, e.scale, e.offset, e.params, res);
  LAP(0);
  for (int64_t l = 0; l < m->layers; l++) {
    const Layer& L = m->layer[l];
    rmsnorm(res, rows, hid, L.norm_in, m->eps, h, nthreads);
    LAP(1);
    {
      Rows in(h, rows, hid, nthreads);
      Job qkv_jobs[3] = {job(L.q, nullptr, qkv, stride), job(L.k, nullptr, qkv + qw, stride),
                         job(L.v, nullptr, qkv + qw + kw, stride)};
      products(in, qkv_jobs, 3);
    }
    LAP(2);
    if (L.norm_q) {  // each head of a row alone, in place, as the model's norm does
      for (int64_t r = 0; r < rows; r++) {
        rmsnorm(qkv + r * stride, m->heads, m->dim, L.norm_q, m->eps, qkv + r * stride, 1);
        rmsnorm(qkv + r * stride + qw, m->kv_heads, m->dim, L.norm_k, m->eps,
                qkv + r * stride + qw, 1);
      }
    }
    rope(qkv, rows, stride, m->heads + m->kv_heads, m->dim, b->pos, m->cos, m->sin);
    write_kv(m, b, qkv, stride, b->keys[l], b->values[l]);
    LAP(3);
    attention(m, b, qkv, stride, b->keys[l], b->values[l], att, nthreads);
    LAP(4);
    product(att, rows, L.o, res, res, hid, nthreads);
    LAP(5);
    rmsnorm(res, rows, hid, L.norm_mlp, m->eps, h, nthreads);
    LAP(1);
    {
      Rows in(h, rows, hid, nthreads);
      Job mlp_jobs[2] = {job(L.gate, nullptr, gu, 2 * m->inter),
                         job(L.up, nullptr, gu + m->inter, 2 * m->inter)};
      products(in, mlp_jobs, 2);
    }
    LAP(6);
    silu_mul(gu, rows, m->inter, act, nthreads);
    LAP(7);
    product(act, rows, L.down, res, res, hid, nthreads);
    LAP(6);
  }
  if (b->logit_count) {
    float* kept = (float*)malloc((size_t)b->logit_count * hid * sizeof(float));
    for (int64_t i = 0; i < b->logit_count; i++)
      memcpy(kept + i * hid, res + b->logit_rows[i] * hid, hid * sizeof(float));
    float* normed = hidden_out ? hidden_out : h;
    rmsnorm(kept, b->logit_count, hid, m->norm, m->eps, normed, nthreads);
    product(normed, b->logit_count, *m->head, nullptr, logits, m->vocab, nthreads);
    free(kept);
  }
  LAP(8);
#undef LAP
  free(res);
  free(h);
  free(qkv);
  free(att);
  free(gu);
  free(act);
}
