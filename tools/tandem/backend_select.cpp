#include "tools/tandem/backend_select.h"

#include <fmt/format.h>

#include "kernels/base/error.h"
#ifdef TANDEM_HAS_CUDA
#include "kernels/backend/cuda/cuda_backend.h"
#endif

namespace tandem::cli {

backend::device select_backend(const std::string& name, int32_t device) {
  if (name == "cpu") return {};
  if (name != "cuda")
    throw tandem::error(error_kind::failed,
                        fmt::format("backend '{}' is not a backend; use cpu or cuda", name));
#ifdef TANDEM_HAS_CUDA
  return backend::make_cuda_device(backend::cuda_options{device});
#else
  (void)device;
  throw tandem::error(error_kind::unimplemented,
                      "backend 'cuda': this tandem was built without the CUDA backend; rebuild it with "
                      "-DTANDEM_CUDA=ON (cmake --preset cuda, needs nvcc) or use --backend cpu");
#endif
}

int32_t cuda_devices_here() {
#ifdef TANDEM_HAS_CUDA
  return backend::cuda_device_count();
#else
  return -1;
#endif
}

}  // namespace tandem::cli
