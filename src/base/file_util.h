// Reading the small files of a checkpoint (config.json, tokenizer.json, the shard index, …)
// without ever blocking on something that is not a regular file: a plain open(2) of a FIFO given
// as config.json would hang `lily inspect` and `lily serve` until a writer appeared.
#pragma once
#include <filesystem>
#include <string>

namespace lily {

/// "a FIFO (named pipe)", "a directory", "a socket", "a character device", "a block device",
/// "a symbolic link" or "not a regular file" for a stat(2) st_mode value.
std::string file_type_description(unsigned mode);

/// Opens `path` read-only and returns the descriptor (the caller closes it). The open uses
/// O_NONBLOCK, so it returns at once for a FIFO with no writer, and the type is checked with
/// fstat(2) before any read; the descriptor returned is blocking again. Throws lily::Error
/// naming the path: "PATH: cannot open: <strerror>" or "PATH: is a FIFO (named pipe), not a
/// regular file".
int open_regular_file(const std::filesystem::path& path);

/// Whether something exists at `path` (links followed): false when nothing is there (ENOENT,
/// ENOTDIR), true for any file type (a FIFO or a directory too: reading it is what refuses it).
/// Any other failure of stat(2) throws lily::Error "PATH: <strerror>" (a symbolic-link loop, a
/// permission error), so that an optional checkpoint file is never silently taken as absent.
bool optional_file_exists(const std::filesystem::path& path);

/// The whole content of the regular file at `path` (bytes, no conversion). Throws lily::Error as
/// open_regular_file does, or "PATH: read failed: <strerror>".
std::string read_regular_file(const std::filesystem::path& path);

}  // namespace lily
