// A fixture for the layering check's own test: a backend source that includes an engine header
// other than the Backend interface. check_layering.cmake must refuse it.
#include "engine/backend.h"
#include "engine/scheduler.h"
