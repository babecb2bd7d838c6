// Strided tensor views (non-owning, value types) and contiguous owning tensors.
//
// TensorView<T> is a pointer, a shape and strides in elements, up to rank 4, like
// std::mdspan with a dynamic extent: cheap to copy, passed by value. Tensor<T> owns a
// contiguous row-major Buffer and hands out views. Activations are mostly rank 2,
// (rows = batch * seq, features), the layout every GEMM and per-row op reads.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <ostream>
#include <string>
#include <type_traits>

#include "tessera/core/buffer.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/macros.hpp"

namespace tessera {

inline constexpr int kMaxRank = 4;

struct Shape {
  std::array<std::int64_t, kMaxRank> dims{};
  int rank = 0;

  Shape() = default;
  Shape(std::initializer_list<std::int64_t> d) {
    TESSERA_CHECK(d.size() <= kMaxRank, "Shape: rank ", d.size(), " exceeds ", kMaxRank);
    for (auto v : d) {
      TESSERA_CHECK(v >= 0, "Shape: negative extent ", v);
      dims[rank++] = v;
    }
  }
  TESSERA_HD std::int64_t operator[](int i) const { return dims[i]; }
  TESSERA_HD std::int64_t numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < rank; ++i) n *= dims[i];
    return n;
  }
  friend bool operator==(const Shape& a, const Shape& b) {
    if (a.rank != b.rank) return false;
    for (int i = 0; i < a.rank; ++i)
      if (a.dims[i] != b.dims[i]) return false;
    return true;
  }
  std::string str() const {
    std::string s = "(";
    for (int i = 0; i < rank; ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
    return s + ")";
  }
  friend std::ostream& operator<<(std::ostream& os, const Shape& s) { return os << s.str(); }
};

template <class T>
class TensorView {
 public:
  using value_type = T;
  TensorView() = default;
  TensorView(T* data, Shape shape) : data_(data), shape_(shape) {
    std::int64_t s = 1;
    for (int i = shape.rank - 1; i >= 0; --i) {
      strides_[i] = s;
      s *= shape.dims[i];
    }
  }
  TensorView(T* data, Shape shape, std::array<std::int64_t, kMaxRank> strides)
      : data_(data), shape_(shape), strides_(strides) {}

  /// A const view of the same elements (for a view of non-const elements only: a
  /// template, so that TensorView<const T> declares no conversion to itself).
  template <class U = T>
    requires(std::is_same_v<U, T> && !std::is_const_v<U>)
  operator TensorView<const U>() const {
    return {data_, shape_, strides_};
  }

  TESSERA_HD T* data() const { return data_; }
  const Shape& shape() const { return shape_; }
  TESSERA_HD int rank() const { return shape_.rank; }
  TESSERA_HD std::int64_t size(int i) const { return shape_.dims[i]; }
  TESSERA_HD std::int64_t stride(int i) const { return strides_[i]; }
  TESSERA_HD std::int64_t numel() const { return shape_.numel(); }

  bool is_contiguous() const {
    std::int64_t s = 1;
    for (int i = shape_.rank - 1; i >= 0; --i) {
      if (shape_.dims[i] != 1 && strides_[i] != s) return false;
      s *= shape_.dims[i];
    }
    return true;
  }

  // Rank-2 accessors: most activations are (rows, cols) matrices.
  TESSERA_HD std::int64_t rows() const { return shape_.dims[0]; }
  TESSERA_HD std::int64_t cols() const { return shape_.dims[1]; }
  TESSERA_HD std::int64_t ld() const { return strides_[0]; }
  TESSERA_HD T* row(std::int64_t r) const { return data_ + r * strides_[0]; }

  TESSERA_HD T& operator()(std::int64_t i) const { return data_[i * strides_[0]]; }
  TESSERA_HD T& operator()(std::int64_t i, std::int64_t j) const {
    return data_[i * strides_[0] + j * strides_[1]];
  }
  TESSERA_HD T& operator()(std::int64_t i, std::int64_t j, std::int64_t k) const {
    return data_[i * strides_[0] + j * strides_[1] + k * strides_[2]];
  }

  /// Rows [begin, end) of the leading dimension.
  TensorView slice_rows(std::int64_t begin, std::int64_t end) const {
    TESSERA_CHECK(0 <= begin && begin <= end && end <= shape_.dims[0], "slice_rows: [", begin, ", ",
                  end, ") out of ", shape_.str());
    Shape s = shape_;
    s.dims[0] = end - begin;
    return {data_ + begin * strides_[0], s, strides_};
  }

  /// Columns [begin, end) of a rank-2 view (a strided view: ld stays).
  TensorView slice_cols(std::int64_t begin, std::int64_t end) const {
    TESSERA_CHECK(shape_.rank == 2 && 0 <= begin && begin <= end && end <= shape_.dims[1],
                  "slice_cols: [", begin, ", ", end, ") out of ", shape_.str());
    Shape s = shape_;
    s.dims[1] = end - begin;
    return {data_ + begin * strides_[1], s, strides_};
  }

  /// The same contiguous elements under another shape.
  TensorView reshape(Shape s) const {
    TESSERA_CHECK(is_contiguous() && s.numel() == numel(), "reshape: ", shape_.str(), " to ",
                  s.str(), " needs a contiguous view of equal size");
    return {data_, s};
  }

 private:
  T* data_ = nullptr;
  Shape shape_{};
  std::array<std::int64_t, kMaxRank> strides_{};

  template <class U>
  friend class TensorView;
};

/// A contiguous, row-major tensor. Copies share the elements (like a reference-counted
/// array): a layer that saves its input for backward keeps it alive without copying it.
/// clone() makes a deep copy.
template <class T>
class Tensor {
 public:
  using value_type = T;
  Tensor() = default;
  /// Zero-initialised host tensor.
  explicit Tensor(Shape shape)
      : shape_(shape), buffer_(std::make_shared<Buffer<T>>(static_cast<std::size_t>(shape.numel()))) {}
  /// Host tensor whose elements the caller overwrites before reading them.
  Tensor(Shape shape, Uninitialized)
      : shape_(shape),
        buffer_(std::make_shared<Buffer<T>>(static_cast<std::size_t>(shape.numel()), Uninitialized{})) {}
  Tensor(Shape shape, Buffer<T> buffer)
      : shape_(shape), buffer_(std::make_shared<Buffer<T>>(std::move(buffer))) {
    TESSERA_CHECK(static_cast<std::int64_t>(buffer_->size()) == shape.numel(), "Tensor: buffer of ",
                  buffer_->size(), " elements for shape ", shape.str());
  }

  TensorView<T> view() const { return {data(), shape_}; }
  TensorView<const T> cview() const { return view(); }
  operator TensorView<T>() const { return view(); }
  operator TensorView<const T>() const { return view(); }

  T* data() const { return buffer_ ? buffer_->data() + offset_ : nullptr; }
  const Shape& shape() const { return shape_; }
  std::int64_t numel() const { return shape_.numel(); }
  std::int64_t size(int i) const { return shape_.dims[i]; }
  Device device() const { return buffer_ ? buffer_->device() : Device::cpu; }
  std::size_t bytes() const { return buffer_ ? static_cast<std::size_t>(numel()) * sizeof(T) : 0; }
  bool empty() const { return buffer_ == nullptr || numel() == 0; }
  T& operator[](std::int64_t i) const { return data()[i]; }

  /// The same elements under another shape of equal size.
  Tensor reshape(Shape s) const {
    TESSERA_CHECK(s.numel() == numel(), "reshape: ", shape_.str(), " to ", s.str(), " changes the size");
    Tensor t = *this;
    t.shape_ = s;
    return t;
  }

  /// Elements [offset, offset + shape.numel()) of this tensor under `shape`, sharing
  /// its storage (which lives while any such tensor does): how a unit's flat buffer
  /// hands out its parameters.
  Tensor slice(std::int64_t offset, Shape s) const {
    TESSERA_CHECK(offset >= 0 && offset + s.numel() <= numel(), "Tensor::slice: [", offset, ", ",
                  offset + s.numel(), ") out of ", numel(), " elements");
    Tensor t = *this;
    t.shape_ = s;
    t.offset_ += offset;
    return t;
  }

  /// A deep copy in host memory.
  Tensor clone() const {
    Tensor t(shape_);
    if (numel() > 0) std::memcpy(t.data(), data(), bytes());
    return t;
  }

  /// Drops this handle's share of the elements; the tensor becomes empty.
  void release() {
    buffer_.reset();
    shape_ = Shape{};
    offset_ = 0;
  }

 private:
  Shape shape_{};
  std::int64_t offset_ = 0;
  std::shared_ptr<Buffer<T>> buffer_{};
};

}  // namespace tessera
