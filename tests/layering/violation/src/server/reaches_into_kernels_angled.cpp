// A fixture for the layering check's own test: the same violation written with angle brackets
// (src/ is a public include root, so it would compile). check_layering.cmake must refuse it.
#include <backends/cuda/kernels.h>
#include <vector>
