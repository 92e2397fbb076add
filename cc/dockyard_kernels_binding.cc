// _dockyard_kernels: the nanobind module over the core kernels.
//
// Arrays arrive through DLPack (torch tensors, numpy arrays) without copies
// and calls dispatch on the arrays' device. nanobind turns
// std::invalid_argument into ValueError, std::out_of_range into IndexError
// and std::runtime_error into RuntimeError.
//
// Built with -DDOCKYARD_WITH_CUDA (--config=cuda, which also links cc/cuda/)
// for the CUDA paths; without it CUDA arrays raise a RuntimeError saying so.

#include <nanobind/nanobind.h>

#include "cc/bindings.h"

NB_MODULE(_dockyard_kernels, m) {
  m.doc() =
      "dockyard_rl C++/CUDA kernels. Use dockyard_rl.kernels, which validates "
      "tensors and falls back to torch; this module is its thin binding.";
#ifdef DOCKYARD_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  dockyard::kernels::bind_advantages(m);
  dockyard::kernels::bind_logprobs(m);
  dockyard::kernels::bind_refit_packer(m);
}
