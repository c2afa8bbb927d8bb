// The error the engine (and the server, for its own options) throws for a setting it cannot run
// with. It speaks the layer's own terms (the option's field name, as in EngineOptions,
// SessionCacheOptions, CudaOptions or ServerOptions, or the LILY_CUDA_* variable that gave the
// value) and never a front end's: a command line that set the option with a flag rewords the
// message with message_naming.
#pragma once
#include <string>
#include <string_view>
#include <utility>

#include "base/error.h"

namespace lily {

/// An option with a value the engine or the server cannot run with. what() is "<field> <detail>",
/// e.g. "max_batch 65 is outside [1, 64]: the cpu backend runs at most 64 sequences per step".
class OptionError : public Error {
 public:
  /// `field`: the option's field name ("max_batch"); `detail`: what is wrong, after the name.
  OptionError(std::string field, std::string detail)
      : Error(field + " " + detail), field_(std::move(field)), detail_(std::move(detail)) {}

  /// The option's field name ("max_batch", "host_bytes").
  const std::string& field() const { return field_; }
  /// What is wrong with the value, without the option's name.
  const std::string& detail() const { return detail_; }
  /// The message with `name`, the option as the user set it ("--max-batch"), for the field.
  std::string message_naming(std::string_view name) const { return std::string(name) + " " + detail_; }

 private:
  std::string field_;
  std::string detail_;
};

}  // namespace lily
