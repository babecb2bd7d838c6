// Learning-rate schedule: linear warmup -> stable -> decay, as torchtitan defines it.
//
// factor(s) multiplies the base learning rate for optimizer step s (0-based):
//   warmup (s < W):          (s + 1) / (W + 1)
//   stable (s < W + S):      1
//   decay:                   p = (s + 1 - W - S) / (D + 1), then
//                            linear 1 - p | sqrt 1 - sqrt(p) | cosine (1 + cos(pi p)) / 2,
//                            mapped onto [min_lr_factor, 1].
// D = round(steps * decay_ratio), or steps - W when decay_ratio is unset; S is the rest.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "tessera/core/error.hpp"

namespace tessera::optim {

enum class DecayType : std::uint8_t { linear, sqrt, cosine };

inline DecayType parse_decay_type(std::string_view s) {
  if (s == "linear") return DecayType::linear;
  if (s == "sqrt") return DecayType::sqrt;
  if (s == "cosine") return DecayType::cosine;
  fail("lr_scheduler.decay_type: unknown value '", s, "' (expected linear, sqrt or cosine)");
}

/// The schedule's shape, by name (torchtitan's [lr_scheduler] keys, and training.steps).
struct LrScheduleOptions {
  std::int64_t steps = 0;  // the run's length: the decay ends at the last step
  std::int64_t warmup_steps = 0;
  std::optional<double> decay_ratio;  // the decay's share of the steps; unset: all after warm-up
  DecayType decay_type = DecayType::linear;
  double min_lr_factor = 0.0;  // the factor the decay ends at
};

class LrSchedule {
 public:
  explicit LrSchedule(const LrScheduleOptions& o)
      : warmup_(o.warmup_steps), type_(o.decay_type), min_factor_(o.min_lr_factor) {
    TESSERA_CHECK(o.steps > 0, "lr schedule: steps must be positive, got ", o.steps);
    TESSERA_CHECK(o.warmup_steps >= 0, "lr schedule: warmup_steps must not be negative, got ", o.warmup_steps);
    TESSERA_CHECK(o.min_lr_factor >= 0 && o.min_lr_factor <= 1, "lr schedule: min_lr_factor must lie in [0, 1], got ",
                  o.min_lr_factor);
    if (o.decay_ratio) {
      TESSERA_CHECK(*o.decay_ratio >= 0 && *o.decay_ratio <= 1, "lr schedule: decay_ratio must lie in [0, 1], got ",
                    *o.decay_ratio);
      decay_ = static_cast<std::int64_t>(std::llround(static_cast<double>(o.steps) * *o.decay_ratio));
    } else {
      decay_ = std::max<std::int64_t>(o.steps - o.warmup_steps, 0);
    }
    stable_ = std::max<std::int64_t>(o.steps - warmup_ - decay_, 0);
    last_ = warmup_ + stable_ + decay_;
  }

  LrSchedule(std::int64_t steps, std::int64_t warmup_steps, std::optional<double> decay_ratio, DecayType type,
             double min_lr_factor)
      : LrSchedule(LrScheduleOptions{steps, warmup_steps, decay_ratio, type, min_lr_factor}) {}

  /// The factor for 0-based optimizer step `s`.
  double factor(std::int64_t s) const {
    s = std::min(s, last_);
    if (s < warmup_) return static_cast<double>(s + 1) / static_cast<double>(warmup_ + 1);
    if (s < warmup_ + stable_ || decay_ == 0) return 1.0;
    const double p = static_cast<double>(s + 1 - warmup_ - stable_) / static_cast<double>(decay_ + 1);
    double f = 0;
    switch (type_) {
      case DecayType::linear: f = 1 - p; break;
      case DecayType::sqrt: f = 1 - std::sqrt(p); break;
      case DecayType::cosine: f = 0.5 * (1 + std::cos(3.14159265358979323846 * p)); break;
    }
    return min_factor_ + (1 - min_factor_) * f;
  }

  std::int64_t warmup_steps() const { return warmup_; }
  std::int64_t stable_steps() const { return stable_; }
  std::int64_t decay_steps() const { return decay_; }

 private:
  std::int64_t warmup_, stable_ = 0, decay_ = 0, last_ = 0;
  DecayType type_;
  double min_factor_;
};

}  // namespace tessera::optim
