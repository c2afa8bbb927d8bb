// A fixture for the layering check's own test: a server source that includes a kernel header.
// check_layering.cmake must refuse this tree (tests/CMakeLists.txt, layering_refuses_a_violation).
#include "backends/cuda/kernels.h"
#include "engine/backend.h"
