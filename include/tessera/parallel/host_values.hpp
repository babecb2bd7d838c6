// Host values reduced over ranks the way NCCL allows.
//
// A token count, a loss sum, a sum of squared gradients: the host holds them, every
// rank needs their total. NCCL moves device memory only, and its wait() orders the
// compute stream, not the host: handing it the address of a host variable and reading
// the variable after wait() reads whatever was there. So each value goes up into one
// backend buffer, is all-reduced there, and comes back with the copy to the host,
// which is the one synchronisation the host needs before it reads the result.
#pragma once

#include <array>
#include <cstddef>
#include <source_location>
#include <span>

#include "tessera/backend/backend.hpp"
#include "tessera/comm/communicator.hpp"
#include "tessera/core/tensor.hpp"

namespace tessera::parallel {

/// `values` reduced element-wise over every rank of `comm` (the same on every rank),
/// staged through one backend buffer of N elements: one collective, one synchronisation.
/// T is an element type the backend's tensors hold (float, double).
template <Backend B, class T, std::size_t N>
std::array<T, N> all_reduce_host(comm::Communicator& comm, std::array<T, N> values,
                                 comm::ReduceOp op = comm::ReduceOp::sum,
                                 const std::source_location& site = std::source_location::current()) {
  if (comm.size() == 1) return values;
  Tensor<T> staged = B::template empty<T>(Shape{static_cast<std::int64_t>(N)});
  {
    tessera::detail::TransferSite at(site);
    B::copy_from_host(values.data(), staged.data(), static_cast<std::int64_t>(N));
  }
  comm.all_reduce(std::span<T>(staged.data(), N), op);  // orders the stream after the collective
  tessera::detail::TransferSite at(site);
  B::copy_to_host(staged.data(), values.data(), static_cast<std::int64_t>(N));  // the synchronisation
  return values;
}

/// One host value reduced over every rank of `comm`.
template <Backend B, class T>
T all_reduce_host(comm::Communicator& comm, T value, comm::ReduceOp op = comm::ReduceOp::sum,
                  const std::source_location& site = std::source_location::current()) {
  return all_reduce_host<B>(comm, std::array<T, 1>{value}, op, site)[0];
}

}  // namespace tessera::parallel
