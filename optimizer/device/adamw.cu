// Sonar-MoE AdamW kernels, compiled at run time by NVRTC (optimizer/device/kernels.go).
//
// One launch updates a batch of tensors (multi-tensor, as torch's foreach
// kernels do): the kernel parameter is a SonarBatch of up to
// SONAR_MAX_TENSORS tensor descriptors, each with its own device pointers
// and per-step scalars. Tensors are cut into chunks of SONAR_CHUNK elements;
// blocks walk the chunks of all tensors with a grid-stride loop.
//
// Arithmetic: element for element what torch.optim.AdamW does on CUDA by
// default (torch/optim/adam.py, _multi_tensor_adam, decoupled weight decay),
// one foreach op after the other, each computed in float32 ("opmath") and
// rounded to the tensor's dtype:
//
//   _foreach_mul_(params, 1 - lr*wd)                 p = R(p * decay)
//   _foreach_lerp_(exp_avgs, grads, 1 - beta1)        m = R(lerp(m, g, w))
//   _foreach_mul_(exp_avg_sqs, beta2)                 v = R(v * beta2)
//   _foreach_addcmul_(exp_avg_sqs, g, g, 1 - beta2)   v = R(fma(1-beta2, g*g, v))
//   [amsgrad] _foreach_maximum_(max_exp_avg_sqs, v)   vmax = maximum(vmax, v)
//   _foreach_sqrt(exp_avg_sqs)                        d = R(sqrt(v))
//   _foreach_div_(d, bias_correction2_sqrt)           d = R(d / bc2_sqrt)
//   _foreach_add_(d, eps)                             d = R(d + eps)
//   _foreach_addcdiv_(params, exp_avgs, d, -step)     p = R(fma(-step, m / d, p))
//
// where lerp is ATen's (|w| < 0.5 ? fma(w, g - m, m) : fma(-(g - m), 1 - w, g)),
// addcmul/addcdiv are ATen's pointwise_op_impl (value == 1: fma(g, g, v) and
// p + m/d), the scalars are the Python floats rounded to float32, and R is
// the identity for float32 and round-to-nearest-even to bfloat16. Every
// operation is written with an explicit IEEE intrinsic (the _rn forms are
// never contracted, whatever --fmad says), so what is fused and what is
// rounded is exactly what this file says. The module is compiled with
// nvcc's default --fmad=true, as torch is, for the one thing it changes:
// libdevice's pow, which the fused kernels call. docs/gpu.md
// lists which of these facts were read from torch's sources and which are
// only confirmed by the GPU check.
//
// The sonar_fused_adamw_* kernels are torch.optim.AdamW(fused=True) on CUDA
// instead (sonar_fused_element below): every quantity in float, one
// rounding per stored value, the bias corrections computed on the device
// with CUDA's powf as torch's kernel does (torch >= 2.11); sonar_fused64_*
// are the same kernel of torch 2.8 to 2.10, which computes partly in double.

// BEGIN LAYOUT (kept in sync with optimizer/device/kernels.go; a test compiles this block
// with the host C compiler and compares offsetof/sizeof)
#define SONAR_MAX_TENSORS 44
#define SONAR_CHUNK 65536
#define SONAR_FLAG_DECAY 1u
#define SONAR_FLAG_AMSGRAD 2u
#define SONAR_FLAG_MAXIMIZE 4u

typedef struct {
  unsigned long long param;          // in/out; sonar_add_*: the accumulation buffer
  unsigned long long grad;           // in;     sonar_add_*: the gradient added
  unsigned long long exp_avg;        // in/out
  unsigned long long exp_avg_sq;     // in/out
  unsigned long long max_exp_avg_sq; // in/out, amsgrad only (else 0)
  long long numel;
  unsigned long long first_chunk;    // chunks of the tensors before this one
  float decay;                       // 1 - lr*weight_decay
  float beta1_w;                     // 1 - beta1 (lerp weight)
  float beta2;
  float one_minus_beta2;             // addcmul value
  float neg_step_size;               // -lr / (1 - beta1**step) (addcdiv value)
  float bc2_sqrt;                    // (1 - beta2**step) ** 0.5
  float eps;
  unsigned int flags;                // SONAR_FLAG_*
} SonarTensor;

typedef struct {
  SonarTensor t[SONAR_MAX_TENSORS];
  unsigned int n;                    // tensors in t
  unsigned int reserved;
  unsigned long long total_chunks;   // chunks of all n tensors
} SonarBatch;

// The fused kernels' descriptor: the same pointers, sizes and flags as
// SonarTensor, but the hyper-parameters as torch's fused CUDA kernel
// receives them (each cast from the Python float to float once, as
// static_cast<opmath_t>) and the step count, from which the kernel derives
// its per-step constants itself, as torch's does.
typedef struct {
  unsigned long long param;
  unsigned long long grad;
  unsigned long long exp_avg;
  unsigned long long exp_avg_sq;
  unsigned long long max_exp_avg_sq;
  long long numel;
  unsigned long long first_chunk;
  float lr;
  float beta1;
  float beta2;
  float weight_decay;
  float eps;
  float step;                        // the step count after this update (torch's float state_step)
  float reserved;
  unsigned int flags;                // SONAR_FLAG_*; DECAY when (float)weight_decay != 0
} SonarFusedTensor;

typedef struct {
  SonarFusedTensor t[SONAR_MAX_TENSORS];
  unsigned int n;
  unsigned int reserved;
  unsigned long long total_chunks;
} SonarFusedBatch;

// The descriptor of the fused kernels of torch 2.8 to 2.10 (sonar_fused64_*),
// whose arithmetic uses the hyper-parameters as doubles: they travel as the
// Python floats themselves. Larger, so fewer fit in one launch.
#define SONAR_MAX_FUSED64 39
typedef struct {
  unsigned long long param;
  unsigned long long grad;
  unsigned long long exp_avg;
  unsigned long long exp_avg_sq;
  unsigned long long max_exp_avg_sq;
  long long numel;
  unsigned long long first_chunk;
  double lr;
  double beta1;
  double beta2;
  double weight_decay;
  double eps;
  float step;                        // the step count after this update
  unsigned int flags;                // SONAR_FLAG_*; DECAY when weight_decay != 0
} SonarFused64Tensor;

typedef struct {
  SonarFused64Tensor t[SONAR_MAX_FUSED64];
  unsigned int n;
  unsigned int reserved;
  unsigned long long total_chunks;
} SonarFused64Batch;
// END LAYOUT

// BEGIN MATH (also compiled for the host by a test, with fmaf/sqrtf)
#if defined(__CUDACC__)
#define SONAR_HD __device__ __forceinline__
#define S_ADD(a, b) __fadd_rn((a), (b))
#define S_SUB(a, b) __fsub_rn((a), (b))
#define S_MUL(a, b) __fmul_rn((a), (b))
#define S_DIV(a, b) __fdiv_rn((a), (b))
#define S_FMA(a, b, c) __fmaf_rn((a), (b), (c))
#define S_SQRT(a) __fsqrt_rn(a)
#define S_ABS(a) fabsf(a)
#define D_ADD(a, b) __dadd_rn((a), (b))
#define D_SUB(a, b) __dsub_rn((a), (b))
#define D_MUL(a, b) __dmul_rn((a), (b))
#define D_DIV(a, b) __ddiv_rn((a), (b))
#define D_FMA(a, b, c) __fma_rn((a), (b), (c))
#define D_SQRT(a) __dsqrt_rn(a)
#define D2F(a) __double2float_rn(a)
SONAR_HD unsigned int sonar_f2u(float f) { return __float_as_uint(f); }
SONAR_HD float sonar_u2f(unsigned int u) { return __uint_as_float(u); }
#else
#define SONAR_HD inline
#define S_ADD(a, b) ((float)((a) + (b)))
#define S_SUB(a, b) ((float)((a) - (b)))
#define S_MUL(a, b) ((float)((a) * (b)))
#define S_DIV(a, b) ((float)((a) / (b)))
#define S_FMA(a, b, c) fmaf((a), (b), (c))
#define S_SQRT(a) sqrtf(a)
#define S_ABS(a) fabsf(a)
#define D_ADD(a, b) ((double)((a) + (b)))
#define D_SUB(a, b) ((double)((a) - (b)))
#define D_MUL(a, b) ((double)((a) * (b)))
#define D_DIV(a, b) ((double)((a) / (b)))
#define D_FMA(a, b, c) fma((a), (b), (c))
#define D_SQRT(a) sqrt(a)
#define D2F(a) ((float)(a))
SONAR_HD unsigned int sonar_f2u(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
SONAR_HD float sonar_u2f(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
#endif

SONAR_HD float sonar_bf16_to_f32(unsigned short h) { return sonar_u2f(((unsigned int)h) << 16); }

// c10::BFloat16(float): on sm_80 and newer __float2bfloat16, i.e.
// cvt.rn.bf16.f32 (NaN becomes 0x7FFF); elsewhere round-to-nearest-even in
// integer arithmetic with NaN as 0x7FC0.
SONAR_HD unsigned short sonar_f32_to_bf16(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned short r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
#else
  unsigned int u = sonar_f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0u;
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}

// Storage types: how a value of the tensor's dtype becomes float and back.
struct SonarF32 {
  typedef float T;
  static SONAR_HD float get(T x) { return x; }
  static SONAR_HD T put(float x) { return x; }
};
struct SonarBF16 {
  typedef unsigned short T;
  static SONAR_HD float get(T x) { return sonar_bf16_to_f32(x); }
  static SONAR_HD T put(float x) { return sonar_f32_to_bf16(x); }
};

// One element's AdamW step. p, m, v, vmax hold the stored values (as float)
// and receive the new ones; g is the stored gradient. Each R(.) below is a
// foreach op's final rounding to the storage type.
template <class S>
SONAR_HD void sonar_adamw_element(float& p, float g, float& m, float& v, float& vmax, const SonarTensor& t) {
#define R(x) S::get(S::put(x))
  if (t.flags & SONAR_FLAG_MAXIMIZE) g = -g;  // _foreach_neg: exact
  if (t.flags & SONAR_FLAG_DECAY) p = R(S_MUL(p, t.decay));
  {  // _foreach_lerp_(exp_avgs, grads, weight): ATen's lerp
    const float w = t.beta1_w;
    const float d = S_SUB(g, m);
    m = R(S_ABS(w) < 0.5f ? S_FMA(w, d, m) : S_FMA(-d, S_SUB(1.0f, w), g));
  }
  v = R(S_MUL(v, t.beta2));
  {  // _foreach_addcmul_: pointwise_op_impl(v, g, g, value, multiplies)
    const float a = t.one_minus_beta2;
    v = R(a == 1.0f ? S_FMA(g, g, v) : S_FMA(a, S_MUL(g, g), v));
  }
  float src = v;
  if (t.flags & SONAR_FLAG_AMSGRAD) {  // ATen's foreach maximum: NaN wins
    vmax = (vmax != vmax || vmax > v) ? vmax : v;
    src = vmax;
  }
  float d = R(S_SQRT(src));
  d = R(S_DIV(d, t.bc2_sqrt));
  d = R(S_ADD(d, t.eps));
  {  // _foreach_addcdiv_: pointwise_op_impl(p, m, d, value, divides)
    const float q = S_DIV(m, d);
    const float a = t.neg_step_size;
    p = R(a == 1.0f ? S_ADD(p, q) : S_FMA(a, q, p));
  }
#undef R
}

// Gradient accumulation, as autograd's `grad += new_grad` (add with alpha 1).
template <class S>
SONAR_HD float sonar_add_element(float acc, float g) {
  return S::get(S::put(S_ADD(acc, g)));
}

// torch's fused CUDA AdamW (AdamW(fused=True): fused_adam_utils.cuh,
// FusedAdamMathFunctor and adam_math, ADAMW mode, torch 2.11), everything
// in float ("opmath"). Its per-tensor constants, from the hyper-parameters
// cast to float and the two bias corrections bc1 = 1 - powf(beta1, step),
// bc2 = 1 - powf(beta2, step) (computed on the device: sonar_fused_batch):
typedef struct {
  float lrwd;       // lr * weight_decay, rounded (the decay's product)
  float beta1, beta2, eps;
  float step_size;  // lr / bc1
  float bc2_sqrt;   // sqrtf(bc2)
} SonarFusedConsts;

SONAR_HD SonarFusedConsts sonar_fused_consts(const SonarFusedTensor& t, float bc1, float bc2) {
  SonarFusedConsts c;
  c.lrwd = S_MUL(t.lr, t.weight_decay);
  c.beta1 = t.beta1;
  c.beta2 = t.beta2;
  c.eps = t.eps;
  c.step_size = S_DIV(t.lr, bc1);
  c.bc2_sqrt = S_SQRT(bc2);
  return c;
}

// One element of torch's fused step, in float; the caller rounds each
// stored value to the storage type once (bfloat16: one rounding per buffer,
// the float values feed the rest of the step). What nvcc contracts in torch's
// source is written here as the FMA it became (docs/gpu.md):
//   param -= lr * weight_decay * param              p = fma(-lrwd, p, p)
//   exp_avg = fma(beta1, exp_avg, fma(-beta1, g, g))          (explicit in torch)
//   exp_avg_sq = fma(beta2, v, fma(-beta2, g*g, g*g))         (explicit in torch)
//   max_exp_avg_sq = std::max(max_exp_avg_sq, exp_avg_sq)    (vmax < v ? v : vmax)
//   denom = (sqrt(x) / bias_correction2_sqrt) + eps           three roundings
//   param -= step_size * exp_avg / denom                      three roundings
SONAR_HD void sonar_fused_element(float& p, float g, float& m, float& v, float& vmax, const SonarFusedConsts& c,
                                  unsigned int flags) {
  if (flags & SONAR_FLAG_MAXIMIZE) g = -g;
  if (flags & SONAR_FLAG_DECAY) p = S_FMA(-c.lrwd, p, p);
  m = S_FMA(c.beta1, m, S_FMA(-c.beta1, g, g));
  const float gg = S_MUL(g, g);
  v = S_FMA(c.beta2, v, S_FMA(-c.beta2, gg, gg));
  float x = v;
  if (flags & SONAR_FLAG_AMSGRAD) {  // std::max(vmax, v): a NaN in vmax stays, a NaN in v does not enter
    vmax = (vmax < v) ? v : vmax;
    x = vmax;
  }
  const float den = S_ADD(S_DIV(S_SQRT(x), c.bc2_sqrt), c.eps);
  p = S_SUB(p, S_DIV(S_MUL(c.step_size, m), den));
}

// torch 2.8 to 2.10's fused CUDA AdamW: the same kernel in its earlier form,
// which takes lr, beta1, beta2, weight_decay and eps as double and evaluates
// the decay and both moving averages in double (each rounded to float where
// assigned), the bias corrections in double (1 - pow(beta, (double)step)),
// cast to float as the functor passes them on; read from the compiled
// kernels (docs/gpu.md). bc1 and bc2 are those doubles.
typedef struct {
  double lrwd;            // lr * weight_decay
  double beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  float step_size;        // (float)(lr / (double)(float)bc1)
  float bc2_sqrt;         // (float)sqrt(bc2)
} SonarFused64Consts;

SONAR_HD SonarFused64Consts sonar_fused64_consts(const SonarFused64Tensor& t, double bc1, double bc2) {
  SonarFused64Consts c;
  c.lrwd = D_MUL(t.lr, t.weight_decay);
  c.beta1 = t.beta1;
  c.one_minus_beta1 = D_SUB(1.0, t.beta1);
  c.beta2 = t.beta2;
  c.one_minus_beta2 = D_SUB(1.0, t.beta2);
  c.eps = t.eps;
  c.step_size = D2F(D_DIV(t.lr, (double)D2F(bc1)));
  c.bc2_sqrt = D2F(D_SQRT(bc2));
  return c;
}

// One element in that arithmetic (float values in and out; the caller
// rounds each stored value to the storage type once). nvcc fused the first
// product of each `beta*x + (1-beta)*...` with the sum and the decay's
// `param - (lr*wd)*param`, in double.
SONAR_HD void sonar_fused64_element(float& p, float g, float& m, float& v, float& vmax, const SonarFused64Consts& c,
                                    unsigned int flags) {
  if (flags & SONAR_FLAG_MAXIMIZE) g = -g;
  const double gd = (double)g;
  if (flags & SONAR_FLAG_DECAY) p = D2F(D_FMA(-c.lrwd, (double)p, (double)p));
  m = D2F(D_FMA((double)m, c.beta1, D_MUL(gd, c.one_minus_beta1)));
  v = D2F(D_FMA((double)v, c.beta2, D_MUL(gd, D_MUL(gd, c.one_minus_beta2))));
  float x = v;
  if (flags & SONAR_FLAG_AMSGRAD) {  // std::max(vmax, v), in float
    vmax = (vmax < v) ? v : vmax;
    x = vmax;
  }
  const float den = D2F(D_ADD((double)S_DIV(S_SQRT(x), c.bc2_sqrt), c.eps));
  p = S_SUB(p, S_DIV(S_MUL(c.step_size, m), den));
}
// END MATH

// BEGIN LOOPS (also compiled for the host by a test, which runs every thread
// of every block of a launch in turn: TestHostLaunches)
//
// How a launch walks its batch. Tensors are cut into chunks of SONAR_CHUNK
// elements; blocks take the chunks of all tensors with a grid-stride loop.
// Within a chunk, where every array of the tensor starts on a 16-byte
// boundary (as the caching allocator's blocks and sonard's state do), the
// threads of a block take consecutive 16-byte pieces of each array, loaded
// and stored with one 128-bit access each (4 float32 or 8 bfloat16 values
// a thread and array), and the chunk's last elements past the last whole
// piece go one per thread; otherwise every element goes one per thread. An
// element's arithmetic is the same function either way. Compiled with
// -DSONAR_VEC=0 (sonard --cuda-loads scalar), every element goes one per
// thread: the kernels as first checked on a GPU.
#ifndef SONAR_VEC
#define SONAR_VEC 1
#endif
#define SONAR_THREADS 256
#define SONAR_PIECE 16

#if !defined(__CUDACC__)
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
#define SONAR_UNROLL
#else
#define SONAR_UNROLL _Pragma("unroll")
#endif

// One 16-byte piece of an array as four 32-bit words, loaded or stored with
// one 128-bit access; its elements are read and written with shifts
// (SonarLane), little-endian as host and device are: no type punning.
typedef struct {
  unsigned int w[4];
} SonarPiece;

SONAR_HD void sonar_load(SonarPiece& p, const void* a) {
  const uint4 u = *(const uint4*)a;
  p.w[0] = u.x;
  p.w[1] = u.y;
  p.w[2] = u.z;
  p.w[3] = u.w;
}

SONAR_HD void sonar_store(void* a, const SonarPiece& p) {
  uint4 u;
  u.x = p.w[0];
  u.y = p.w[1];
  u.z = p.w[2];
  u.w = p.w[3];
  *(uint4*)a = u;
}

// Element i of a piece of storage type T.
template <class T>
struct SonarLane;
template <>
struct SonarLane<float> {
  static SONAR_HD float get(const SonarPiece& p, int i) { return sonar_u2f(p.w[i]); }
  static SONAR_HD void set(SonarPiece& p, int i, float x) { p.w[i] = sonar_f2u(x); }
};
template <>
struct SonarLane<unsigned short> {
  static SONAR_HD unsigned short get(const SonarPiece& p, int i) {
    return (unsigned short)(p.w[i >> 1] >> ((i & 1) * 16));
  }
  static SONAR_HD void set(SonarPiece& p, int i, unsigned short x) {
    const int s = (i & 1) * 16;
    p.w[i >> 1] = (p.w[i >> 1] & ~(0xffffu << s)) | ((unsigned int)x << s);
  }
};

// Where a thread of a launch is: its block, the grid's blocks, its thread
// in the block.
typedef struct {
  unsigned long long block, blocks;
  unsigned int thread;
} SonarGrid;

SONAR_HD bool sonar_piece_aligned(unsigned long long p) { return (p & (SONAR_PIECE - 1)) == 0; }

// The tensor that chunk c belongs to: the last with first_chunk <= c.
template <class B>
SONAR_HD unsigned int sonar_find(const B& b, unsigned long long c) {
  unsigned int i = 0;
  while (i + 1 < b.n && b.t[i + 1].first_chunk <= c) i++;
  return i;
}

// sonar_walk calls piece(j) for each 16-byte piece (N elements from j) of
// [lo, hi) that this thread owns, where pieces is true, and one(j) for each
// single element it owns; lo is a multiple of N.
template <int N, class Piece, class One>
SONAR_HD void sonar_walk(const SonarGrid& g, long long lo, long long hi, bool pieces, const Piece& piece,
                         const One& one) {
  long long rest = lo;
  if (SONAR_VEC && pieces) {
    rest = lo + (hi - lo) / N * N;
    for (long long j = lo + (long long)g.thread * N; j < rest; j += (long long)SONAR_THREADS * N) piece(j);
  }
  for (long long j = rest + g.thread; j < hi; j += SONAR_THREADS) one(j);
}

// sonar_update runs op(p, g, m, v, vmax) (float values in; p, m, v, vmax
// out, each stored once) on every element of [lo, hi) this thread owns. VM
// is null without amsgrad.
template <class S, class Op>
SONAR_HD void sonar_update(const SonarGrid& g, long long lo, long long hi, unsigned long long pp,
                           unsigned long long gp, unsigned long long mp, unsigned long long vp,
                           unsigned long long vmp, const Op& op) {
  typedef typename S::T T;
  const int N = SONAR_PIECE / sizeof(T);
  T* P = (T*)pp;
  const T* G = (const T*)gp;
  T* M = (T*)mp;
  T* V = (T*)vp;
  T* VM = (T*)vmp;
  const bool pieces = sonar_piece_aligned(pp | gp | mp | vp | vmp);
  sonar_walk<N>(
      g, lo, hi, pieces,
      [&](long long j) {
        typedef SonarLane<T> L;
        SonarPiece p, gr, m, v, vm;
        sonar_load(p, P + j);
        sonar_load(gr, G + j);
        sonar_load(m, M + j);
        sonar_load(v, V + j);
        if (VM) sonar_load(vm, VM + j);
        SONAR_UNROLL
        for (int i = 0; i < N; i++) {
          float pf = S::get(L::get(p, i)), mf = S::get(L::get(m, i)), vf = S::get(L::get(v, i));
          float vmf = VM ? S::get(L::get(vm, i)) : 0.0f;
          op(pf, S::get(L::get(gr, i)), mf, vf, vmf);
          L::set(p, i, S::put(pf));
          L::set(m, i, S::put(mf));
          L::set(v, i, S::put(vf));
          if (VM) L::set(vm, i, S::put(vmf));
        }
        sonar_store(P + j, p);
        sonar_store(M + j, m);
        sonar_store(V + j, v);
        if (VM) sonar_store(VM + j, vm);
      },
      [&](long long j) {
        float p = S::get(P[j]), m = S::get(M[j]), v = S::get(V[j]);
        float vmax = VM ? S::get(VM[j]) : 0.0f;
        op(p, S::get(G[j]), m, v, vmax);
        P[j] = S::put(p);
        M[j] = S::put(m);
        V[j] = S::put(v);
        if (VM) VM[j] = S::put(vmax);
      });
}

// The bounds of chunk c of tensor t.
template <class D>
SONAR_HD void sonar_chunk(const D& t, unsigned long long c, long long& lo, long long& hi) {
  lo = (long long)(c - t.first_chunk) * SONAR_CHUNK;
  hi = lo + (long long)SONAR_CHUNK < t.numel ? lo + (long long)SONAR_CHUNK : t.numel;
}

template <class D>
SONAR_HD unsigned long long sonar_vmax(const D& t) {
  return (t.flags & SONAR_FLAG_AMSGRAD) ? t.max_exp_avg_sq : 0ull;
}

template <class S>
SONAR_HD void sonar_adamw_batch(const SonarBatch& b, const SonarGrid& g) {
  for (unsigned long long c = g.block; c < b.total_chunks; c += g.blocks) {
    const SonarTensor& t = b.t[sonar_find(b, c)];
    long long lo, hi;
    sonar_chunk(t, c, lo, hi);
    sonar_update<S>(g, lo, hi, t.param, t.grad, t.exp_avg, t.exp_avg_sq, sonar_vmax(t),
                    [&](float& p, float gr, float& m, float& v, float& vmax) {
                      sonar_adamw_element<S>(p, gr, m, v, vmax, t);
                    });
  }
}

// CUDA's powf (libdevice), as torch's at::native::pow_(float, float) calls
// it. Kept out of line so that the PTX test can tell its instructions (an
// approximate reciprocal seeds its logarithm) from the kernels' own. The
// host build of this section uses the C library's (only the GPU check
// compares the device's with torch's).
#if defined(__CUDACC__)
extern "C" __device__ __noinline__ float sonar_powf(float base, float exp) { return powf(base, exp); }
// CUDA's double pow (libdevice), as pow_(double, float) in torch 2.8 to 2.10.
extern "C" __device__ __noinline__ double sonar_pow64(double base, double exp) { return pow(base, exp); }
#else
inline float sonar_powf(float base, float exp) { return powf(base, exp); }
inline double sonar_pow64(double base, double exp) { return pow(base, exp); }
#endif

template <class S>
SONAR_HD void sonar_fused_batch(const SonarFusedBatch& b, const SonarGrid& g) {
  for (unsigned long long c = g.block; c < b.total_chunks; c += g.blocks) {
    const SonarFusedTensor& t = b.t[sonar_find(b, c)];
    // Per tensor, as FusedAdamMathFunctor computes them per block:
    // bias_correction = 1 - pow_(beta, step), all in float.
    const float bc1 = S_SUB(1.0f, sonar_powf(t.beta1, t.step));
    const float bc2 = S_SUB(1.0f, sonar_powf(t.beta2, t.step));
    const SonarFusedConsts k = sonar_fused_consts(t, bc1, bc2);
    long long lo, hi;
    sonar_chunk(t, c, lo, hi);
    sonar_update<S>(g, lo, hi, t.param, t.grad, t.exp_avg, t.exp_avg_sq, sonar_vmax(t),
                    [&](float& p, float gr, float& m, float& v, float& vmax) {
                      sonar_fused_element(p, gr, m, v, vmax, k, t.flags);
                    });
  }
}

template <class S>
SONAR_HD void sonar_fused64_batch(const SonarFused64Batch& b, const SonarGrid& g) {
  for (unsigned long long c = g.block; c < b.total_chunks; c += g.blocks) {
    const SonarFused64Tensor& t = b.t[sonar_find(b, c)];
    const double step = (double)t.step;
    const double bc1 = D_SUB(1.0, sonar_pow64(t.beta1, step));
    const double bc2 = D_SUB(1.0, sonar_pow64(t.beta2, step));
    const SonarFused64Consts k = sonar_fused64_consts(t, bc1, bc2);
    long long lo, hi;
    sonar_chunk(t, c, lo, hi);
    sonar_update<S>(g, lo, hi, t.param, t.grad, t.exp_avg, t.exp_avg_sq, sonar_vmax(t),
                    [&](float& p, float gr, float& m, float& v, float& vmax) {
                      sonar_fused64_element(p, gr, m, v, vmax, k, t.flags);
                    });
  }
}

// Accumulation: param is the buffer added to, grad the gradient added.
template <class S>
SONAR_HD void sonar_add_batch(const SonarBatch& b, const SonarGrid& g) {
  typedef typename S::T T;
  const int N = SONAR_PIECE / sizeof(T);
  for (unsigned long long c = g.block; c < b.total_chunks; c += g.blocks) {
    const SonarTensor& t = b.t[sonar_find(b, c)];
    T* A = (T*)t.param;
    const T* G = (const T*)t.grad;
    long long lo, hi;
    sonar_chunk(t, c, lo, hi);
    sonar_walk<N>(
        g, lo, hi, sonar_piece_aligned(t.param | t.grad),
        [&](long long j) {
          typedef SonarLane<T> L;
          SonarPiece a, gr;
          sonar_load(a, A + j);
          sonar_load(gr, G + j);
          SONAR_UNROLL
          for (int i = 0; i < N; i++) L::set(a, i, S::put(sonar_add_element<S>(S::get(L::get(a, i)), S::get(L::get(gr, i)))));
          sonar_store(A + j, a);
        },
        [&](long long j) { A[j] = S::put(sonar_add_element<S>(S::get(A[j]), S::get(G[j]))); });
  }
}
// END LOOPS

#if defined(__CUDACC__)

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
// The batch is read with a computed index: __grid_constant__ keeps it in the
// parameter space instead of copying 4 KB to each thread's local memory.
#define SONAR_BATCH const __grid_constant__ SonarBatch
#define SONAR_FUSED_BATCH const __grid_constant__ SonarFusedBatch
#define SONAR_FUSED64_BATCH const __grid_constant__ SonarFused64Batch
#else
#define SONAR_BATCH const SonarBatch
#define SONAR_FUSED_BATCH const SonarFusedBatch
#define SONAR_FUSED64_BATCH const SonarFused64Batch
#endif

__device__ __forceinline__ SonarGrid sonar_grid() {
  SonarGrid g;
  g.block = blockIdx.x;
  g.blocks = gridDim.x;
  g.thread = threadIdx.x;
  return g;
}

extern "C" __global__ void __launch_bounds__(SONAR_THREADS) sonar_adamw_f32(SONAR_BATCH b) {
  sonar_adamw_batch<SonarF32>(b, sonar_grid());
}
extern "C" __global__ void __launch_bounds__(SONAR_THREADS) sonar_adamw_bf16(SONAR_BATCH b) {
  sonar_adamw_batch<SonarBF16>(b, sonar_grid());
}
extern "C" __global__ void __launch_bounds__(SONAR_THREADS) sonar_fused_adamw_f32(SONAR_FUSED_BATCH b) {
  sonar_fused_batch<SonarF32>(b, sonar_grid());
}
extern "C" __global__ void __launch_bounds__(SONAR_THREADS) sonar_fused_adamw_bf16(SONAR_FUSED_BATCH b) {
  sonar_fused_batch<SonarBF16>(b, sonar_grid());
}
extern "C" __global__ void __launch_bounds__(SONAR_THREADS) sonar_fused64_adamw_f32(SONAR_FUSED64_BATCH b) {
  sonar_fused64_batch<SonarF32>(b, sonar_grid());
}
extern "C" __global__ void __launch_bounds__(SONAR_THREADS) sonar_fused64_adamw_bf16(SONAR_FUSED64_BATCH b) {
  sonar_fused64_batch<SonarBF16>(b, sonar_grid());
}
extern "C" __global__ void __launch_bounds__(SONAR_THREADS) sonar_add_f32(SONAR_BATCH b) {
  sonar_add_batch<SonarF32>(b, sonar_grid());
}
extern "C" __global__ void __launch_bounds__(SONAR_THREADS) sonar_add_bf16(SONAR_BATCH b) {
  sonar_add_batch<SonarBF16>(b, sonar_grid());
}

#endif  // __CUDACC__
