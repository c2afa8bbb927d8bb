// Errors a user can act on. Input-dependent failures (a checkpoint, a config, a request, the
// command line) throw lily::Error with a message that names the thing and what was wrong;
// internal invariants use LILY_CHECK, which throws lily::InternalError (never aborts).
#pragma once
#include <stdexcept>
#include <string>

namespace lily {

/// A failure caused by input (file, request, flag). The message is shown to the user as is.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A checkpoint/config that is not a supported qwen3_5_moe MLX 4-bit checkpoint.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

/// A broken internal invariant (a bug in lily, not in the input).
class InternalError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

}  // namespace lily

/// Always-on invariant check; throws lily::InternalError with file:line and the condition.
#define LILY_CHECK(cond)                                                                   \
  do {                                                                                     \
    if (!(cond))                                                                           \
      throw ::lily::InternalError(std::string(__FILE__) + ":" + std::to_string(__LINE__) + \
                                  ": check failed: " #cond);                               \
  } while (0)
