// What the extension's autograd nodes share across the torch versions it builds against.
#pragma once

#include <torch/csrc/autograd/function.h>

#include <memory>
#include <type_traits>

namespace xpuruntime {

template <class N>
inline auto self_ref(N* node) {  // what SavedVariable::unpack takes as the node a result was saved for
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, N>) {
    return c10::intrusive_ptr<N>::reclaim_copy(node);
  } else {
    return node->shared_from_this();
  }
}

template <class N>
inline auto make_node() {
  // torch >= 2.12 holds autograd nodes in intrusive_ptrs, earlier ones in shared_ptrs.
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, N>) {
    return c10::make_intrusive<N>();
  } else {
    return std::shared_ptr<N>(new N());
  }
}

}  // namespace xpuruntime
