// Detects that an HTTP client went away while its request is still being generated.
// cpp-httplib 0.11 does not expose a request's socket to handlers, so the socket is found by
// its address pair (local port, peer port) among this process's descriptors (Linux /proc).
#pragma once
#include <string>

namespace lily::server {

/// Watches one accepted TCP connection for the peer closing it.
class ConnectionWatch {
 public:
  /// Finds the socket whose local port is `local_port` and peer is remote_addr:remote_port.
  /// When none is found, closed() always answers false.
  ConnectionWatch(const std::string& remote_addr, int remote_port, int local_port);
  /// True once the peer has closed or reset the connection (non-blocking check).
  bool closed() const;
  /// True when the socket was found.
  bool valid() const { return fd_ >= 0; }
  /// Shuts the connection down in both directions (what was written is still delivered, then a
  /// FIN): the server's next read on it ends, so the connection is closed. No-op when not found.
  void shut_down() const;

 private:
  int fd_ = -1;
};

}  // namespace lily::server
