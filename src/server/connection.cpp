#include "server/connection.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>

namespace lily::server {

namespace {

/// Port and printable address of a socket address (IPv4 or IPv6).
bool describe(const sockaddr_storage& ss, std::string& addr, int& port) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, buf, sizeof buf);
    port = ntohs(a->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, buf, sizeof buf);
    port = ntohs(a->sin6_port);
  } else {
    return false;
  }
  addr = buf;
  return true;
}

bool matches(int fd, const std::string& remote_addr, int remote_port, int local_port) {
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return false;
  sockaddr_storage local{}, peer{};
  socklen_t len = sizeof local;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) != 0) return false;
  len = sizeof peer;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len) != 0) return false;
  std::string la, pa;
  int lp = 0, pp = 0;
  if (!describe(local, la, lp) || !describe(peer, pa, pp)) return false;
  return lp == local_port && pp == remote_port && (remote_addr.empty() || pa == remote_addr);
}

}  // namespace

ConnectionWatch::ConnectionWatch(const std::string& remote_addr, int remote_port, int local_port) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    const int fd = std::atoi(e->d_name);
    if (fd != dirfd(dir) && matches(fd, remote_addr, remote_port, local_port)) {
      fd_ = fd;
      break;
    }
  }
  closedir(dir);
}

bool ConnectionWatch::closed() const {
  if (fd_ < 0) return false;
  pollfd p{fd_, static_cast<short>(POLLRDHUP), 0};
  if (poll(&p, 1, 0) <= 0) return false;
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

void ConnectionWatch::shut_down() const {
  if (fd_ >= 0) shutdown(fd_, SHUT_RDWR);
}

}  // namespace lily::server
