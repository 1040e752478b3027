// What both extensions' autograd nodes share: their making across the torch versions they
// build against, and Python's errors raised through autograd as themselves.
#pragma once

#include <pybind11/pybind11.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <stdexcept>
#include <string>
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

// The Python error being handled, raised to autograd as itself (its type and text), as
// PyTorch's own Python nodes raise theirs: the engine gives it to the caller's backward.
[[noreturn]] inline void raise_as_python(pybind11::error_already_set& e) {
  e.restore();
  python_error error;
  error.persist();
  throw std::move(error);
}

// A backward of ``op`` that autograd was asked to record (create_graph=True: grad mode on
// in a backward) refused with the error of _first_order.refuse_recorded_backward: our
// nodes' kernels give first derivatives only.
[[noreturn]] inline void refuse_recorded_backward(const std::string& op) {
  pybind11::gil_scoped_acquire gil;
  try {
    auto module = pybind11::module_::import("xpuruntime.pytorch._ops._infra._first_order");
    module.attr("refuse_recorded_backward")(op);
  } catch (pybind11::error_already_set& e) {
    raise_as_python(e);
  }
  throw std::logic_error(op + "'s backward: a recorded backward was not refused");
}

}  // namespace xpuruntime
