// Registration functions of the nanobind module _dockyard_kernels.
//
// Each kernel's binding lives in its own <kernel>_binding.cc and adds its
// functions to the module here; cc/dockyard_kernels_binding.cc defines the
// module and calls them all. Only argument plumbing belongs in bindings: the
// maths and its validation live in the core libraries (no Python headers).

#ifndef DOCKYARD_CC_BINDINGS_H_
#define DOCKYARD_CC_BINDINGS_H_

#include <nanobind/nanobind.h>

namespace dockyard::kernels {

void bind_advantages(nanobind::module_& m);
void bind_logprobs(nanobind::module_& m);
void bind_refit_packer(nanobind::module_& m);

}  // namespace dockyard::kernels

#endif  // DOCKYARD_CC_BINDINGS_H_
