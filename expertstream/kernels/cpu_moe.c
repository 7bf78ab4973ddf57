// NVFP4 and MXFP4 SwiGLU experts on the CPU for a few tokens, read in place from expert blocks (RAM cache
// rows). out[t] = sum_e w[e, t] * down_e(silu(gate_e x[t]) * up_e x[t]), gate and up clamped where a limit
// is given (DeepSeek-V4); codes and block scales (E4M3 per 16 weights, or UE8M0 per 32) are decoded in
// registers (16 weights = 8 bytes + 1 scale byte per vector), never into a dequantized copy.
// Built at first use by kernels/cpu_moe.py with the machine's C compiler (-O3 -march=native).
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define TMAX 8
#define MAXTH 256
#define NMAX 64       // most experts one split server request (moe_packed) takes
#define ROWS_UP 16    // fewest gate/up rows a work item takes (up_rows)
#define ROWS_UP_MAX 128
#define ROWS_DOWN 32  // fewest output rows a down item takes (item_rows)
#define ROWS_DOWN_MAX 128
#define ROWS_MAX 128  // the larger of ROWS_UP_MAX and ROWS_DOWN_MAX: an item's rows in a thread's own buffer
#define RMAX 4        // rows one pass over x (or h) takes: each load of x feeds R FMAs

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16b __attribute__((vector_size(16)));
// The loops' vector: VL lanes, a group's 16 weights in 16 / VL parts. AVX2 has 8-lane registers: there GCC
// moves a 16-lane vector through the stack at every use (2x slower than 8-lane parts)
#if defined(__AVX2__) && !defined(__AVX512F__) && !defined(CPU_MOE_PORTABLE)
#define VL 8
#else
#define VL 16
#endif
#define PARTS (16 / VL)
typedef float vf __attribute__((vector_size(4 * VL)));
typedef float vfu __attribute__((vector_size(4 * VL), aligned(4)));  // unaligned loads

// E2M1 code -> value; codes 8..15 are the negatives of 0..7
static const float E2M1[16] = {0, .5f, 1, 1.5f, 2, 3, 4, 6, -0.f, -.5f, -1, -1.5f, -2, -3, -4, -6};
// SLUT[b] = E2M1 * E4M3(b) and SLUT[256 + b] = E2M1 * UE8M0(b): the 16 values of a group with block scale
// byte b (exact in FP32: a 4-bit and a 2-bit significand), so decoding a group is one table lookup, with no
// multiply (16 KB a format, L1-resident)
#define MX_ROWS 256  // the UE8M0 rows' first
static v16f SLUT[2 * MX_ROWS];

// Part q (lanes VL q .. VL q + VL - 1) of the 16 weights of one group (8 code bytes p, table row s), in the
// order x is permuted to (perm below).
#if defined(__AVX512VBMI__) && !defined(CPU_MOE_PORTABLE)
#include <immintrin.h>
// natural order: vpmultishiftqb puts nibble L (bits 4L..4L+3 of the 8 bytes, broadcast to every qword) in
// the low byte of dword lane L, and vpermps reads only its low 4 bits
#define NATURAL 1
static inline vf decode(const uint8_t *p, int s, int q) {
  (void)q;
  const __m512i ctl = _mm512_set_epi64(0x3c00000038LL, 0x3400000030LL, 0x2c00000028LL, 0x2400000020LL,
                                       0x1c00000018LL, 0x1400000010LL, 0x0c00000008LL, 0x0400000000LL);
  uint64_t b;
  memcpy(&b, p, 8);
  __m512i idx = _mm512_multishift_epi64_epi8(ctl, _mm512_set1_epi64((long long)b));
  return (vf)_mm512_permutexvar_ps(idx, (__m512)SLUT[s]);
}
#elif defined(__AVX512F__) && !defined(CPU_MOE_PORTABLE)
#include <immintrin.h>
// lanes 0-7 the low nibbles (even elements), 8-15 the high ones (odd elements); vpermps reads the low 4
// bits of each index, so the neighbouring nibble above them needs no masking
static inline vf decode(const uint8_t *p, int s, int q) {
  (void)q;
  __m128i b = _mm_loadl_epi64((const __m128i *)p);
  __m128i c = _mm_unpacklo_epi64(b, _mm_srli_epi16(b, 4));
  return (vf)_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(c), (__m512)SLUT[s]);
}
#elif defined(__AVX2__) && !defined(CPU_MOE_PORTABLE)
#include <immintrin.h>
#define SIGNED_LUT 1
// part 0 the low nibbles (even elements), part 1 the high ones. vpermps indexes 8 entries, so a code's low 3
// bits k pick SLUT8[s][k]; code << 28 puts its bit 3 (the sign: E2M1 codes 8..15 are the negatives of 0..7)
// on bit 31 and k on bits 28-30, where SLUT8[s][k] holds its value's bits xor k, so one xor gives the value
static float SLUT8[2 * MX_ROWS][8] __attribute__((aligned(32)));
static inline vf decode(const uint8_t *p, int s, int q) {
  __m256i i = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));  // shared by the two parts
  if (q) i = _mm256_srli_epi32(i, 4);
  __m256 t = _mm256_permutevar8x32_ps(_mm256_load_ps(SLUT8[s]), i);
  return (vf)_mm256_xor_ps(t, _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)));
}
#else
// portable form, even elements then odd ones (GCC vector extensions; compilers scalarise the widening, so
// it is several times slower)
static inline vf decode(const uint8_t *p, int s, int q) {
  (void)q;
  uint64_t b, nib[2];
  memcpy(&b, p, 8);
  nib[0] = b & 0x0F0F0F0F0F0F0F0FULL;
  nib[1] = (b >> 4) & 0x0F0F0F0F0F0F0F0FULL;
  v16b c;
  memcpy(&c, nib, 16);
  return __builtin_shuffle(SLUT[s], __builtin_convertvector(c, v16i));
}
#endif

static void init_tables(void) {
  for (int b = 0; b < 2 * MX_ROWS; b++) {
    int e = (b >> 3) & 15, m = b & 7;
    float v = e ? ldexpf(1.f + m / 8.f, e - 7) : ldexpf((float)m, -9);
    if ((b & 0x7f) == 0x7f) v = NAN;
    if (b & 0x80) v = -v;
    if (b >= MX_ROWS) v = b - MX_ROWS == 255 ? NAN : ldexpf(1.f, b - MX_ROWS - 127);
    for (int i = 0; i < 16; i++) SLUT[b][i] = E2M1[i] * v;
#ifdef SIGNED_LUT
    for (int k = 0; k < 8; k++) {
      uint32_t u;
      memcpy(&u, &SLUT[b][k], 4);
      u ^= (uint32_t)k << 28;
      memcpy(&SLUT8[b][k], &u, 4);
    }
#endif
  }
}

// one load of x for the R rows of dot_rows (compilers fold the load into each FMA; loads bound the loop)
#if defined(__x86_64__) && defined(__AVX512F__)
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define IN_REGISTER(v) (void)0
#endif

// a * b + c: fused with AVX-512, alike in every copy of the loop (-ffp-contract=off, cpu_moe.py, keeps the
// compiler from fusing any other sum). Unfused, the multiply and the add were two of a group's four uops on
// the two 512-bit ports of Intel's cores: fused, the kernel runs faster there (docs/benchmarks.md)
#if defined(__AVX512F__) && !defined(CPU_MOE_PORTABLE)
#define MADD(a, b, c) ((vf)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c)))
#elif VL == 8 && defined(__FMA__)
#define MADD(a, b, c) ((vf)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

static inline float hsum(vf v) {
  float s = 0;
  for (int i = 0; i < VL; i++) s += v[i];
  return s;
}

// a row and token's dot product from its two accumulators: the even and odd groups' (VL 16), or the groups'
// two parts (VL 8)
static inline float fold(vf a, vf b) { return VL == 16 ? hsum(a + b) : hsum(a) + hsum(b); }

// res[r][t] = row r . xp[t] over G groups for R <= RMAX rows at once (gate and up rows, or down rows, share
// each load of x); xp holds x in decode's order; mx: a UE8M0 scale byte per two groups, else an E4M3 per
// group. Two accumulators per row and token (even and odd groups, or a group's two parts) keep enough FMA
// chains in flight for one token.
static inline __attribute__((always_inline)) void dot_rows(const uint8_t *const *w, const uint8_t *const *s,
                                                          int mx, int R, int G, const float *xp, int stride,
                                                          int T, long ahead, float res[][TMAX]) {
  vf acc[RMAX][TMAX][2];
  for (int r = 0; r < R; r++)
    for (int t = 0; t < T; t++) acc[r][t][0] = acc[r][t][1] = (vf){0};
  for (int g = 0; g < G; g += 2) {
    // every 8 groups a line of each row's codes and scales `ahead` code bytes on: the same row of the next
    // pass (an item's rows are adjacent). From RAM the hardware prefetchers lose the interleaved streams:
    // one thread ~1.7x faster with it
    if ((g & 7) == 0)
      for (int r = 0; r < R; r++) {
        __builtin_prefetch(w[r] + 8 * g + ahead);
        __builtin_prefetch(s[r] + ((g + ahead / 8) >> mx));
      }
    for (int u = 0; u < 2 && g + u < G; u++)
      for (int q = 0; q < PARTS; q++) {
        const int k = PARTS == 1 ? u : q;  // the accumulator
        vf wg[RMAX];
        for (int r = 0; r < R; r++)
          wg[r] = decode(w[r] + 8 * (g + u), (mx * MX_ROWS) | s[r][(g + u) >> mx], q);
        for (int t = 0; t < T; t++) {
          vf x = *(const vfu *)(xp + (size_t)t * stride + 16 * (g + u) + VL * q);
          IN_REGISTER(x);
          for (int r = 0; r < R; r++) acc[r][t][k] = MADD(wg[r], x, acc[r][t][k]);
        }
      }
  }
  for (int r = 0; r < R; r++)
    for (int t = 0; t < T; t++) res[r][t] = fold(acc[r][t][0], acc[r][t][1]);
}

// position of element k of a row in decode's order
static inline int perm(int k) {
#ifdef NATURAL
  return k;
#else
  return (k & ~15) | ((k & 1) << 3) | ((k & 15) >> 1);
#endif
}

typedef struct {
  const uint8_t *const *blocks;  // [n] expert blocks
  const float *ws2;              // [n, 3] global scales (gate, up, down); MXFP4 has none (ones)
  const float *wt;               // [n, T] routing weight of expert e for token t (0: not routed)
  const float *xp;               // [T, H] permuted input
  float *hp;                     // [n, T, I] permuted SwiGLU activations
  float *out;                    // [T, H]
  int n, T, H, I;
  long off[6];  // gate, up, down codes; gate, up, down scales (bytes from block start)
  int mx;       // MXFP4 blocks: a UE8M0 scale per 32 weights (else NVFP4: an E4M3 per 16)
  float limit;  // gate clamped above, up on both sides (DeepSeek-V4's SwiGLU limit); INFINITY: no clamp
  int kind;     // the phase: 0 gate/up rows into hp, 1 down rows into out
  int items;
  int rows_up, rows_down;  // rows an up item and a down item take (item_rows)
  int rescue;   // the caller computes items a parked thread holds (run): the split server's calls
} Job;

// A phase's items are claimed from `claims` (the phase's serial << IDX_BITS | the next item; every open and
// every close takes a new serial, so a thread left behind a closed phase never takes from a later one) and
// computed into the thread's own buffer (Lane), then copied out (publish). In a rescue phase own[i] lets
// only the first thread that computed item i copy it, and only while its phase is open: the caller may
// compute an item a parked thread holds and move on, and what that thread copies later is dropped.
#define IDX_BITS 24
#define CLOSED ((1u << IDX_BITS) - 1)
#define OWN_MAX (1 << 15)  // most items a rescue phase takes (more: the phase waits for its threads)
static _Atomic uint64_t claims, own[OWN_MAX];  // own[i]: serial << 2 | 0 open, 1 being copied, 2 copied
static atomic_int done;                        // items copied out in the open phase
// a thread's own: an item's [T, rows] results before they are copied out, and whether it is a worker (not
// the caller). Passed down by address, read once a phase: in a shared library a TLS access may be a call
typedef struct {
  float buf[TMAX * ROWS_MAX];
  int worker;
} Lane;
static __thread Lane lane;
static atomic_long stall_ns;  // tests: the next item of kind stall_kind a worker computes waits this long
static atomic_int stall_kind;

// Rows an item of a phase takes: the most, from `most` down to `least`, that still leave 4 items a thread
// (`mats` matrices of `rows` rows each). A thread's item is one run of adjacent rows, read as one stream:
// on 2 threads, 10 full-shape experts' up phase took 1.25x less time with 128-row items than with 16-row
// ones, taken alternately by the two threads.
static int item_rows(int mats, int rows, int threads, int least, int most) {
  int r = most;
  while (r > least && (long)mats * ((rows + r - 1) / r) < 4L * threads) r /= 2;
  return r;
}

// rows a pass takes per matrix: P gate and P up rows in up_item, 2P down rows in down_item (T <= 2 keeps the
// 4 rows' accumulators in registers; from RAM 10 % faster than 2 rows at T = 1, 30 % at T = 2). With 8-lane
// parts (AVX2: half AVX-512's registers) one pair
#define PAIRS(T) (PARTS == 1 && (T) <= 2 ? 2 : 1)
// rows one dot_rows call takes: with 8-lane parts and T >= 4, one (two rows' 2 T accumulators each would
// fill AVX2's 16 registers)
#define ROWS_CALL(T) (PARTS == 2 && (T) >= 4 ? 1 : 2 * PAIRS(T))

// a worker in a rescue phase whose items the caller has begun to compute (or one that has closed since):
// it drops its item at the next pass, as a parked thread's stale passes would take a core from the calls
// after it. Read every pass, so a word written only when a rescue begins (own[]'s lines are written by the
// other items' copies all through a phase)
static _Alignas(64) _Atomic uint64_t rescued;  // the last phase whose caller computed items workers held
static inline int left_behind(const Job *j, uint64_t ser, const Lane *me) {
  return me->worker && j->rescue && atomic_load_explicit(&rescued, memory_order_relaxed) >= ser;
}

// an item's [T, len] results from the lane into dst (rows `stride` floats apart); see claims above
static void publish(const Job *j, int item, uint64_t ser, const Lane *me, float *dst, long stride, int len) {
  if (me->worker && atomic_load(&stall_ns) && j->kind == atomic_load(&stall_kind)) {  // computed, not copied
    long ns = atomic_exchange(&stall_ns, 0);
    struct timespec t = {ns / 1000000000, ns % 1000000000};
    if (ns) nanosleep(&t, NULL);
  }
  if (j->rescue) {
    uint64_t want = ser << 2;
    if (!atomic_compare_exchange_strong(&own[item], &want, want | 1)) return;
  }
  for (int t = 0; t < j->T; t++) memcpy(dst + t * stride, me->buf + t * ROWS_MAX, len * sizeof(float));
  if (j->rescue) atomic_store(&own[item], ser << 2 | 2);
  atomic_fetch_add(&done, 1);
}

static inline __attribute__((always_inline)) void up_item(const Job *j, int item, uint64_t ser, Lane *me,
                                                          int T) {
  int rows = j->rows_up, per = (j->I + rows - 1) / rows, e = item / per, r0 = (item % per) * rows;
  int r1 = r0 + rows < j->I ? r0 + rows : j->I, H = j->H, I = j->I, G = H / 16, P = PAIRS(T);
  const uint8_t *b = j->blocks[e];
  float sg = j->mx ? 1.f : j->ws2[3 * e], su = j->mx ? 1.f : j->ws2[3 * e + 1], lim = j->limit;
  float gu[RMAX][TMAX];
  for (int r = r0; r < r1; r += P) {  // gate rows r..r+P-1 and the same up rows in one pass over x
    if (left_behind(j, ser, me)) return;
    const uint8_t *w[RMAX], *s[RMAX];
    for (int k = 0; k < P; k++) {
      w[k] = b + j->off[0] + (size_t)(r + k) * H / 2, s[k] = b + j->off[3] + (size_t)(r + k) * (G >> j->mx);
      w[P + k] = b + j->off[1] + (size_t)(r + k) * H / 2;
      s[P + k] = b + j->off[4] + (size_t)(r + k) * (G >> j->mx);
    }
    for (int k = 0; k < 2 * P; k += ROWS_CALL(T))
      dot_rows(w + k, s + k, j->mx, ROWS_CALL(T), G, j->xp, H, T, (long)P * H / 2, gu + k);
    for (int k = 0; k < P; k++)
      for (int t = 0; t < T; t++) {
        float gg = gu[k][t] * sg, uu = gu[P + k][t] * su;
        gg = gg > lim ? lim : gg;  // NaN stays NaN, as in torch's clamp
        uu = uu > lim ? lim : uu < -lim ? -lim : uu;
        me->buf[t * ROWS_MAX + perm(r + k) - r0] = gg / (1.f + expf(-gg)) * uu;
      }
  }
  publish(j, item, ser, me, j->hp + (size_t)e * T * I + r0, I, r1 - r0);  // perm keeps rows in 16-row groups
}

static inline __attribute__((always_inline)) void down_item(const Job *j, int item, uint64_t ser, Lane *me,
                                                            int T) {
  int r0 = item * j->rows_down, r1 = r0 + j->rows_down < j->H ? r0 + j->rows_down : j->H, I = j->I, G = I / 16;
  int R = ROWS_CALL(T);
  float d[RMAX][TMAX];
  for (int r = r0; r < r1; r += R) {  // rows r..r+R-1 (H is a multiple of 16) in one pass over each h
    if (left_behind(j, ser, me)) return;
    float acc[RMAX][TMAX] = {{0}};
    for (int e = 0; e < j->n; e++) {
      const uint8_t *b = j->blocks[e], *w[RMAX], *s[RMAX];
      for (int k = 0; k < R; k++)
        w[k] = b + j->off[2] + (size_t)(r + k) * I / 2, s[k] = b + j->off[5] + (size_t)(r + k) * (G >> j->mx);
      dot_rows(w, s, j->mx, R, G, j->hp + (size_t)e * T * I, I, T, (long)R * I / 2, d);
      float sd = j->mx ? 1.f : j->ws2[3 * e + 2];
      for (int k = 0; k < R; k++)
        for (int t = 0; t < T; t++) acc[k][t] += j->wt[e * T + t] * sd * d[k][t];
    }
    for (int k = 0; k < R; k++)
      for (int t = 0; t < T; t++) me->buf[t * ROWS_MAX + r + k - r0] = acc[k][t];
  }
  publish(j, item, ser, me, j->out + r0, j->H, r1 - r0);
}

// item i of a phase; T = 1, 2 and 4 get their own copies (accumulators in registers)
#define ITEM(T) (j->kind ? down_item(j, i, ser, me, T) : up_item(j, i, ser, me, T))
static void run_item(const Job *j, int i, uint64_t ser, Lane *me) {
  switch (j->T) {
    case 1: ITEM(1); break;
    case 2: ITEM(2); break;
    case 4: ITEM(4); break;
    default: ITEM(j->T);
  }
}

// The next item of the open phase, and in *s the job as it was when taken: the CAS succeeds only while the
// phase is still open, so the copy holds that phase's fields even where the caller has since rewritten *j
// for a later call (a rescue phase's thread left behind then computes garbage it never copies out, from
// buffers that live as long as the split server). -1 once none is left or the phase *ser closed.
static int claim(const Job *j, Job *s, uint64_t *ser) {
  uint64_t c = atomic_load(&claims);
  for (;;) {
    uint64_t k = c >> IDX_BITS;
    unsigned i = c & CLOSED;
    if ((*ser && k != *ser) || i == CLOSED) return -1;
    *s = *j;
    if (i >= (unsigned)s->items) return -1;
    if (atomic_compare_exchange_weak(&claims, &c, c + 1)) {
      *ser = k;
      return (int)i;
    }
  }
}

// a phase's items, taken one at a time so a thread the scheduler parks holds up at most one item
static void phase(Job *j) {
  Job s;
  uint64_t ser = 0;
  int i;
  Lane *me = &lane;
  while ((i = claim(j, &s, &ser)) >= 0) run_item(&s, i, ser, me);
}

// A persistent pool: the caller plus workers 0..active-1 run `fn` on a phase's items; idle workers spin for
// `spin_ns` (pool_spin), then sleep: a call within that time after the last finds them running, a later one
// wakes them through the condition variable (tens of microseconds until all run). A worker a phase does not
// take (the pool was made for more threads than the calls now take) sleeps through it instead of spinning:
// it would hold a core the caller's other threads (the decode thread, the driver's) need. The
// caller waits only for the items workers took (run_phase; one that wakes after the items are gone finds
// the phase closed), so a worker the scheduler has not run yet costs the call nothing.
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t go = PTHREAD_COND_INITIALIZER;
static atomic_ulong gen, open_gen;  // gen: phases published; open_gen: the phase workers may join (0: none)
static atomic_int inside, asleep[MAXTH];
static atomic_int active;
static int workers;
static void (*_Atomic job_fn)(Job *);  // read by a worker before it checks its phase is still open
static Job *_Atomic job_arg;

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

static atomic_long spin_ns = 500000;  // a pause's length varies ~10x across CPUs: the spin is timed

static inline long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000L + t.tv_nsec;
}

// how long idle workers spin before they sleep; returns the previous value (ns)
long pool_spin(long ns) { return atomic_exchange(&spin_ns, ns < 0 ? 0 : ns); }

// tests: the next item of a phase of `kind` (0 gate/up, 1 down) a worker (not the caller) computes waits
// `ns` before it copies its rows out, as a thread the scheduler parks mid-item does; returns the stall still
// pending before this call
long pool_stall(long ns, int kind) {
  atomic_store(&stall_kind, kind);
  return atomic_exchange(&stall_ns, ns);
}

static unsigned long born[MAXTH];  // gen when worker i was made: a job published before it runs is its first

static void *worker(void *arg) {
  int id = (int)(intptr_t)arg;
  unsigned long seen = born[id];
  lane.worker = 1;
  // it spins after its first phase and after each it took part in; after one it did not, it sleeps at once
  for (int wanted = 1;; wanted = id < atomic_load(&active)) {
    long until = now_ns() + atomic_load(&spin_ns);
    for (unsigned spin = 1; wanted && atomic_load(&gen) == seen; spin++) {
      relax();
      if ((spin & 63) == 0 && now_ns() > until) break;  // the clock read costs ~ one pause
    }
    if (atomic_load(&gen) == seen || id >= atomic_load(&active)) {  // asleep until a phase that takes it
      pthread_mutex_lock(&mu);
      atomic_store(&asleep[id], 1);
      while (atomic_load(&gen) == seen || id >= atomic_load(&active)) pthread_cond_wait(&go, &mu);
      atomic_store(&asleep[id], 0);
      pthread_mutex_unlock(&mu);
    }
    seen = atomic_load(&gen);
    atomic_fetch_add(&inside, 1);
    void (*fn)(Job *) = atomic_load(&job_fn);  // set before the phase opened, rewritten only after it closed
    Job *j = atomic_load(&job_arg);
    if (atomic_load(&open_gen) == seen && id < atomic_load(&active)) fn(j);
    atomic_fetch_sub(&inside, 1);
  }
  return NULL;
}

static void run(void (*fn)(Job *), Job *j, int threads) {
  int extra = threads - 1;
  if (extra > MAXTH) extra = MAXTH;
  while (workers < extra) {
    pthread_t t;
    born[workers] = atomic_load(&gen);
    if (pthread_create(&t, NULL, worker, (void *)(intptr_t)workers)) break;
    pthread_detach(t);
    workers++;
  }
  if (extra > workers) extra = workers;
  if (extra > 0) {
    atomic_store(&job_fn, fn), atomic_store(&job_arg, j);
    atomic_store(&active, extra);
    atomic_store(&open_gen, atomic_fetch_add(&gen, 1) + 1);
    for (int i = 0; i < extra; i++)  // a worker this phase takes is asleep: wake them
      if (atomic_load(&asleep[i])) {
        pthread_mutex_lock(&mu);
        pthread_cond_broadcast(&go);
        pthread_mutex_unlock(&mu);
        break;
      }
  }
  fn(j);
  if (extra > 0) atomic_store(&open_gen, 0);  // no items left: a worker that wakes now joins no phase
}

// until no worker is inside a phase (reading the caller's job or buffers)
static void wait_inside(void) {
  for (int spin = 0; atomic_load(&inside); spin++) {
    if (spin < 20000) relax();
    else sched_yield();
  }
}

static uint64_t serial;  // the last phase's (taken under call_mu)

// A phase's items on `threads` threads, *j (static: a thread may read it after the call) written for it
// (kind, items). The caller takes items as the workers do, then waits until every item is copied out; in a
// rescue phase, once none is left to take and half as long again as its own share took has passed, it first
// computes every item still not copied out itself (a thread parked mid-item holds one for a scheduler slice,
// milliseconds). Threads still inside then read only *j and `claims` (their claims fail: closed), or, left
// behind a rescue phase, compute what they will not copy out.
static void run_phase(Job *j, int threads) {
  long t_open = now_ns();
  uint64_t ser = ++serial;
  if (j->rescue && j->items > OWN_MAX) j->rescue = 0;
  if (j->rescue)
    for (int i = 0; i < j->items; i++) atomic_store_explicit(&own[i], ser << 2, memory_order_relaxed);
  atomic_store(&done, 0);
  atomic_store(&claims, ser << IDX_BITS);
  run(phase, j, threads);
  if (j->rescue) {
    long t_out = now_ns(), until = t_out + (t_out - t_open) / 2;
    while (atomic_load(&done) < j->items && now_ns() < until) relax();
    if (atomic_load(&done) < j->items) {
      atomic_store(&rescued, ser);
      for (int i = 0; i < j->items && atomic_load(&done) < j->items; i++)
        if (atomic_load(&own[i]) == ser << 2) run_item(j, i, ser, &lane);
    }
  }
  while (atomic_load(&done) < j->items) relax();  // the last copies (a rescued item's: being copied)
  atomic_store(&claims, (++serial << IDX_BITS) | CLOSED);
}

static pthread_once_t once = PTHREAD_ONCE_INIT;
// one call at a time holds the pool: the exported entry points and the split server (below) take it
static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER;

// x [T, H] -> out [T, H]; hp: scratch [n, T, I] + [T, H] floats; lay: the 6 offsets (Job.off), then 1 for
// MXFP4 blocks (0: NVFP4); limit: Job.limit; the phases' job in *j
static int moe_cpu(Job *j, const uint8_t *const *blocks, const float *ws2, const float *wt, const float *x,
                   float *out, float *scratch, int n, int T, int H, int I, const long *lay, float limit,
                   int threads, int rescue) {
  int mx = lay[6] != 0, g = 16 << mx;
  if (T < 1 || T > TMAX || H % g || I % g || limit != limit) return 1;
  pthread_once(&once, init_tables);
  float *xp = scratch + (size_t)n * T * I;
  for (int t = 0; t < T; t++)
    for (int k = 0; k < H; k++) xp[(size_t)t * H + perm(k)] = x[(size_t)t * H + k];
  *j = (Job){.blocks = blocks, .ws2 = ws2, .wt = wt, .xp = xp, .hp = scratch, .out = out, .n = n, .T = T,
             .H = H, .I = I, .mx = mx, .limit = limit, .rescue = rescue};
  memcpy(j->off, lay, sizeof j->off);
  j->rows_up = item_rows(n, I, threads, ROWS_UP, ROWS_UP_MAX);
  j->items = n * ((I + j->rows_up - 1) / j->rows_up);
  run_phase(j, threads);
  j->kind = 1;
  j->rows_down = item_rows(1, H, threads, ROWS_DOWN, ROWS_DOWN_MAX);
  j->items = (H + j->rows_down - 1) / j->rows_down;
  run_phase(j, threads);
  return 0;
}

// One token's experts from a layer's tables, as the split server (below) gets a request from the GPU:
// packed = [n] expert ids (as floats), [n] routing weights, [H] x; addr [E] each block's
// address, ws2 [E, 3] the layer's global scales. Gathers the n blocks and scales, then runs the kernel's
// phases as rescue phases: the job and its tables are static, every pointer in them into the server's
// buffers or the RAM cache, which outlive any thread left behind (serve_stop waits for those).
static int moe_packed(const long *addr, const float *ws2, const float *packed, float *out, float *scratch, int n,
                      int E, int H, int I, const long *lay, float limit, int threads) {
  static const uint8_t *blocks[NMAX];
  static float w[3 * NMAX];
  static Job job;
  if (n < 1 || n > NMAX) return 1;
  for (int j = 0; j < n; j++) {
    long e = (long)packed[j];
    if (e < 0 || e >= E || (float)e != packed[j]) return 2;
    blocks[j] = (const uint8_t *)addr[e];
    memcpy(w + 3 * j, ws2 + 3 * e, 3 * sizeof(float));
  }
  return moe_cpu(&job, blocks, w, packed + n, packed + 2 * n, out, scratch, n, 1, H, I, lay, limit, threads,
                 1);
}

int fp4_moe_cpu(const uint8_t *const *blocks, const float *ws2, const float *wt, const float *x, float *out,
                float *scratch, int n, int T, int H, int I, const long *lay, float limit, int threads) {
  static Job job;  // a worker may still read it once the call returns (run_phase)
  pthread_mutex_lock(&call_mu);
  int rc = moe_cpu(&job, blocks, ws2, wt, x, out, scratch, n, T, H, I, lay, limit, threads, 0);
  pthread_mutex_unlock(&call_mu);
  return rc;
}


// bytes/s of a read-only sweep over buf ([n] floats) on `threads` threads: the memory rate the kernel meets
static const float *bw_buf;
static long bw_n;
static float bw_sink[MAXTH + 1];
static atomic_int bw_next;
static void bw_phase(Job *unused) {
  (void)unused;
  int i;
  long chunk = 1 << 16;
  vf acc = {0};
  while ((i = atomic_fetch_add(&bw_next, 1)) * chunk < bw_n) {
    long a = i * chunk, b = a + chunk < bw_n ? a + chunk : bw_n;
    for (long k = a; k + VL <= b; k += VL) acc += *(const vfu *)(bw_buf + k);
  }
  bw_sink[0] += hsum(acc);
}

float read_sweep(const float *buf, long n, int threads) {
  pthread_mutex_lock(&call_mu);
  bw_buf = buf, bw_n = n;
  atomic_store(&bw_next, 0);
  run(bw_phase, NULL, threads);
  wait_inside();
  float sink = bw_sink[0];
  pthread_mutex_unlock(&call_mu);
  return sink;
}

// The split server: a thread that answers the CPU share of split decode layers the GPU posts into a pinned
// mailbox (kernels/mailbox.py), so that no host call sits between a layer's GPU work and its CPU work. The
// GPU writes a request's ids, weights and x into `packed`, then box[LAYER], box[NREQ] and, after a
// system-scope fence, box[REQ] = a new sequence number; the server computes that layer's n experts from its
// tables into `out` and sets box[DONE] to the number (box[ERR] to the kernel's code and `out` to NaN where it
// refused the request). Idle, it spins for `idle_ns`, then sleeps until armed (once a token, `serve_arm`) or
// for 1 ms at most.
enum { REQ = 0, LAYER = 1, NREQ = 2, DONE = 16, ERR = 17 };
#define LOGN 4096  // the last calls' kernel times kept (serve_log)

static struct {
  const long *addr;  // [L, E] each block's address
  const float *ws2;  // [L, E, 3]
  const float *packed;
  float *out, *scratch;
  volatile int32_t *box;
  int L, E, H, I;
  int32_t first;  // box[REQ] at the start: requests after it are the server's
  long lay[7], idle_ns;
  float limit;
  atomic_int threads, stop, running;
  atomic_ulong armed;
  pthread_t tid;
  pthread_mutex_t mu;  // stats and sleep
  pthread_cond_t wake;
  long calls, kernel_ns, log[LOGN];
} srv = {.mu = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

static void *serve(void *unused) {
  (void)unused;
  int32_t seen = srv.first;
  while (!atomic_load(&srv.stop)) {
    long until = now_ns() + srv.idle_ns;
    unsigned long armed = atomic_load(&srv.armed);
    for (unsigned spin = 1; __atomic_load_n(&srv.box[REQ], __ATOMIC_ACQUIRE) == seen; spin++) {
      relax();
      if (spin & 63) continue;
      if (atomic_load(&srv.stop)) return NULL;
      if (now_ns() < until) continue;
      pthread_mutex_lock(&srv.mu);  // asleep until armed, for 1 ms at most (an arm that came too early)
      if (atomic_load(&srv.armed) == armed && !atomic_load(&srv.stop)) {
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        t.tv_nsec += 1000000;
        if (t.tv_nsec >= 1000000000) t.tv_sec++, t.tv_nsec -= 1000000000;
        pthread_cond_timedwait(&srv.wake, &srv.mu, &t);
      }
      pthread_mutex_unlock(&srv.mu);
      until = now_ns() + srv.idle_ns;
      armed = atomic_load(&srv.armed);
    }
    seen = __atomic_load_n(&srv.box[REQ], __ATOMIC_ACQUIRE);
    int layer = srv.box[LAYER], n = srv.box[NREQ], rc = 3;
    long t0 = now_ns();
    pthread_mutex_lock(&call_mu);
    if (layer >= 0 && layer < srv.L)
      rc = moe_packed(srv.addr + (size_t)layer * srv.E, srv.ws2 + (size_t)layer * srv.E * 3, srv.packed, srv.out,
                      srv.scratch, n, srv.E, srv.H, srv.I, srv.lay, srv.limit, atomic_load(&srv.threads));
    pthread_mutex_unlock(&call_mu);
    if (rc) {
      for (int k = 0; k < srv.H; k++) srv.out[k] = NAN;
      srv.box[ERR] = rc;
    }
    long dt = now_ns() - t0;
    __atomic_store_n(&srv.box[DONE], seen, __ATOMIC_RELEASE);
    pthread_mutex_lock(&srv.mu);
    srv.log[srv.calls % LOGN] = dt;
    srv.calls++, srv.kernel_ns += dt;
    pthread_mutex_unlock(&srv.mu);
  }
  return NULL;
}

// start the server on a layer table: addr [L, E], ws2 [L, E, 3], packed [2 NMAX + H] floats or more, out
// [H], scratch for NMAX experts, box [32] int32 (pinned: the GPU reads and writes it), lay and limit as
// moe_cpu's; 1 if one runs
int serve_start(const long *addr, const float *ws2, const float *packed, float *out, float *scratch,
                volatile int32_t *box, int L, int E, int H, int I, const long *lay, float limit, int threads,
                long idle_ns) {
  if (atomic_load(&srv.running)) return 1;
  pthread_once(&once, init_tables);
  srv.addr = addr, srv.ws2 = ws2, srv.packed = packed, srv.out = out, srv.scratch = scratch, srv.box = box;
  srv.L = L, srv.E = E, srv.H = H, srv.I = I, srv.idle_ns = idle_ns;
  memcpy(srv.lay, lay, sizeof srv.lay);
  srv.limit = limit;
  atomic_store(&srv.threads, threads < 1 ? 1 : threads);
  atomic_store(&srv.stop, 0);
  srv.calls = srv.kernel_ns = 0;
  srv.first = __atomic_load_n(&box[REQ], __ATOMIC_ACQUIRE);
  if (pthread_create(&srv.tid, NULL, serve, NULL)) return 2;
  atomic_store(&srv.running, 1);
  return 0;
}

// a token's requests are coming: wake the server if it sleeps, on `threads` threads from now
void serve_arm(int threads) {
  atomic_store(&srv.threads, threads < 1 ? 1 : threads);
  pthread_mutex_lock(&srv.mu);
  atomic_fetch_add(&srv.armed, 1);
  pthread_cond_signal(&srv.wake);
  pthread_mutex_unlock(&srv.mu);
}

// stop and join the server (the GPU posts nothing more); returns 0 if none ran
int serve_stop(void) {
  if (!atomic_load(&srv.running)) return 0;
  atomic_store(&srv.stop, 1);
  serve_arm(atomic_load(&srv.threads));
  pthread_join(srv.tid, NULL);
  pthread_mutex_lock(&call_mu);
  wait_inside();  // a thread left behind a rescue phase reads the buffers the caller frees next
  pthread_mutex_unlock(&call_mu);
  atomic_store(&srv.running, 0);
  return 1;
}

// calls answered so far; their kernel ns summed into *kernel_ns, the last min(calls, max, LOGN) in dst
long serve_stats(long *kernel_ns, long *dst, int max) {
  pthread_mutex_lock(&srv.mu);
  long calls = srv.calls, k = calls < max ? calls : max;
  if (k > LOGN) k = LOGN;
  for (long i = 0; i < k; i++) dst[i] = srv.log[(calls - k + i) % LOGN];
  *kernel_ns = srv.kernel_ns;
  pthread_mutex_unlock(&srv.mu);
  return calls;
}

// a mailbox word as the host twins of the GPU's side write and read it (kernels/mailbox.py)
void box_put(volatile int32_t *p, int32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
int32_t box_get(volatile int32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
