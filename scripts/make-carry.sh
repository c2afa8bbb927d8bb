#!/usr/bin/env bash
# Packs the build dependencies that the GPU machine (Ubuntu 24.04, no package registry) lacks:
# PCRE2, utf8proc and cpp-httplib headers and libraries from this Debian 12 machine, with
# pkg-config files relative to their own folder. Output: carry/deps (git-ignored); pass
# `carry/deps` to the device tool and set PKG_CONFIG_PATH=$PWD/carry/deps/lib/pkgconfig there.
set -euo pipefail
cd "$(dirname "$0")/.."
D=carry/deps
rm -rf "$D" && mkdir -p "$D/include" "$D/lib/pkgconfig"
LIB=/usr/lib/x86_64-linux-gnu
cp /usr/include/pcre2.h /usr/include/utf8proc.h /usr/include/httplib.h "$D/include/"
# httplib.h (built with OpenSSL/zlib/brotli support) includes these headers too.
cp -r /usr/include/brotli /usr/include/openssl "$D/include/"
cp /usr/include/x86_64-linux-gnu/openssl/* "$D/include/openssl/"
cp /usr/include/zlib.h /usr/include/zconf.h "$D/include/" 2>/dev/null || cp /usr/include/zlib.h "$D/include/"
cp -a $LIB/libpcre2-8.a $LIB/libutf8proc.a "$D/lib/"
cp -a $LIB/libcpp-httplib.so* "$D/lib/"
for l in libbrotlicommon libbrotlidec libbrotlienc; do cp -a $LIB/$l.so* "$D/lib/"; done
pc() {  # name, libs, cflags
  cat > "$D/lib/pkgconfig/$1.pc" <<PC
prefix=\${pcfiledir}/../..
Name: $1
Description: carried for the GPU machine
Version: 0
Libs: -L\${prefix}/lib $2
Cflags: -I\${prefix}/include $3
PC
}
pc libpcre2-8 "-lpcre2-8" ""  # only the .a is carried, so -l links it statically
pc libutf8proc "-lutf8proc" ""
pc cpp-httplib "-lcpp-httplib -Wl,-rpath,\${prefix}/lib -Wl,-rpath-link,\${prefix}/lib" \
  "-DCPPHTTPLIB_OPENSSL_SUPPORT -DCPPHTTPLIB_ZLIB_SUPPORT -DCPPHTTPLIB_BROTLI_SUPPORT"
du -sh "$D"
