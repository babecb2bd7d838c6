// AdamW with decoupled weight decay, one element per call (torch.optim.AdamW's
// arithmetic): p <- p (1 - lr wd); m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2;
// p <- p - lr (m / c1) / (sqrt(v / c2) + eps), with c1 = 1 - b1^t, c2 = 1 - b2^t.
// g is the gradient times grad_scale (the clipping coefficient), which a multi-tensor
// step may read from the backend's memory, where the clip computed it.
//
// AdamWStep updates one tensor. AdamWMultiStep updates every tensor of a model in one
// launch: a table of AdamWTensor entries (in the backend's memory) gives each tensor a
// range of the launch's indices starting on a multiple of kAdamWBlock, and a second
// table maps each block of kAdamWBlock indices to its tensor, so each index finds its
// tensor in two loads (no search). Where a tensor has an fp32 master copy (bf16
// parameters), the update goes to the master and the parameter receives its bf16
// rounding in the same pass. Gradients, moments and masters are accum_t<T>: for a bf16
// model (T = bf16) they are fp32 and every tensor has a master; for an fp32 model with
// bf16 parameters (mixed_precision_param) the parameter is fp32 holding bf16 values.
//
// The moments may be stored as bf16 instead (AdamWMultiStep<T, bf16>, the optimizer's
// state_dtype): each is widened to fp32, updated in fp32 exactly as an fp32 moment is,
// and stored rounded to nearest even, once per step. The update is written with mul_rn
// and add_rn (ops/math.hpp), never fused into an fma, so both backends compute the same
// fp32 values and therefore store the same bf16 bits.
//
// Flops of one element's update, as adamw_update writes them: 19 (the scaled gradient 1,
// the decay 3, m 4, v 5, the denominator 2, the step 4) and a sqrt.
#pragma once

#include <cstdint>
#include <type_traits>

#include "tessera/core/dtype.hpp"
#include "tessera/core/macros.hpp"
#include "tessera/ops/math.hpp"
#include "tessera/ops/traffic.hpp"

namespace tessera::ops {

/// The scalars of one AdamW step.
template <class T>
struct AdamWScalars {
  T lr;
  T beta1;
  T beta2;
  T eps;
  T weight_decay;
  T bias_correction1;
  T bias_correction2;
  T grad_scale;
};

/// One element's update: p, m and v in place, from gradient g (before grad_scale).
/// Each product and sum is rounded on its own (mul_rn, add_rn: no fma on any backend),
/// in the order the formula reads; a - b is a + (-b), the same IEEE result.
template <class T>
TESSERA_HD inline void adamw_update(T& p, T& m, T& v, T grad, const AdamWScalars<T>& s) {
  const T g = mul_rn(grad, s.grad_scale);
  const T decayed = mul_rn(p, add_rn(T(1), -mul_rn(s.lr, s.weight_decay)));
  m = add_rn(mul_rn(s.beta1, m), mul_rn(add_rn(T(1), -s.beta1), g));
  v = add_rn(mul_rn(s.beta2, v), mul_rn(mul_rn(add_rn(T(1), -s.beta2), g), g));
  const T denom = add_rn(sqrt_(v / s.bias_correction2), s.eps);
  p = add_rn(decayed, -(mul_rn(s.lr, m / s.bias_correction1) / denom));
}

/// Flops of one adamw_update (the sqrt not included).
inline constexpr double kAdamWFlops = 19;

template <class T>
struct AdamWStep {
  T* param;
  const T* grad;
  T* exp_avg;
  T* exp_avg_sq;
  T lr;
  T beta1;
  T beta2;
  T eps;
  T weight_decay;
  T bias_correction1;
  T bias_correction2;
  T grad_scale;
  TESSERA_HD void operator()(std::int64_t i) const {
    const AdamWScalars<T> s{lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2, grad_scale};
    T p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    adamw_update(p, m, v, grad[i], s);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
  // p, g, m and v read, p, m and v written.
  Traffic traffic(std::int64_t n) const {
    const double e = static_cast<double>(n);
    return {4 * e * sizeof(T), 3 * e * sizeof(T), kAdamWFlops * e, e};
  }
};

/// Indices of a multi-tensor launch per entry of its block table.
inline constexpr std::int64_t kAdamWBlock = 2048;

/// One tensor of a multi-tensor AdamW launch, its moments stored as M: accum_t<T> (the
/// gradients' type) or bf16.
template <class T, class M = accum_t<T>>
struct AdamWTensor {
  T* param;
  const accum_t<T>* grad;
  M* exp_avg;
  M* exp_avg_sq;
  accum_t<T>* master;   // the fp32 master the update goes to (bf16 parameters), or null
  std::int64_t numel;
  std::int64_t begin;   // its first index in the launch, a multiple of kAdamWBlock

  friend bool operator==(const AdamWTensor&, const AdamWTensor&) = default;
};

/// Every tensor's step in one launch over `blocks * kAdamWBlock` indices, the moments
/// stored as M (accum_t<T>, or bf16 rounded to nearest even after each fp32 update).
template <class T, class M = accum_t<T>>
struct AdamWMultiStep {
  using A = accum_t<T>;
  static_assert(std::is_same_v<M, A> || (std::is_same_v<M, bf16> && std::is_same_v<A, float>),
                "tessera: AdamWMultiStep<T, M>: moments are stored in accum_t<T>, or in bf16 over fp32 arithmetic");
  const AdamWTensor<T, M>* tensors;
  const std::int32_t* block_tensor;  // the tensor each block of kAdamWBlock indices belongs to
  AdamWScalars<A> s;
  // For traffic(), what the tables in the backend's memory hold:
  std::int64_t elements;      // the tensors' numel summed: the indices that are not padding
  std::int64_t tensor_count;  // entries of `tensors`
  bool masters;               // whether the tensors have masters (the optimizer gives all or none)
  /// Where the step reads its gradient scale in the backend's memory (the clip scale
  /// ops::ClipScale wrote there), in place of s.grad_scale; null: s.grad_scale. A NaN
  /// there (a gradient norm or loss that was not finite) skips the step: nothing changes.
  const A* grad_scale = nullptr;
  /// Where the step reads all of its scalars in the backend's memory, in place of s (the
  /// learning rate and bias corrections change every step; a launch a graph replays may
  /// not); null: s.
  const AdamWScalars<A>* step_scalars = nullptr;
  /// The step's scalars, s (or *step_scalars) with the gradient scale read from
  /// grad_scale when that is set; false where that scale is NaN (the step changes nothing).
  TESSERA_HD bool scalars(AdamWScalars<A>& out) const {
    out = step_scalars != nullptr ? *step_scalars : s;
    if (grad_scale == nullptr) return true;
    out.grad_scale = *grad_scale;
    return out.grad_scale == out.grad_scale;
  }
  /// One element's state in A: the master or the parameter, the moments (bf16 widened
  /// exactly) and the gradient.
  struct Element {
    A p, m, v, g;
  };
  TESSERA_HD Element load(const AdamWTensor<T, M>& t, std::int64_t j) const {
    return {t.master != nullptr ? t.master[j] : to_accum(t.param[j]), to_accum(t.exp_avg[j]), to_accum(t.exp_avg_sq[j]),
            t.grad[j]};
  }
  /// Element j updated: the moments (bf16 rounded once, to nearest even), the master and
  /// the parameter.
  TESSERA_HD void update_and_store(const AdamWTensor<T, M>& t, std::int64_t j, Element e,
                                   const AdamWScalars<A>& sc) const {
    adamw_update(e.p, e.m, e.v, e.g, sc);
    t.exp_avg[j] = from_accum<M>(e.m);
    t.exp_avg_sq[j] = from_accum<M>(e.v);
    if (t.master == nullptr) {
      t.param[j] = from_accum<T>(e.p);
    } else {
      t.master[j] = e.p;
      if constexpr (std::is_same_v<T, float>)
        t.param[j] = round_to_bf16(e.p);  // an fp32 parameter holding bf16 values
      else
        t.param[j] = from_accum<T>(e.p);  // a bf16 parameter: rounded once, to nearest even
    }
  }
  TESSERA_HD void operator()(std::int64_t i) const {
    const AdamWTensor<T, M>& t = tensors[block_tensor[i / kAdamWBlock]];
    const std::int64_t j = i - t.begin;
    if (j >= t.numel) return;  // the padding after a tensor, up to its last block's end
    AdamWScalars<A> sc;
    if (!scalars(sc)) return;
    update_and_store(t, j, load(t, j), sc);
  }
  // The tables once per launch (an entry of block_tensor per block, each tensor's entry);
  // per element g, m, v and the master or the parameter read, m, v, the parameter and
  // the master written (m and v as M). Padding indices touch nothing else.
  Traffic traffic(std::int64_t n) const {
    const double e = static_cast<double>(elements), m = masters ? 1 : 0;
    const double blocks = static_cast<double>((n + kAdamWBlock - 1) / kAdamWBlock);
    const double tables =
        blocks * sizeof(std::int32_t) + static_cast<double>(tensor_count) * sizeof(AdamWTensor<T, M>);
    const double scale = (grad_scale != nullptr ? sizeof(A) : 0) +  // read once, as the tables are
                         (step_scalars != nullptr ? sizeof(AdamWScalars<A>) : 0);
    const double read = tables + scale + e * (sizeof(A) + 2 * sizeof(M) + (masters ? sizeof(A) : sizeof(T)));
    const double written = e * (2 * sizeof(M) + sizeof(T) + m * sizeof(A));
    return {read, written, kAdamWFlops * e, e};
  }
};

}  // namespace tessera::ops
