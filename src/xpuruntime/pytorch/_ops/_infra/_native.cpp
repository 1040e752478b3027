// Replayed launch programs: an op's Triton kernels launched from C++ behind one autograd
// node, as PyTorch's own ops are (see _native.py, which records the programs from the
// Python launchers and checks every replay against them before using it).
//
// A program is a table of tensors (the call's inputs, then buffers it allocates) and a list
// of launches, each a compiled Triton function with its grid and one slot per kernel
// parameter: a table entry's address (plus a byte offset), an integer constant, the call's
// float scalar, or a null pointer (Triton's scratch pointers). The forward program runs on a
// call's inputs; when autograd must record the call, a RecordedBackward node saves what the
// backward program reads and runs it on the output gradients.

#include <torch/extension.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>
#include <dlfcn.h>

#include "_autograd_nodes.h"

#include <array>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace py = pybind11;
using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

namespace {

// The driver's entry points, from libcuda itself (no CUDA toolkit needed to link).
struct Driver {
  int (*launch)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                void*, void**, void**) = nullptr;
  int (*get_context)(void**) = nullptr;
  int (*set_context)(void*) = nullptr;
  int (*get_device)(int*, int) = nullptr;
  int (*retain_primary)(void**, int) = nullptr;

  Driver() {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (lib == nullptr) return;
    launch = reinterpret_cast<decltype(launch)>(dlsym(lib, "cuLaunchKernel"));
    get_context = reinterpret_cast<decltype(get_context)>(dlsym(lib, "cuCtxGetCurrent"));
    set_context = reinterpret_cast<decltype(set_context)>(dlsym(lib, "cuCtxSetCurrent"));
    get_device = reinterpret_cast<decltype(get_device)>(dlsym(lib, "cuDeviceGet"));
    retain_primary =
        reinterpret_cast<decltype(retain_primary)>(dlsym(lib, "cuDevicePrimaryCtxRetain"));
  }
  bool ready() const {
    return launch && get_context && set_context && get_device && retain_primary;
  }
  // A thread that has only used the runtime API (autograd's device threads) may have no
  // current driver context: make the device's primary context current, as Triton does.
  void ensure_context(int device_index) const {
    void* context = nullptr;
    get_context(&context);
    if (context != nullptr) return;
    int device = 0;
    TORCH_CHECK(get_device(&device, device_index) == 0, "cuDeviceGet failed");
    TORCH_CHECK(retain_primary(&context, device) == 0, "cuDevicePrimaryCtxRetain failed");
    TORCH_CHECK(set_context(context) == 0, "cuCtxSetCurrent failed");
  }
};

const Driver& driver() {
  static Driver d;
  return d;
}

enum SlotKind : int { PTR = 0, I32 = 1, I64 = 2, U32 = 3, U64 = 4, SCALAR_F32 = 5, NULLPTR = 6 };

struct Slot {
  int kind;
  int table;      // PTR: the table entry
  int64_t value;  // PTR: byte offset; integers: the value
};

struct Launch {
  void* function;
  std::array<unsigned, 3> grid;
  unsigned threads;
  unsigned shared;
  std::vector<Slot> slots;
  std::string name;
};

struct Buffer {
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
  bool like_rows;  // allocated with the shape of the call's row input (same elements)
};

struct View {  // a program output: a table entry, whole or a strided view of it
  int table;
  bool whole;
  int64_t offset;
  std::vector<int64_t> sizes, strides;
};

struct Program {
  int inputs = 0;
  std::vector<Buffer> buffers;
  std::vector<Launch> launches;
  std::vector<View> outputs;
};

Program program_from(const py::tuple& spec) {
  Program p;
  p.inputs = spec[0].cast<int>();
  for (auto b : spec[1].cast<py::list>()) {
    auto t = b.cast<py::tuple>();
    p.buffers.push_back({t[0].cast<std::vector<int64_t>>(), t[1].cast<at::ScalarType>(),
                         t[2].cast<bool>()});
  }
  for (auto l : spec[2].cast<py::list>()) {
    auto t = l.cast<py::tuple>();
    Launch launch;
    launch.function = reinterpret_cast<void*>(t[0].cast<uintptr_t>());
    auto grid = t[1].cast<std::vector<unsigned>>();
    launch.grid = {grid.at(0), grid.at(1), grid.at(2)};
    launch.threads = t[2].cast<unsigned>();
    launch.shared = t[3].cast<unsigned>();
    for (auto s : t[4].cast<py::list>()) {
      auto st = s.cast<py::tuple>();
      launch.slots.push_back({st[0].cast<int>(), st[1].cast<int>(), st[2].cast<int64_t>()});
    }
    launch.name = t[5].cast<std::string>();
    TORCH_CHECK(launch.slots.size() <= 64, "a launch program takes at most 64 parameters");
    p.launches.push_back(std::move(launch));
  }
  for (auto o : spec[3].cast<py::list>()) {
    auto t = o.cast<py::tuple>();
    p.outputs.push_back({t[0].cast<int>(), t[1].cast<bool>(), t[2].cast<int64_t>(),
                         t[3].cast<std::vector<int64_t>>(), t[4].cast<std::vector<int64_t>>()});
  }
  return p;
}

// Run a program: allocate its buffers after the inputs in `table`, launch, return the
// outputs. `rows` is the row input's shape (buffers laid out as it take it).
std::vector<at::Tensor> run(const Program& p, std::vector<at::Tensor>& table, at::IntArrayRef rows,
                            float scalar, const at::Device& device) {
  auto options = at::TensorOptions().device(device);
  for (const auto& b : p.buffers) {
    table.push_back(at::empty(b.like_rows ? rows : at::IntArrayRef(b.sizes), options.dtype(b.dtype)));
  }
  auto stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const Driver& cu = driver();
  cu.ensure_context(device.index());
  std::array<uint64_t, 64> values;
  std::array<void*, 64> params;
  for (const auto& l : p.launches) {
    size_t i = 0;
    for (const auto& s : l.slots) {
      uint64_t v = 0;
      switch (s.kind) {
        case PTR:
          v = reinterpret_cast<uint64_t>(table[s.table].data_ptr()) + s.value;
          break;
        case I32: {
          int32_t x = static_cast<int32_t>(s.value);
          std::memcpy(&v, &x, sizeof x);
          break;
        }
        case U32: {
          uint32_t x = static_cast<uint32_t>(s.value);
          std::memcpy(&v, &x, sizeof x);
          break;
        }
        case SCALAR_F32:
          std::memcpy(&v, &scalar, sizeof scalar);
          break;
        case NULLPTR:
          break;
        default:  // I64, U64
          v = static_cast<uint64_t>(s.value);
      }
      values[i] = v;
      params[i] = &values[i];
      ++i;
    }
    int r = cu.launch(l.function, l.grid[0], l.grid[1], l.grid[2], l.threads, 1, 1, l.shared,
                        stream, params.data(), nullptr);
    TORCH_CHECK(r == 0, "xpuruntime: launching ", l.name, " failed (CUresult ", r, ")");
  }
  std::vector<at::Tensor> out;
  out.reserve(p.outputs.size());
  for (const auto& o : p.outputs) {
    const auto& t = table[o.table];
    out.push_back(o.whole ? t : t.as_strided(o.sizes, o.strides, t.storage_offset() + o.offset));
  }
  return out;
}

bool plain_cuda(const at::Tensor& t) {
  static const auto wrapped = c10::DispatchKeySet({
      c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
      c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchGradWrapper,
      c10::DispatchKey::Functionalize, c10::DispatchKey::BatchedNestedTensor,
  });
  return t.is_cuda() && t.layout() == at::kStrided && (t.key_set() & wrapped).empty();
}

struct Plan;

struct RecordedBackward : public Node {
  std::shared_ptr<const Plan> plan;
  std::vector<SavedVariable> saved;
  std::vector<int64_t> rows;                  // the row input's shape
  std::vector<std::vector<int64_t>> result_sizes;
  std::vector<at::ScalarType> result_dtypes;
  at::Device device{at::kCUDA};

  variable_list apply(variable_list&& grads) override;
  std::string name() const override;
  void release_variables() override {
    for (auto& s : saved) s.reset_data();
  }
};

struct Plan : std::enable_shared_from_this<Plan> {
  std::string name;
  int device_index;
  Program forward, backward;
  int results;                              // the forward's first outputs are the op's results
  at::ScalarType out_dtype;                 // the output dtype the call asked for
  std::vector<std::optional<at::ScalarType>> input_dtypes;  // nullopt: input absent
  std::vector<std::vector<int64_t>> input_sizes;
  // Per input: its strides where the plan was derived from a strided view (empty:
  // contiguous), which every call must then match exactly.
  std::vector<std::vector<int64_t>> input_strides;
  std::vector<int> saved;                   // forward table entries the backward reads
  std::vector<bool> saved_is_result;
  std::vector<int> grad_of_input;           // per input: backward output, or -1
  bool differentiable;                      // without a backward: no node, ever
  // Per result: the strides its gradient was derived with, which the backward's launches
  // read it by (empty: contiguous). A gradient laid out otherwise is copied to them.
  std::vector<std::vector<int64_t>> grad_strides;

  // The op on a call's inputs, or None where this plan does not take the call (the caller
  // then runs the Python launchers, which take any call).
  py::object call(const at::Tensor& x, const std::optional<at::Tensor>& a,
                  const std::optional<at::Tensor>& b, const std::optional<at::Tensor>& c,
                  double scalar, at::ScalarType requested) const {
    std::array<const at::Tensor*, 4> given = {&x, a ? &*a : nullptr, b ? &*b : nullptr,
                                              c ? &*c : nullptr};
    if (requested != out_dtype) return py::none();
    if (c10::cuda::current_device() != device_index) return py::none();
    if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
      return py::none();
    }
    std::vector<at::Tensor> table;
    table.reserve(forward.inputs + forward.buffers.size());
    bool grad = false;
    for (int i = 0; i < forward.inputs; ++i) {
      const at::Tensor* t = given[i];
      if (t == nullptr || !t->defined()) {
        if (input_dtypes[i]) return py::none();
        table.emplace_back();
        continue;
      }
      if (!input_dtypes[i] || t->scalar_type() != *input_dtypes[i] || !plain_cuda(*t) ||
          t->device().index() != device_index || t->sizes() != at::IntArrayRef(input_sizes[i]) ||
          (input_strides[i].empty() ? !t->is_contiguous()
                                    : t->strides() != at::IntArrayRef(input_strides[i])) ||
          (reinterpret_cast<uintptr_t>(t->data_ptr()) & 15) != 0) {
        return py::none();
      }
      // A forward-mode tangent: the plan's node has no jvp, and would drop it silently.
      if (t->_fw_grad(/*level=*/0).defined()) return py::none();
      grad = grad || t->requires_grad();
      table.push_back(*t);
    }
    grad = grad && at::GradMode::is_enabled();
    if (grad && !differentiable) return py::none();
    at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index));
    std::vector<at::Tensor> outputs;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      outputs = run(forward, table, x.sizes(), static_cast<float>(scalar), device);
    }
    outputs.resize(results);
    if (grad) {
      auto node = xpuruntime::make_node<RecordedBackward>();
      node->plan = shared_from_this();
      node->rows = x.sizes().vec();
      node->device = device;
      std::vector<at::Tensor> inputs;
      for (int i = 0; i < forward.inputs; ++i) inputs.push_back(table[i]);
      node->set_next_edges(torch::autograd::collect_next_edges(inputs));
      for (auto& o : outputs) {
        node->result_sizes.push_back(o.sizes().vec());
        node->result_dtypes.push_back(o.scalar_type());
        torch::autograd::set_history(o, node);
      }
      // Saved once the results have their node: a saved result refers to it weakly.
      for (size_t i = 0; i < saved.size(); ++i) {
        node->saved.emplace_back(table[saved[i]], static_cast<bool>(saved_is_result[i]));
      }
    }
    if (results == 1) return py::cast(outputs[0]);
    py::tuple tuple(results);
    for (int i = 0; i < results; ++i) tuple[i] = py::cast(outputs[i]);
    return tuple;
  }
};

std::string RecordedBackward::name() const { return plan->name; }

// Whether `t` has `strides` in every dim of more than one element (a dim of one is read
// at index 0 only, whatever its stride).
bool laid_out_as(const at::Tensor& t, const std::vector<int64_t>& strides) {
  if (t.dim() != static_cast<int64_t>(strides.size())) return false;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1 && t.stride(d) != strides[d]) return false;
  }
  return true;
}

variable_list RecordedBackward::apply(variable_list&& grads) {
  if (at::GradMode::is_enabled()) xpuruntime::refuse_recorded_backward(plan->name);
  const Plan& p = *plan;
  variable_list out(p.forward.inputs);
  bool any = false;
  for (const auto& g : grads) any = any || g.defined();
  if (!any) return out;
  std::vector<at::Tensor> table;
  table.reserve(p.backward.inputs + p.backward.buffers.size());
  at::AutoDispatchBelowADInplaceOrView below;
  for (size_t i = 0; i < grads.size(); ++i) {
    at::Tensor g = grads[i];
    const auto& strides = p.grad_strides[i];
    if (!g.defined()) {
      auto options = at::TensorOptions().device(device).dtype(result_dtypes[i]);
      g = strides.empty() ? at::zeros(result_sizes[i], options)
                          : at::empty_strided(result_sizes[i], strides, options).zero_();
    } else {
      if (g.scalar_type() != result_dtypes[i]) g = g.to(result_dtypes[i]);
      if (strides.empty()) {
        g = g.contiguous();
      } else if (!laid_out_as(g, strides)) {
        g = at::empty_strided(result_sizes[i], strides, g.options()).copy_(g);
      }
      if ((reinterpret_cast<uintptr_t>(g.data_ptr()) & 15) != 0) g = g.clone();
    }
    table.push_back(std::move(g));
  }
  for (const auto& s : saved) table.push_back(s.unpack(xpuruntime::self_ref(this)));
  auto results = run(p.backward, table, rows, 0.0f, device);
  for (int i = 0; i < p.forward.inputs; ++i) {
    int j = p.grad_of_input[i];
    if (j < 0) continue;
    out[i] = results[j];
  }
  return out;
}

std::shared_ptr<Plan> make_plan(const std::string& name, int device_index,
                                const py::tuple& forward, const py::tuple& backward, int results,
                                at::ScalarType out_dtype,
                                std::vector<std::optional<at::ScalarType>> input_dtypes,
                                std::vector<std::vector<int64_t>> input_sizes,
                                std::vector<std::vector<int64_t>> input_strides,
                                std::vector<int> saved,
                                std::vector<bool> saved_is_result, std::vector<int> grad_of_input,
                                bool differentiable,
                                std::vector<std::vector<int64_t>> grad_strides) {
  TORCH_CHECK(driver().ready(), "libcuda.so.1's launch entry points were not found");
  auto plan = std::make_shared<Plan>();
  plan->name = name;
  plan->device_index = device_index;
  plan->forward = program_from(forward);
  plan->backward = program_from(backward);
  plan->results = results;
  plan->out_dtype = out_dtype;
  plan->input_dtypes = std::move(input_dtypes);
  plan->input_sizes = std::move(input_sizes);
  plan->input_strides = std::move(input_strides);
  plan->saved = std::move(saved);
  plan->saved_is_result = std::move(saved_is_result);
  plan->grad_of_input = std::move(grad_of_input);
  plan->differentiable = differentiable;
  plan->grad_strides = std::move(grad_strides);
  plan->grad_strides.resize(results);
  TORCH_CHECK(plan->forward.inputs >= 1 && plan->forward.inputs <= 4, "1 to 4 inputs");
  return plan;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Plan, std::shared_ptr<Plan>>(m, "Plan")
      .def("__call__", &Plan::call, py::arg("x"), py::arg("a") = py::none(),
           py::arg("b") = py::none(), py::arg("c") = py::none(), py::arg("scalar") = 0.0,
           py::arg("out_dtype"))
      .def_readonly("name", &Plan::name);
  m.def("make_plan", &make_plan);
}
