#!/usr/bin/env bash
# Packs the build dependencies that the GPU machine (Ubuntu 24.04, no package registry) lacks:
# PCRE2 and utf8proc headers and libraries, and the Boost headers that the HTTP server
# (Boost.Beast/Asio, header-only) includes, from this Debian 12 machine, with pkg-config files
# relative to their own folder. Output: carry/deps (git-ignored); copy
# `carry/deps` along with the working tree to the GPU machine and set
# PKG_CONFIG_PATH=$PWD/carry/deps/lib/pkgconfig there (scripts/gpu-common.sh does).
set -euo pipefail
cd "$(dirname "$0")/.."
D=carry/deps
rm -rf "$D" && mkdir -p "$D/include" "$D/lib/pkgconfig"
LIB=/usr/lib/x86_64-linux-gnu
cp /usr/include/pcre2.h /usr/include/utf8proc.h "$D/include/"
cp -a $LIB/libpcre2-8.a $LIB/libutf8proc.a "$D/lib/"
# Boost (all of it is 180 MB): the headers src/server includes, found by the preprocessor here,
# plus the whole of asio, beast, system and config, whose compiler- and platform-dependent
# branches may pick other files with the GPU machine's gcc 13 (about 10 MB in all).
BOOST=/usr/include/boost
test -f $BOOST/version.hpp || { echo "make-carry: no Boost headers (apt-get install libboost1.81-dev)"; exit 1; }
includes=$(grep -h '^#include <boost/' src/server/*.h src/server/*.cpp | sort -u)
printf '%s\n' "$includes" | g++ -std=c++20 -DBOOST_ASIO_NO_DEPRECATED -DBOOST_BEAST_USE_STD_STRING_VIEW \
    -M -x c++ - | tr ' \\' '\n\n' | grep "^$BOOST/" | sort -u | sed "s#^/usr/include/##" |
  (cd /usr/include && xargs cp --parents -t "$OLDPWD/$D/include")
for lib in asio beast system config; do cp -r $BOOST/$lib "$D/include/boost/"; done
cp $BOOST/asio.hpp $BOOST/beast.hpp $BOOST/config.hpp $BOOST/version.hpp "$D/include/boost/"
# Check: with the carry first on the include path, no header comes from /usr/include/boost.
if printf '%s\n' "$includes" | g++ -std=c++20 -DBOOST_ASIO_NO_DEPRECATED -DBOOST_BEAST_USE_STD_STRING_VIEW \
    -I"$D/include" -M -x c++ - | tr ' \\' '\n\n' | grep -q "^$BOOST/"; then
  echo "make-carry: the carried Boost headers are incomplete"; exit 1
fi
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
pc lily-boost "" ""  # header-only: CMakeLists.txt falls back to it when find_package(Boost) fails
du -sh "$D"
