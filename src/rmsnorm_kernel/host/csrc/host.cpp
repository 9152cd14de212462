// The compiled host path of the common call (contiguous x, a contiguous 1-D weight or none, on
// CUDA; with or without a contiguous residual of x's shape): the operators
// rmsnorm_kernel_host::rms_norm and ::rms_norm_residual (CUDA, Meta and Autograd kernels) launch
// the compiled Triton kernels through the driver, so an eager call does not enter Python. Their
// Python entry, common_call, is rms_norm's first step once loaded: the fast path's tests (the
// contract's, handed over at load), then the operator. A call looks its launch plan up by what
// the plan depends on (device, dtypes, M, N, eps, offset, casting, outputs, alignment); a key's
// first call runs the Python path, which records its launches (launch.record) as the plan that
// later calls replay with cuLaunchKernelEx: same kernels, same parameters, bitwise the same.

#include <torch/extension.h>
#include <torch/library.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/SmallVector.h>

#include <dlfcn.h>

#include <array>
#include <cmath>
#include <cstring>
#include <string>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "cuda.h"  // the driver API header that Triton ships with its NVIDIA backend

namespace py = pybind11;
using torch::Tensor;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

namespace {

// ---------------------------------------------------------------------------------------------
// The driver's launch entry point, resolved once (as Triton's launcher does)
// ---------------------------------------------------------------------------------------------

using LaunchKernelEx = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);
using GetErrorString = CUresult (*)(CUresult, const char**);

struct Driver {
  LaunchKernelEx launch = nullptr;
  GetErrorString error_string = nullptr;
  Driver() {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(lib != nullptr, "rmsnorm_kernel host path: cannot open libcuda.so.1");
    launch = reinterpret_cast<LaunchKernelEx>(dlsym(lib, "cuLaunchKernelEx"));
    error_string = reinterpret_cast<GetErrorString>(dlsym(lib, "cuGetErrorString"));
    TORCH_CHECK(launch != nullptr, "rmsnorm_kernel host path: libcuda.so.1 has no cuLaunchKernelEx");
  }
};

const Driver& driver() {
  static Driver d;
  return d;
}

// ---------------------------------------------------------------------------------------------
// Plans
// ---------------------------------------------------------------------------------------------

// A kernel parameter: the data pointer of slot `slot` (slot >= 0), or `size` bytes of `bits`.
struct Param {
  int32_t slot;
  uint32_t size;
  uint64_t bits;
};

struct Launch {
  CUfunction function;
  std::array<unsigned, 3> grid;
  unsigned threads;
  unsigned shared;
  bool cooperative;
  bool pdl;
  std::vector<Param> params;
};

struct Scratch {
  int64_t numel;
  at::ScalarType dtype;
  bool zero;
};

struct Plan {
  std::vector<Scratch> scratch;
  std::vector<Launch> launches;
};

using PlanPtr = std::shared_ptr<const Plan>;

// A plan's fixed slots, in host/__init__.py's order (its planners list them so); scratch slots follow.
// Forward: x, w, y, r, residual, h. Backward: dy, x (h with a residual), w, r, dx, dw, dh.
constexpr int32_t FORWARD_SLOTS = 6, BACKWARD_SLOTS = 7;

using Key = std::array<int64_t, 14>;

struct KeyHash {
  size_t operator()(const Key& k) const noexcept {
    size_t h = 1469598103934665603ull;
    for (int64_t v : k) h = (h ^ static_cast<size_t>(v)) * 1099511628211ull;
    return h;
  }
};

// Plans by key, per direction. A key whose launches could not be recorded maps to nullptr: its
// calls keep taking the Python path. Cleared when it reaches MAX_PLANS keys (many distinct M).
constexpr size_t MAX_PLANS = 4096;

struct PlanCache {
  std::mutex mutex;
  std::unordered_map<Key, PlanPtr, KeyHash> plans;

  bool find(const Key& key, PlanPtr* plan) {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = plans.find(key);
    if (it == plans.end()) return false;
    *plan = it->second;
    return true;
  }
  void put(const Key& key, PlanPtr plan) {
    std::lock_guard<std::mutex> lock(mutex);
    if (plans.size() >= MAX_PLANS) plans.clear();
    plans[key] = std::move(plan);
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mutex);
    return plans.size();
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mutex);
    plans.clear();
  }
};

PlanCache forward_plans, backward_plans;

// Calls that ran here (not through Python): ops.CALLS adds them to its own counts.
std::atomic<int64_t> forward_calls{0}, backward_calls{0};

// Python callables set by host/__init__.py: (forward planner, backward planner, composite backward).
// Never destroyed: they must outlive the interpreter's teardown of this module.
py::object* plan_forward_fn = nullptr;
py::object* plan_backward_fn = nullptr;
py::object* composite_backward_fn = nullptr;

PlanPtr parse_plan(const py::handle& obj, int32_t fixed_slots) {
  if (obj.is_none()) return nullptr;
  auto plan = std::make_shared<Plan>();
  auto t = obj.cast<py::tuple>();
  for (auto s : t[0].cast<py::list>()) {
    auto st = s.cast<py::tuple>();
    plan->scratch.push_back(
        {st[0].cast<int64_t>(), static_cast<at::ScalarType>(st[1].cast<int64_t>()), st[2].cast<bool>()});
  }
  for (auto l : t[1].cast<py::list>()) {
    auto lt = l.cast<py::tuple>();
    Launch launch;
    launch.function = reinterpret_cast<CUfunction>(lt[0].cast<uint64_t>());
    launch.grid = {lt[1].cast<unsigned>(), lt[2].cast<unsigned>(), lt[3].cast<unsigned>()};
    launch.threads = lt[4].cast<unsigned>();
    launch.shared = lt[5].cast<unsigned>();
    launch.cooperative = lt[6].cast<bool>();
    launch.pdl = lt[7].cast<bool>();
    for (auto p : lt[8].cast<py::list>()) {
      auto pt = p.cast<py::tuple>();
      uint32_t size = pt[1].cast<uint32_t>();
      TORCH_CHECK(size == 1 || size == 2 || size == 4 || size == 8, "host path: parameter size ", size);
      const int32_t slot = pt[0].cast<int32_t>();
      TORCH_CHECK(slot < fixed_slots + static_cast<int32_t>(plan->scratch.size()), "host path: slot ", slot);
      launch.params.push_back({slot, size, pt[2].cast<uint64_t>()});
    }
    plan->launches.push_back(std::move(launch));
  }
  return plan;
}

bool aligned(const Tensor& t) {
  return t.defined() && (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0;
}

int64_t bits_of(double v) {
  int64_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

// Fixed slots, then the plan's scratch buffers: no heap allocation for the usual few.
using Slots = c10::SmallVector<void*, 12>;

// Allocates the plan's scratch after the fixed slots and issues its launches on the current
// stream of `opts`' device. The scratch tensors die on return: the caching allocator orders their
// reuse on this stream after the launches.
void run_plan(const Plan& plan, Slots& slots, const at::TensorOptions& opts) {
  c10::SmallVector<Tensor, 4> keep;
  for (const Scratch& s : plan.scratch) {
    Tensor t = s.zero ? at::zeros({s.numel}, opts.dtype(s.dtype)) : at::empty({s.numel}, opts.dtype(s.dtype));
    slots.push_back(t.data_ptr());
    keep.push_back(std::move(t));
  }
  const c10::Device device = opts.device();
  CUstream stream = static_cast<CUstream>(
      c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device).native_handle());
  const Driver& d = driver();
  for (const Launch& l : plan.launches) {
    // Parameter values, each in an 8-byte cell; params[] points at them as the kernel expects.
    uint64_t values[32];
    void* params[34];
    size_t n = l.params.size();
    TORCH_CHECK(n <= 32, "host path: too many kernel parameters");
    for (size_t i = 0; i < n; ++i) {
      const Param& p = l.params[i];
      if (p.slot >= 0) {
        values[i] = reinterpret_cast<uint64_t>(slots[p.slot]);
      } else {
        values[i] = p.bits;  // little-endian: the low `size` bytes are the value
      }
      params[i] = &values[i];
    }
    // Triton's kernels take two more: the global and profile scratch pointers (none here).
    uint64_t global_scratch = 0, profile_scratch = 0;
    params[n] = &global_scratch;
    params[n + 1] = &profile_scratch;
    if (l.grid[0] * l.grid[1] * l.grid[2] == 0) continue;
    CUlaunchAttribute attrs[2];
    unsigned num_attrs = 0;
    if (l.pdl) {
      attrs[num_attrs].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
      attrs[num_attrs].value.programmaticStreamSerializationAllowed = 1;
      ++num_attrs;
    }
    if (l.cooperative) {
      attrs[num_attrs].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
      attrs[num_attrs].value.cooperative = 1;
      ++num_attrs;
    }
    CUlaunchConfig config;
    std::memset(&config, 0, sizeof config);
    config.gridDimX = l.grid[0];
    config.gridDimY = l.grid[1];
    config.gridDimZ = l.grid[2];
    config.blockDimX = l.threads;
    config.blockDimY = 1;
    config.blockDimZ = 1;
    config.sharedMemBytes = l.shared;
    config.hStream = stream;
    config.attrs = attrs;
    config.numAttrs = num_attrs;
    CUresult status = d.launch(&config, l.function, params, nullptr);
    if (status != CUDA_SUCCESS) {
      const char* message = "unknown error";
      if (d.error_string != nullptr) d.error_string(status, &message);
      TORCH_CHECK(false, "rmsnorm_kernel host path: kernel launch failed: ", message);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Forward and backward
// ---------------------------------------------------------------------------------------------

// A residual's part of a key (0 without one): its dtype, h's and its alignment.
int64_t residual_bits(const Tensor& res, at::ScalarType h_dtype) {
  if (!res.defined()) return 0;
  return 1 | static_cast<int64_t>(aligned(res)) << 1 | static_cast<int64_t>(res.scalar_type()) << 2 |
         static_cast<int64_t>(h_dtype) << 10;
}

Key forward_key(const Tensor& x, const Tensor& w, const Tensor& res, int64_t m, int64_t n, double eps,
                double offset, int64_t casting, at::ScalarType out_dtype, at::ScalarType h_dtype, bool want_rstd) {
  return {0,
          x.get_device(),
          static_cast<int64_t>(x.scalar_type()),
          w.defined() ? static_cast<int64_t>(w.scalar_type()) : -1,
          m,
          n,
          static_cast<int64_t>(out_dtype),
          casting,
          bits_of(eps),
          bits_of(offset),
          want_rstd,
          aligned(x),
          w.defined() ? aligned(w) : 0,
          residual_bits(res, h_dtype)};
}

// Where the plan cache does not serve a call, the Python path runs it: `record` says whether it
// also records its launches as the key's plan (a key seen for the first time), and `finish`
// stores what it recorded. M = 0 launches nothing and is never planned.
struct Lookup {
  PlanPtr plan;
  bool record = false;
};

Lookup lookup(PlanCache& cache, const Key& key, int64_t m) {
  Lookup found;
  if (m == 0) return found;
  found.record = !cache.find(key, &found.plan);
  return found;
}

// `out` is a planner's result: the call's outputs, then the plan (or None).
void finish(PlanCache& cache, const Key& key, const Lookup& found, const py::tuple& out, int32_t fixed_slots) {
  if (found.record) cache.put(key, parse_plan(out[out.size() - 1], fixed_slots));
}

Tensor tensor_or_undefined(const py::handle& obj) { return obj.is_none() ? Tensor() : obj.cast<Tensor>(); }

py::object object_or_none(const Tensor& t) { return t.defined() ? py::cast(t) : py::none(); }

// y in out_dtype with x's shape; r (fp32, x's shape less the last dim; undefined without
// want_rstd); h = x + residual in h_dtype (undefined without a residual). x is contiguous on
// CUDA, w contiguous 1-D of N elements or undefined, res contiguous in x's shape or undefined.
std::tuple<Tensor, Tensor, Tensor> run_forward(const Tensor& x, const Tensor& w, const Tensor& res, double eps,
                                               double offset, int64_t casting, at::ScalarType out_dtype,
                                               at::ScalarType h_dtype, bool want_rstd) {
  const int64_t n = x.size(-1);
  const int64_t m = x.numel() / n;
  const c10::DeviceGuard guard(x.device());
  const Key key = forward_key(x, w, res, m, n, eps, offset, casting, out_dtype, h_dtype, want_rstd);
  const Lookup found = lookup(forward_plans, key, m);
  if (found.plan == nullptr) {
    py::gil_scoped_acquire gil;
    py::tuple out = (*plan_forward_fn)(x, object_or_none(w), object_or_none(res), eps, offset, casting,
                                       static_cast<int64_t>(out_dtype), static_cast<int64_t>(h_dtype),
                                       want_rstd, found.record);
    finish(forward_plans, key, found, out, FORWARD_SLOTS);
    return {out[0].cast<Tensor>(), tensor_or_undefined(out[1]), tensor_or_undefined(out[2])};
  }
  const at::TensorOptions opts = x.options();
  Tensor y = at::empty(x.sizes(), opts.dtype(out_dtype));
  Tensor rstd = want_rstd ? at::empty(x.sizes().slice(0, x.dim() - 1), opts.dtype(at::kFloat)) : Tensor();
  Tensor h = res.defined() ? at::empty(x.sizes(), opts.dtype(h_dtype)) : Tensor();
  Slots slots = {x.data_ptr(),
                 w.defined() ? w.data_ptr() : nullptr,
                 y.data_ptr(),
                 want_rstd ? rstd.data_ptr() : nullptr,
                 res.defined() ? res.data_ptr() : nullptr,
                 res.defined() ? h.data_ptr() : nullptr};
  run_plan(*found.plan, slots, opts);
  forward_calls.fetch_add(1, std::memory_order_relaxed);
  return {y, rstd, h};
}

Key backward_key(const Tensor& dy, const Tensor& dh, const Tensor& x, const Tensor& w, const Tensor& rstd,
                 int64_t m, int64_t n, double offset, int64_t casting, bool need_dw, at::ScalarType dx_dtype) {
  return {1,
          x.get_device(),
          static_cast<int64_t>(dy.scalar_type()),
          static_cast<int64_t>(x.scalar_type()),
          w.defined() ? static_cast<int64_t>(w.scalar_type()) : -1,
          m,
          n,
          static_cast<int64_t>(dx_dtype),
          casting,
          bits_of(offset),
          need_dw,
          aligned(dy) | aligned(x) << 1 | aligned(rstd) << 2,
          w.defined() ? aligned(w) : 0,
          dh.defined() ? 1 | aligned(dh) << 1 | static_cast<int64_t>(dh.scalar_type()) << 2 : 0};
}

// A gradient as the kernels read it: a negative view resolved (its memory holds -dy), contiguous.
Tensor readable(const Tensor& t) {
  if (!t.defined()) return t;
  const Tensor r = t.is_neg() ? t.resolve_neg() : t;
  return r.is_contiguous() ? r : r.contiguous();
}

// dx (x's shape, dx_dtype; with dh, the gradient reaching h added) and dw (N, the weight's dtype;
// undefined unless need_dw). x is h where the forward had a residual.
std::pair<Tensor, Tensor> run_backward(const Tensor& dy_in, const Tensor& dh_in, const Tensor& x, const Tensor& w,
                                       const Tensor& rstd, double offset, int64_t casting, bool need_dw,
                                       at::ScalarType dx_dtype) {
  const Tensor dy = readable(dy_in), dh = readable(dh_in);
  const int64_t n = x.size(-1);
  const int64_t m = x.numel() / n;
  const bool compute_dw = need_dw && w.defined();
  const c10::DeviceGuard guard(x.device());
  const Key key = backward_key(dy, dh, x, w, rstd, m, n, offset, casting, compute_dw, dx_dtype);
  const Lookup found = lookup(backward_plans, key, m);
  if (found.plan == nullptr) {
    py::gil_scoped_acquire gil;
    py::tuple out = (*plan_backward_fn)(dy, object_or_none(dh), x, object_or_none(w), rstd, offset, casting,
                                        compute_dw, static_cast<int64_t>(dx_dtype), found.record);
    finish(backward_plans, key, found, out, BACKWARD_SLOTS);
    return {out[0].cast<Tensor>(), tensor_or_undefined(out[1])};
  }
  const at::TensorOptions opts = x.options();
  Tensor dx = at::empty(x.sizes(), opts.dtype(dx_dtype));
  Tensor dw = compute_dw ? at::empty({n}, opts.dtype(w.scalar_type())) : Tensor();
  Slots slots = {dy.data_ptr(),
                 x.data_ptr(),
                 w.defined() ? w.data_ptr() : nullptr,
                 rstd.data_ptr(),
                 dx.data_ptr(),
                 compute_dw ? dw.data_ptr() : nullptr,
                 dh.defined() ? dh.data_ptr() : nullptr};
  run_plan(*found.plan, slots, opts);
  backward_calls.fetch_add(1, std::memory_order_relaxed);
  return {dx, dw};
}

// ---------------------------------------------------------------------------------------------
// The operator: its backward node, its Autograd and CUDA kernels, its registration
// ---------------------------------------------------------------------------------------------

// Calls this path must hand to the dispatcher: under a Python dispatch mode, or with a meta tensor
// or one behind the Python key (a fake tensor, a subclass), whose data it cannot read. Their
// forward goes below autograd through the dispatcher (the mode's or subclass's handler, or the
// Meta kernel); r is not computed, so their backward is the composite's torch ops.
// A functorch wrapper, or a tensor batched by autograd's own vmap (is_grads_batched): no data
// to point at.
bool in_functorch(const Tensor& t) {
  constexpr auto functorch = c10::DispatchKeySet(
      {c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::Batched});
  return t.defined() && t.key_set().has_any(functorch);
}

// A backward the kernels cannot run (ops._composite_backward_needed): one that builds a graph
// (create_graph=True), one whose forward took the dispatcher (no r), or a batched gradient
// (is_grads_batched, jacobian(vectorize=True): a functorch wrapper has no data to point at).
bool composite_backward_needed(const Tensor& rstd, const Tensor& dy, const Tensor& dh) {
  return at::GradMode::is_enabled() || !rstd.defined() || in_functorch(dy) || in_functorch(dh);
}

bool without_data(const Tensor& t) {
  return t.defined() && (t.is_meta() || t.key_set().has(c10::DispatchKey::Python));
}

bool to_dispatcher(std::initializer_list<const Tensor*> tensors) {
  if (c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::Python)) return true;
  for (const Tensor* t : tensors) {
    if (without_data(*t)) return true;
  }
  return false;
}

// create_graph=True: the differentiable torch formula (ops._backward_composite), (dx, dw).
std::pair<Tensor, Tensor> composite_backward(const Tensor& dy, const Tensor& dh, const Tensor& x, const Tensor& w,
                                             double eps, double offset, int64_t casting, bool need_dw,
                                             at::ScalarType dx_dtype) {
  py::gil_scoped_acquire gil;
  py::tuple out = (*composite_backward_fn)(dy, object_or_none(dh), x, object_or_none(w), eps, offset, casting,
                                           need_dw, static_cast<int64_t>(dx_dtype));
  return {out[0].cast<Tensor>(), tensor_or_undefined(out[1])};
}

// The backward node, as torch's own are built: saved variables and plain fields, no context
// object. The gradient wrt x is edge 0, wrt the weight edge 1 (invalid without a weight).
struct RmsNormBackward : public torch::autograd::Node {
  SavedVariable x_, w_, rstd_;
  double eps_ = 0.0, offset_ = 0.0;
  int64_t casting_ = 0;

  std::string name() const override { return "RmsNormBackward"; }

  void release_variables() override {
    x_.reset_data();
    w_.reset_data();
    rstd_.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    const Tensor x = x_.unpack(), w = w_.unpack(), rstd = rstd_.unpack();
    const bool need_x = task_should_compute_output(0);
    const bool need_dw = w.defined() && task_should_compute_output(1);
    const Tensor& dy = grads[0];
    Tensor dx, dw;
    if (!dy.defined() || !(need_x || need_dw)) {
      // no gradient reached y, or none is wanted
    } else if (composite_backward_needed(rstd, dy, Tensor())) {
      std::tie(dx, dw) = composite_backward(dy, Tensor(), x, w, eps_, offset_, casting_, need_dw, x.scalar_type());
    } else {
      std::tie(dx, dw) = run_backward(dy, Tensor(), x, w, rstd, offset_, casting_, need_dw, x.scalar_type());
    }
    return {need_x ? dx : Tensor(), need_dw ? dw : Tensor()};
  }
};

// Nodes are owned by std::shared_ptr in some torch releases and by c10::intrusive_ptr in later
// ones; an edge's pointer type says which.
using NodePtr = decltype(torch::autograd::Edge::function);

template <typename T, typename Ptr>
struct NodeMaker;

template <typename T>
struct NodeMaker<T, std::shared_ptr<torch::autograd::Node>> {
  static std::shared_ptr<T> make() { return std::make_shared<T>(); }
};

template <typename T>
struct NodeMaker<T, c10::intrusive_ptr<torch::autograd::Node>> {
  static c10::intrusive_ptr<T> make() { return c10::make_intrusive<T>(); }
};

using Signature = Tensor(const Tensor&, const std::optional<Tensor>&, double, double, int64_t, at::ScalarType);

const c10::TypedOperatorHandle<Signature>& rms_norm_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("rmsnorm_kernel_host::rms_norm", "").typed<Signature>();
  return op;
}

using ResidualSignature = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const std::optional<Tensor>&,
                                                      double, double, int64_t, at::ScalarType, at::ScalarType);

const c10::TypedOperatorHandle<ResidualSignature>& rms_norm_residual_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("rmsnorm_kernel_host::rms_norm_residual", "")
                             .typed<ResidualSignature>();
  return op;
}

// Below autograd (no grad wanted, inference mode): y only, r not stored.
Tensor rms_norm_cuda(const Tensor& x, const std::optional<Tensor>& weight, double eps, double offset,
                     int64_t casting, at::ScalarType out_dtype) {
  const Tensor w = weight.has_value() ? *weight : Tensor();
  return std::get<0>(run_forward(x, w, Tensor(), eps, offset, casting, out_dtype, out_dtype, false));
}

// The Autograd kernel, shaped like torch's generated ones: a node where x or the weight needs a
// gradient, the forward below autograd, then y's history and the saved variables.
Tensor rms_norm_autograd(const Tensor& x, const std::optional<Tensor>& weight, double eps, double offset,
                         int64_t casting, at::ScalarType out_dtype) {
  const Tensor w = weight.has_value() ? *weight : Tensor();
  // The kernels compute no tangent: a dual tensor would get a y without one. rms_norm sends such
  // calls to torch ops before they reach this operator; a direct call is refused.
  TORCH_CHECK(!x._fw_grad(0).defined() && !(w.defined() && w._fw_grad(0).defined()),
              "rmsnorm_kernel_host::rms_norm: forward-mode AD (a dual tensor) is not supported here; "
              "rmsnorm_kernel.rms_norm runs it in torch ops");
  decltype(NodeMaker<RmsNormBackward, NodePtr>::make()) grad_fn;
  if (torch::autograd::compute_requires_grad(x, w)) {
    grad_fn = NodeMaker<RmsNormBackward, NodePtr>::make();
    grad_fn->set_next_edges(torch::autograd::collect_next_edges(x, w));
  }
  Tensor y, rstd;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    if (to_dispatcher({&x, &w})) {
      y = rms_norm_op().call(x, weight, eps, offset, casting, out_dtype);
    } else {
      std::tie(y, rstd, std::ignore) =
          run_forward(x, w, Tensor(), eps, offset, casting, out_dtype, out_dtype, grad_fn != nullptr);
    }
  }
  if (grad_fn) {
    torch::autograd::set_history(y, grad_fn);
    grad_fn->x_ = SavedVariable(x, false);
    grad_fn->w_ = SavedVariable(w, false);
    grad_fn->rstd_ = SavedVariable(rstd, false);
    grad_fn->eps_ = eps;
    grad_fn->offset_ = offset;
    grad_fn->casting_ = casting;
  }
  return y;
}

// The residual call's backward node: h = x + residual was normalised and returned, so both y's
// and h's gradients arrive (either may be undefined). The gradient reaching h is dy's through the
// normalisation plus dh, computed in the promoted dtype of x and the residual (ops._grads's
// rule) and handed to both. Edges: x 0, the weight 1, the residual 2.
struct RmsNormResidualBackward : public torch::autograd::Node {
  SavedVariable h_, w_, rstd_;
  double eps_ = 0.0, offset_ = 0.0;
  int64_t casting_ = 0;
  at::ScalarType x_dtype_ = at::kFloat, res_dtype_ = at::kFloat;

  std::string name() const override { return "RmsNormResidualBackward"; }

  void release_variables() override {
    h_.reset_data();
    w_.reset_data();
    rstd_.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    const Tensor h = h_.unpack(getptr()), w = w_.unpack(), rstd = rstd_.unpack();
    const bool need_x = task_should_compute_output(0);
    bool need_dw = w.defined() && task_should_compute_output(1);
    const bool need_res = task_should_compute_output(2);
    const Tensor& dy = grads[0];
    const Tensor& dh = grads[1];
    if (!(need_x || need_dw || need_res) || (!dy.defined() && !dh.defined())) {
      return {Tensor(), Tensor(), Tensor()};
    }
    const at::ScalarType dx_dtype = at::promote_types(x_dtype_, res_dtype_);
    Tensor dxh, dw;
    if (!dy.defined()) {  // only h was used downstream: its gradient passes straight through
      dxh = dh.to(dx_dtype);
      need_dw = false;
    } else if (composite_backward_needed(rstd, dy, dh)) {
      std::tie(dxh, dw) = composite_backward(dy, dh, h, w, eps_, offset_, casting_, need_dw, dx_dtype);
    } else {
      std::tie(dxh, dw) = run_backward(dy, dh, h, w, rstd, offset_, casting_, need_dw, dx_dtype);
    }
    Tensor dx = need_x ? (dx_dtype == x_dtype_ ? dxh : dxh.to(x_dtype_)) : Tensor();
    Tensor dres = need_res ? (dx_dtype == res_dtype_ ? dxh : dxh.to(res_dtype_)) : Tensor();
    return {dx, need_dw ? dw : Tensor(), dres};
  }
};

std::tuple<Tensor, Tensor> rms_norm_residual_cuda(const Tensor& x, const Tensor& residual,
                                                  const std::optional<Tensor>& weight, double eps, double offset,
                                                  int64_t casting, at::ScalarType out_dtype,
                                                  at::ScalarType residual_dtype) {
  const Tensor w = weight.has_value() ? *weight : Tensor();
  auto [y, rstd, h] = run_forward(x, w, residual, eps, offset, casting, out_dtype, residual_dtype, false);
  return {y, h};
}

// As rms_norm_autograd, with y and h as the node's outputs 0 and 1 and h saved in place of x.
std::tuple<Tensor, Tensor> rms_norm_residual_autograd(const Tensor& x, const Tensor& residual,
                                                      const std::optional<Tensor>& weight, double eps,
                                                      double offset, int64_t casting, at::ScalarType out_dtype,
                                                      at::ScalarType residual_dtype) {
  const Tensor w = weight.has_value() ? *weight : Tensor();
  TORCH_CHECK(!x._fw_grad(0).defined() && !residual._fw_grad(0).defined() &&
                  !(w.defined() && w._fw_grad(0).defined()),
              "rmsnorm_kernel_host::rms_norm_residual: forward-mode AD (a dual tensor) is not supported here; "
              "rmsnorm_kernel.rms_norm runs it in torch ops");
  decltype(NodeMaker<RmsNormResidualBackward, NodePtr>::make()) grad_fn;
  if (torch::autograd::compute_requires_grad(x, w, residual)) {
    grad_fn = NodeMaker<RmsNormResidualBackward, NodePtr>::make();
    grad_fn->set_next_edges(torch::autograd::collect_next_edges(x, w, residual));
  }
  Tensor y, rstd, h;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    if (to_dispatcher({&x, &residual, &w})) {
      std::tie(y, h) = rms_norm_residual_op().call(x, residual, weight, eps, offset, casting, out_dtype,
                                                    residual_dtype);
    } else {
      std::tie(y, rstd, h) =
          run_forward(x, w, residual, eps, offset, casting, out_dtype, residual_dtype, grad_fn != nullptr);
    }
  }
  if (grad_fn) {
    torch::autograd::set_history(y, grad_fn);
    torch::autograd::set_history(h, grad_fn);
    grad_fn->h_ = SavedVariable(h, true);  // an output of the node: saved without a cycle
    grad_fn->w_ = SavedVariable(w, false);
    grad_fn->rstd_ = SavedVariable(rstd, false);
    grad_fn->eps_ = eps;
    grad_fn->offset_ = offset;
    grad_fn->casting_ = casting;
    grad_fn->x_dtype_ = x.scalar_type();
    grad_fn->res_dtype_ = residual.scalar_type();
  }
  return {y, h};
}

// The operator's namespace: torch.ops.rmsnorm_kernel_host.rms_norm. One build per process (its
// name hashes this source), so the namespace is registered once.
TORCH_LIBRARY(rmsnorm_kernel_host, m) {
  m.def("rms_norm(Tensor x, Tensor? weight, float eps, float offset, int casting, ScalarType out_dtype) -> Tensor");
  m.def(
      "rms_norm_residual(Tensor x, Tensor residual, Tensor? weight, float eps, float offset, int casting, "
      "ScalarType out_dtype, ScalarType residual_dtype) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(rmsnorm_kernel_host, CUDA, m) {
  m.impl("rms_norm", TORCH_FN(rms_norm_cuda));
  m.impl("rms_norm_residual", TORCH_FN(rms_norm_residual_cuda));
}

// Meta kernels: the CUDA kernels' shapes and dtypes, for meta and fake tensors (torch.compile,
// torch.library.opcheck). y in out_dtype and h in residual_dtype, both x's shape, contiguous.
Tensor rms_norm_meta(const Tensor& x, const std::optional<Tensor>&, double, double, int64_t,
                     at::ScalarType out_dtype) {
  return at::empty_symint(x.sym_sizes(), x.options().dtype(out_dtype));
}

std::tuple<Tensor, Tensor> rms_norm_residual_meta(const Tensor& x, const Tensor&, const std::optional<Tensor>&,
                                                  double, double, int64_t, at::ScalarType out_dtype,
                                                  at::ScalarType residual_dtype) {
  return {at::empty_symint(x.sym_sizes(), x.options().dtype(out_dtype)),
          at::empty_symint(x.sym_sizes(), x.options().dtype(residual_dtype))};
}

TORCH_LIBRARY_IMPL(rmsnorm_kernel_host, Meta, m) {
  m.impl("rms_norm", TORCH_FN(rms_norm_meta));
  m.impl("rms_norm_residual", TORCH_FN(rms_norm_residual_meta));
}

TORCH_LIBRARY_IMPL(rmsnorm_kernel_host, Autograd, m) {
  m.impl("rms_norm", TORCH_FN(rms_norm_autograd));
  m.impl("rms_norm_residual", TORCH_FN(rms_norm_residual_autograd));
}

// The operator's result through the dispatcher (which picks the Autograd kernel where x or the
// weight requires grad). None where this path does not apply (a functorch wrapper): the caller
// takes the Python path.
py::object call_op(const Tensor& x, const std::optional<Tensor>& weight, double eps, double offset,
                   int64_t casting, at::ScalarType out_dtype) {
  if (in_functorch(x) || (weight.has_value() && in_functorch(*weight))) return py::none();
  return py::cast(rms_norm_op().call(x, weight, eps, offset, casting, out_dtype));
}

// The same with a residual: (y, h), or None.
py::object call_residual_op(const Tensor& x, const Tensor& residual, const std::optional<Tensor>& weight, double eps,
                            double offset, int64_t casting, at::ScalarType out_dtype, at::ScalarType residual_dtype) {
  if (in_functorch(x) || in_functorch(residual) || (weight.has_value() && in_functorch(*weight))) {
    return py::none();
  }
  auto [y, h] = rms_norm_residual_op().call(x, residual, weight, eps, offset, casting, out_dtype, residual_dtype);
  return py::make_tuple(y, h);
}

// ---------------------------------------------------------------------------------------------
// The common call's entry: ops._takes_fast_path's tests in C++
// ---------------------------------------------------------------------------------------------

// contract.py's table, handed over once at load (contract.table()): the kernel dtypes as a
// mask of ScalarType codes, the casting modes by name with their code and whether the output
// takes the promoted dtype of x and the weight, and torch's default eps.
struct CastingMode {
  std::string name;
  int64_t code;
  bool promotes;
};
std::vector<CastingMode> casting_modes;
uint64_t kernel_dtypes = 0;
double default_eps = 0.0;
PyTypeObject* parameter_type = nullptr;  // torch.nn.Parameter, the one weight subclass taken

bool kernel_dtype(at::ScalarType t) {
  const auto code = static_cast<uint64_t>(t);
  return code < 64 && (kernel_dtypes >> code & 1);
}

// Not sparse, not nested: what has sizes and strides the kernels can read.
bool dense(const Tensor& t) { return t.layout() == at::kStrided && !t.is_nested(); }

// ops._takes_fast_path's tests, on the same exact types and in the same order, less the
// Python-only "not tracing" (the caller's). Forward-mode AD differs in one way: a dual level
// with no tangent on x or the weight is taken here (the kernels' y is then torch's, which has
// no tangent either), where the Python predicate leaves every call inside a level.
// tests/op/test_validation.py checks that both take the same calls (any_device: CPU tensors too,
// the interpreter's rule). Returns the mode, or nullptr.
const CastingMode* fast_path_mode(PyObject* x, PyObject* ns, PyObject* weight, PyObject* eps, PyObject* residual,
                                  PyObject* residual_dtype, PyObject* offset, PyObject* casting,
                                  PyObject* out_dtype, bool any_device) {
  if (residual != Py_None || residual_dtype != Py_None || out_dtype != Py_None ||
      Py_TYPE(x) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) {
    return nullptr;
  }
  const Tensor& xt = THPVariable_Unpack(x);
  if (!dense(xt)) return nullptr;
  const int64_t n = xt.dim() > 0 ? xt.size(-1) : 0;
  if (ns != Py_None) {  // an int or a 1-tuple of the last dim
    PyObject* v = ns;
    if (PyTuple_CheckExact(v) && PyTuple_GET_SIZE(v) == 1) v = PyTuple_GET_ITEM(v, 0);
    int overflow = 0;
    if (!PyLong_CheckExact(v) || PyLong_AsLongLongAndOverflow(v, &overflow) != n || overflow) return nullptr;
  }
  if (n < 1 || !kernel_dtype(xt.scalar_type()) || xt.is_neg()) return nullptr;
  if ((eps != Py_None && !PyFloat_CheckExact(eps)) || !PyFloat_CheckExact(offset)) return nullptr;
  const double off = PyFloat_AS_DOUBLE(offset);
  if (!std::isfinite(off) || !PyUnicode_CheckExact(casting)) return nullptr;
  Py_ssize_t size = 0;
  const char* name = PyUnicode_AsUTF8AndSize(casting, &size);
  if (name == nullptr) {  // not encodable (a lone surrogate): no mode's name
    PyErr_Clear();
    return nullptr;
  }
  const CastingMode* mode = nullptr;
  for (const auto& m : casting_modes) {
    if (static_cast<Py_ssize_t>(m.name.size()) == size && std::memcmp(m.name.data(), name, size) == 0) mode = &m;
  }
  if (mode == nullptr || !(xt.is_cuda() || (any_device && xt.is_cpu()))) return nullptr;
  const Tensor* w = nullptr;
  if (weight == Py_None) {
    if (off != 0.0) return nullptr;
  } else {
    // exact types only: a subclass sees the call (its __torch_function__ or __torch_dispatch__)
    if (Py_TYPE(weight) != reinterpret_cast<PyTypeObject*>(THPVariableClass) && Py_TYPE(weight) != parameter_type) {
      return nullptr;
    }
    w = &THPVariable_Unpack(weight);
    if (!dense(*w) || w->dim() != 1 || w->size(0) != n || !kernel_dtype(w->scalar_type()) ||
        w->device() != xt.device() || !w->is_contiguous() || w->is_neg()) {
      return nullptr;
    }
  }
  // Route: contiguous x, no functorch transform, no tangent, no autocast, no Python dispatch mode,
  // no TorchScript tracer. (functorch includes its front-mode key while its layer stack is not
  // empty; a dispatch mode includes the Python key)
  if (!xt.is_contiguous() || torch::jit::tracer::isTracing() || c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) ||
      c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::Python)) {
    return nullptr;
  }
  if (xt._fw_grad(0).defined() || (w != nullptr && w->_fw_grad(0).defined())) return nullptr;
  if (!c10::impl::tls_local_dispatch_key_set().excluded_.isSupersetOf(c10::autocast_dispatch_keyset)) return nullptr;
  return mode;
}

// The residual call's route: fast_path_mode's tests on the rest of the call, a residual the
// kernels read as it is (x's exact type, shape and device, contiguous, a kernel dtype, no
// tangent, no Python dispatch), and residual_dtype None or a kernel dtype, which it stores in
// *h_dtype (None: x's dtype). contract.validate accepts every call it takes (tests/op/test_validation.py).
const CastingMode* residual_path_mode(PyObject* x, PyObject* ns, PyObject* weight, PyObject* eps, PyObject* residual,
                                      PyObject* residual_dtype, PyObject* offset, PyObject* casting,
                                      PyObject* out_dtype, bool any_device, at::ScalarType* h_dtype) {
  if (Py_TYPE(residual) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) return nullptr;
  const CastingMode* mode =
      fast_path_mode(x, ns, weight, eps, Py_None, Py_None, offset, casting, out_dtype, any_device);
  if (mode == nullptr) return nullptr;
  const Tensor& xt = THPVariable_Unpack(x);
  const Tensor& rt = THPVariable_Unpack(residual);
  if (!dense(rt) || !kernel_dtype(rt.scalar_type()) || rt.sizes() != xt.sizes() || rt.device() != xt.device() ||
      !rt.is_contiguous() || rt.key_set().has(c10::DispatchKey::Python) || rt._fw_grad(0).defined() ||
      rt.is_neg()) {
    return nullptr;
  }
  at::ScalarType h = xt.scalar_type();
  if (residual_dtype != Py_None) {
    if (!THPDtype_Check(residual_dtype)) return nullptr;
    h = reinterpret_cast<THPDtype*>(residual_dtype)->scalar_type;
    if (!kernel_dtype(h)) return nullptr;
  }
  *h_dtype = h;
  return mode;
}

// rms_norm's first step on the compiled path: the common call's result, or None (the call is
// not the fast path's, or a functorch wrapper): then rms_norm goes on in Python.
py::object common_call(py::handle x, py::handle ns, py::handle weight, py::handle eps, py::handle residual,
                       py::handle residual_dtype, py::handle offset, py::handle casting, py::handle out_dtype) {
  const bool has_residual = !residual.is_none();
  at::ScalarType h_dtype = at::kFloat;
  const CastingMode* mode =
      has_residual ? residual_path_mode(x.ptr(), ns.ptr(), weight.ptr(), eps.ptr(), residual.ptr(),
                                        residual_dtype.ptr(), offset.ptr(), casting.ptr(), out_dtype.ptr(), false,
                                        &h_dtype)
                   : fast_path_mode(x.ptr(), ns.ptr(), weight.ptr(), eps.ptr(), residual.ptr(), residual_dtype.ptr(),
                                    offset.ptr(), casting.ptr(), out_dtype.ptr(), false);
  if (mode == nullptr) return py::none();
  const Tensor& xt = THPVariable_Unpack(x.ptr());
  std::optional<Tensor> w;
  // y's dtype (ops.rms_norm's rule): x's, or with a promoting casting (llama) the normalised
  // input's (h's with a residual) promoted with the weight's.
  at::ScalarType out = has_residual && mode->promotes ? h_dtype : xt.scalar_type();
  if (!weight.is_none()) {
    w = THPVariable_Unpack(weight.ptr());
    if (mode->promotes) out = at::promote_types(out, w->scalar_type());
  }
  // eps None: torch's default, the epsilon of the opmath type (float32 for the kernels' dtypes)
  const double e = eps.is_none() ? default_eps : PyFloat_AS_DOUBLE(eps.ptr());
  const double off = PyFloat_AS_DOUBLE(offset.ptr());
  if (has_residual) {
    return call_residual_op(xt, THPVariable_Unpack(residual.ptr()), w, e, off, mode->code, out, h_dtype);
  }
  return call_op(xt, w, e, off, mode->code, out);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("common_call", &common_call, "rms_norm's fast path: its result, or None");
  m.def(
      "takes_fast_path",
      [](py::handle x, py::handle ns, py::handle weight, py::handle eps, py::handle residual,
         py::handle residual_dtype, py::handle offset, py::handle casting, py::handle out_dtype) {
        return fast_path_mode(x.ptr(), ns.ptr(), weight.ptr(), eps.ptr(), residual.ptr(), residual_dtype.ptr(),
                              offset.ptr(), casting.ptr(), out_dtype.ptr(), true) != nullptr;
      },
      "common_call's predicate on CPU tensors too (the tests compare it with ops._takes_fast_path)");
  m.def(
      "takes_residual_path",
      [](py::handle x, py::handle ns, py::handle weight, py::handle eps, py::handle residual,
         py::handle residual_dtype, py::handle offset, py::handle casting, py::handle out_dtype) {
        at::ScalarType h_dtype;
        return residual_path_mode(x.ptr(), ns.ptr(), weight.ptr(), eps.ptr(), residual.ptr(), residual_dtype.ptr(),
                                  offset.ptr(), casting.ptr(), out_dtype.ptr(), true, &h_dtype) != nullptr;
      },
      "common_call's predicate for a call with a residual, on CPU tensors too (the tests check it against "
      "contract.validate)");
  m.def("set_contract", [](const std::vector<int64_t>& dtypes,
                           const std::vector<std::tuple<std::string, int64_t, bool>>& modes, double eps) {
    kernel_dtypes = 0;
    for (const int64_t code : dtypes) kernel_dtypes |= uint64_t{1} << code;
    casting_modes.clear();
    for (const auto& [name, code, promotes] : modes) casting_modes.push_back({name, code, promotes});
    default_eps = eps;
    parameter_type = reinterpret_cast<PyTypeObject*>(py::module_::import("torch.nn").attr("Parameter").ptr());
  });
  m.def("set_callbacks", [](py::object plan_forward, py::object plan_backward, py::object composite) {
    plan_forward_fn = new py::object(std::move(plan_forward));
    plan_backward_fn = new py::object(std::move(plan_backward));
    composite_backward_fn = new py::object(std::move(composite));
  });
  m.def("counts", [] { return py::make_tuple(forward_calls.load(), backward_calls.load()); });
  m.def("reset_counts", [] {
    forward_calls = 0;
    backward_calls = 0;
  });
  m.def("plans", [] { return py::make_tuple(forward_plans.size(), backward_plans.size()); });
  m.def("clear_plans", [] {
    forward_plans.clear();
    backward_plans.clear();
  });
}
