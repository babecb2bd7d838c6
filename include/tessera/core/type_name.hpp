// Type names as a person reads them: demangled, tessera's own namespaces dropped. For
// messages that name a type (a trace's functor, a block's options read as the wrong
// type), where the mangled name would be noise.
#pragma once

#include <cxxabi.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <typeinfo>

namespace tessera {

/// A demangled name with tessera's namespaces dropped ("tessera::ops::RmsNormForward<
/// tessera::bf16>" -> "RmsNormForward<bf16>").
inline std::string without_tessera_namespaces(std::string s) {
  for (const char* prefix : {"tessera::ops::detail::", "tessera::ops::", "tessera::nn::detail::", "tessera::nn::",
                             "tessera::parallel::detail::", "tessera::parallel::", "tessera::optim::detail::",
                             "tessera::optim::", "tessera::detail::", "tessera::"}) {
    const std::string p = prefix;
    for (std::size_t at = s.find(p); at != std::string::npos; at = s.find(p)) s.erase(at, p.size());
  }
  return s;
}

/// A mangled type name (std::type_info::name()) demangled, with tessera's namespaces
/// dropped ("RmsNormForward<float>", "examples::ReluSquaredOptions"); the mangled name
/// itself where it does not demangle.
inline std::string readable_type_name(const char* mangled) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> d(abi::__cxa_demangle(mangled, nullptr, nullptr, &status), std::free);
  return without_tessera_namespaces(status == 0 && d ? d.get() : mangled);
}

/// readable_type_name of T.
template <class T>
std::string type_name() {
  return readable_type_name(typeid(T).name());
}

}  // namespace tessera
