// The lora_linear op's common call as one C++ autograd node (see lora_linear.py's
// _native_call, which decides which calls come here and prepares their operands): its
// GEMMs are called from C++ and its backward is a C++ node, so that a plain training
// loop's host pays neither Python's argument parsing per GEMM nor a Python autograd node.
// What only Python can do is called back, with the GIL: making the input again from what
// its maker kept (a norm's output, a gated activation's) and joining or dequantizing the
// frozen base again for the input gradient.
//
// The arithmetic is the Python path's (lora_linear._LoraJoined), call for call:
//   forward:  t = s x A^T;  y = x W^T;  y += t diag(B)^T
//   backward: ds = s dY diag(B);  dx = ds A + dY W;  dA = ds^T x;  dB_i = dY_i^T t_i

#include <torch/extension.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include "_autograd_nodes.h"

#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;
using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

namespace {

// A Python object a node holds: released with the GIL (a node may die on any thread),
// and leaked rather than touched once the interpreter is gone.
struct PyHandle {
  py::object object;
  PyHandle() = default;
  PyHandle(const PyHandle&) = delete;
  PyHandle& operator=(const PyHandle&) = delete;
  ~PyHandle() { reset(); }
  void reset() {
    if (!object) return;
    if (!Py_IsInitialized()) {
      object.release();
      return;
    }
    py::gil_scoped_acquire gil;
    object = py::object();
  }
  explicit operator bool() const { return static_cast<bool>(object); }
};

// ``alpha * a @ b`` by one GEMM (its alpha: no scaling kernel), as lora_linear._scaled_mm.
at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& b, double alpha) {
  if (alpha == 1.0) return at::mm(a, b);
  return at::addmm(at::empty({}, a.options()), a, b, /*beta=*/0, alpha);
}

// ``a @ b`` written in ``dtype`` (an adapter's gradient): on CUDA a 16-bit product in
// float32 by the GEMM itself, not rounded to 16 bits first; otherwise cast after.
at::Tensor product_in(const at::Tensor& a, const at::Tensor& b, at::ScalarType dtype) {
  if (dtype == a.scalar_type()) return at::mm(a, b);
  if (a.is_cuda() && dtype == at::kFloat &&
      (a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf)) {
    return at::mm(a, b, at::kFloat);
  }
  return at::mm(a, b).to(dtype);
}

// ``fn(first, *inputs)`` (``first`` where defined) called with the GIL, every Python
// object made and dropped under it; None gives an undefined tensor.
at::Tensor call_back(const py::object& fn, const at::Tensor& first,
                     const std::vector<at::Tensor>& inputs) {
  py::gil_scoped_acquire gil;
  try {
    py::tuple args(inputs.size() + (first.defined() ? 1 : 0));
    size_t i = 0;
    if (first.defined()) args[i++] = py::cast(first);
    for (const auto& t : inputs) args[i++] = py::cast(t);
    py::object result = fn(*args);
    return result.is_none() ? at::Tensor() : result.cast<at::Tensor>();
  } catch (py::error_already_set& e) {
    xpuruntime::raise_as_python(e);
  }
}

struct LoraBackward : public Node {
  SavedVariable input, w, a, diag, t;  // input, w: undefined where made again
  std::vector<SavedVariable> sources;  // what the input is made again from
  PyHandle again, product, rejoin;
  std::vector<int64_t> input_shape, sizes, ranks;
  double ds_scale = 1.0;
  at::ScalarType compute = at::kBFloat16, a_dtype = at::kBFloat16, b_dtype = at::kBFloat16;

  std::string name() const override { return "LoraJoinedBackward"; }

  void release_variables() override {
    input.reset_data();
    w.reset_data();
    a.reset_data();
    diag.reset_data();
    t.reset_data();
    for (auto& s : sources) s.reset_data();
  }

  template <class Self>
  std::vector<at::Tensor> unpacked_sources(const Self& self) {
    std::vector<at::Tensor> out;
    for (auto& s : sources) out.push_back(s.unpack(self));
    return out;
  }

  variable_list apply(variable_list&& grads) override;
};

variable_list LoraBackward::apply(variable_list&& grads) {
  if (at::GradMode::is_enabled()) xpuruntime::refuse_recorded_backward("lora_linear");
  const size_t n = sizes.size();
  variable_list out(1 + 2 * n);
  at::Tensor dy = grads[0];
  if (!dy.defined()) return out;
  const bool need_x = should_compute_output(0);
  bool need_a = false, need_b = false;
  for (size_t i = 0; i < n; ++i) {
    need_a = need_a || should_compute_output(1 + i);
    need_b = need_b || should_compute_output(1 + n + i);
  }
  // (No AutoDispatchBelowADInplaceOrView here: an unpack may run a checkpointed
  // forward again, which must record its own graph.)
  auto self = xpuruntime::self_ref(this);
  int64_t width = 0;
  for (auto s : sizes) width += s;
  dy = dy.reshape({-1, width});
  if (dy.scalar_type() != compute) dy = dy.to(compute);
  at::Tensor a_ = a.unpack(self), diag_ = diag.unpack(self), t_ = t.unpack(self);
  at::Tensor ds = scaled_mm(dy, diag_, ds_scale);
  // dA = ds^T x, given by the input's maker without making x where it can (a gated
  // activation, from gate and up); else x is made again from what its maker kept.
  at::Tensor da;
  if (need_a && product) {
    da = call_back(product.object, ds, unpacked_sources(self));  // (undefined: not taken)
    if (da.defined() && da.scalar_type() != a_dtype) da = da.to(a_dtype);
  }
  at::Tensor x;
  if (need_a && !da.defined()) {
    if (again) {
      x = call_back(again.object, at::Tensor(), unpacked_sources(self));
    } else {
      x = input.unpack(self);
    }
    x = x.reshape({-1, input_shape.back()});
    if (x.scalar_type() != compute) x = x.to(compute);
  }
  if (need_x) {
    at::Tensor w_ = rejoin ? call_back(rejoin.object, at::Tensor(), {}) : w.unpack(self);
    out[0] = at::mm(ds, a_).addmm_(dy, w_).view(input_shape);  // ds A first: dY W by its beta
  }
  if (need_a) {
    if (!da.defined()) da = product_in(ds.t(), x, a_dtype);
    auto parts = n == 1 ? std::vector<at::Tensor>{da} : at::split_with_sizes(da, ranks, 0);
    for (size_t i = 0; i < n; ++i) out[1 + i] = parts[i];
  }
  if (need_b) {
    // Each layer's dB = dY_i^T t_i by a GEMM of its own, in its parameter's dtype (t was
    // made scaled: no scale left to apply).
    at::Tensor dyt = dy.t();
    auto dys = n == 1 ? std::vector<at::Tensor>{dyt} : at::split_with_sizes(dyt, sizes, 0);
    auto ts = n == 1 ? std::vector<at::Tensor>{t_} : at::split_with_sizes(t_, ranks, 1);
    for (size_t i = 0; i < n; ++i) {
      if (should_compute_output(1 + n + i)) out[1 + n + i] = product_in(dys[i], ts[i], b_dtype);
    }
  }
  return out;
}

// The op's output ``x W^T + t diag(B)^T`` with ``t = s x A^T`` (x cast to the compute
// dtype, ``a``'s, where it is in another), recorded as one node over x and the adapters'
// weights where autograd needs it. ``w``, ``a`` and ``diag`` are the joined base, the
// joined A and the block diagonal of the B, in the compute dtype, made
// without autograd by the caller; ``rejoin`` (or None: ``w`` is kept) makes ``w`` again
// for the backward; ``again`` and ``product`` (or None) make the input, or dA, again from
// ``sources``.
at::Tensor lora_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& a,
                        const at::Tensor& diag, const std::vector<at::Tensor>& lora_as,
                        const std::vector<at::Tensor>& lora_bs, double scale,
                        std::vector<int64_t> sizes, std::vector<int64_t> ranks,
                        py::object rejoin, py::object again, py::object product,
                        const std::vector<at::Tensor>& sources, at::ScalarType a_dtype,
                        at::ScalarType b_dtype) {
  at::Tensor rows, t, y;
  int64_t width = 0;
  for (auto s : sizes) width += s;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    rows = x.reshape({-1, x.size(-1)});
    if (rows.scalar_type() != a.scalar_type()) rows = rows.to(a.scalar_type());
    t = scaled_mm(rows, a.t(), scale);
    auto shape = x.sizes().vec();
    shape.back() = -1;
    y = at::linear(rows.view(shape), w);
    y.view({-1, width}).addmm_(t, diag.t());
  }
  std::vector<at::Tensor> inputs{x};
  inputs.insert(inputs.end(), lora_as.begin(), lora_as.end());
  inputs.insert(inputs.end(), lora_bs.begin(), lora_bs.end());
  if (!at::GradMode::is_enabled() || !torch::autograd::compute_requires_grad(inputs)) return y;
  auto node = xpuruntime::make_node<LoraBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  torch::autograd::set_history(y, node);
  node->input_shape = x.sizes().vec();
  node->sizes = std::move(sizes);
  node->ranks = std::move(ranks);
  node->ds_scale = scale;
  node->compute = a.scalar_type();
  node->a_dtype = a_dtype;
  node->b_dtype = b_dtype;
  node->a = SavedVariable(a, false);
  node->diag = SavedVariable(diag, false);
  node->t = SavedVariable(t, false);
  if (again.is_none()) {
    // (x itself where it is in the compute dtype; its cast, as the Python path keeps)
    node->input = SavedVariable(rows.scalar_type() == x.scalar_type() ? x : rows, false);
  } else {
    node->again.object = std::move(again);
    if (!product.is_none()) node->product.object = std::move(product);
    for (const auto& s : sources) node->sources.emplace_back(s, false);
  }
  if (rejoin.is_none()) {
    node->w = SavedVariable(w, false);
  } else {
    node->rejoin.object = std::move(rejoin);
  }
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("lora_forward", &lora_forward); }
